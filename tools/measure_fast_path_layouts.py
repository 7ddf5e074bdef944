"""Time whole forwards of a model with the fast path's two fp32 layouts: our panel product and oneDNN's.

The model loaded twice (each layout in a process of its own), 100 prompt tokens cached, then forwards of 1, 8 and
128 new tokens (the cache cropped back after each); the fastest of three rounds' means.  Run it under
``ATEN_CPU_CAPABILITY=avx2 DNNL_MAX_CPU_ISA=AVX2`` to hold torch, oneDNN and our kernels to AVX2.

    python tools/measure_fast_path_layouts.py --model smollm2-135m --out docs/results/DIR/forwards.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

ROWS = (1, 8, 128)


def measure(model: str, layout: str) -> dict:
    from specdecode.models import fastpath

    if layout == "onednn":
        fastpath.panels_pay = lambda: False
    from specdecode.models.loading import load_model

    backend = load_model(model).backend
    ids = torch.randint(100, 1000, (100 + max(ROWS),), generator=torch.Generator().manual_seed(0))
    forward_ms = {}
    for rows in ROWS:
        means = []
        for _ in range(3):
            cache = backend.new_cache()
            backend.forward(ids[:100], cache)
            calls = 20 if rows < 100 else 5
            started = time.perf_counter()
            for _ in range(calls):
                backend.forward(ids[100 : 100 + rows], cache)
                cache.crop(100)
            means.append((time.perf_counter() - started) / calls * 1000)
        forward_ms[rows] = round(min(means), 2)
    return {"layout": layout, "capability": str(torch.backends.cpu.get_cpu_capability()), "forward_ms": forward_ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--one", choices=["panels", "onednn"], help=argparse.SUPPRESS)  # a child's measurement
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.model, args.one)))
        return
    runs = []
    for layout in ("onednn", "panels", "onednn", "panels"):
        argv = [sys.argv[0], "--model", args.model, "--out", str(args.out), "--one", layout]
        child = subprocess.run([sys.executable, *argv], capture_output=True, text=True, check=True)
        runs.append(json.loads(child.stdout.strip().splitlines()[-1]))
        print(runs[-1], flush=True)
    record = {"model": args.model, "threads": torch.get_num_threads(), "torch": torch.__version__, "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
