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
from pathlib import Path

import torch

ROWS = (1, 8, 128)


def measure(model: str, layout: str) -> dict:
    from specdecode.models import fastpath

    if layout == "onednn":
        fastpath.panels_pay = lambda: False
    from forward_timing import CACHED, forward_ms

    from specdecode.models.loading import load_model

    backend = load_model(model).backend
    ids = torch.randint(100, 1000, (CACHED + max(ROWS),), generator=torch.Generator().manual_seed(0))
    times = {rows: forward_ms(backend, ids, rows) for rows in ROWS}
    return {"layout": layout, "capability": str(torch.backends.cpu.get_cpu_capability()), "forward_ms": times}


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
