"""Time the w4a8 kernel with its weights requested 2, 4, 8 and 16 groups ahead (``PREFETCH_GROUPS``), on weights
too large for the caches, at the row counts of decoding and verification.

Builds one copy of the kernel per distance (the source with the constant replaced), packs random weights of
``qwen2.5-coder-1.5b``'s LM head and four of its gate-up and down projections (0.37 GB), and times all of them
per call of 1, 2 and 4 rows, the distances interleaved; the median of 7 passes.

    python tools/measure_w4a8_prefetch.py --out docs/results/DIR/prefetch.json
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

from specdecode.machine import cpu_name
from specdecode.models import w4a8
from specdecode.models.quantized_layers import int4_levels

DISTANCES = (2, 4, 8, 16)
SHAPES = ((151936, 1536),) + ((17920, 1536), (1536, 8960)) * 4


def build(distance: int, folder: Path):
    source = re.sub(r"PREFETCH_GROUPS = \d+;", f"PREFETCH_GROUPS = {distance};", w4a8.SOURCE.read_text())
    path = folder / f"w4a8_prefetch_{distance}.cpp"
    path.write_text(source)
    flags = ["-O3", "-mavx2", "-mfma", *w4a8.ISA_BUILDS[w4a8.best_isa()][1], "-fopenmp"]
    return load(name=f"w4a8_prefetch_{distance}", sources=[str(path)], extra_cflags=flags, extra_ldflags=["-fopenmp"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        kernels = {distance: build(distance, Path(folder)) for distance in DISTANCES}
    torch.manual_seed(0)
    layers = [(w4a8.pack_blocks(*int4_levels(torch.randn(n, k) * 0.02, w4a8.GROUP)), n, k) for n, k in SHAPES]
    weight_bytes = sum(blocks.numel() for blocks, _, _ in layers)
    cells = []
    for rows in (1, 2, 4):
        inputs = {k: torch.randn(rows, k) for k in {k for _, k in SHAPES}}
        seconds = {distance: [] for distance in DISTANCES}
        for _ in range(7):
            for distance, kernel in kernels.items():
                started = time.perf_counter()
                for blocks, n, k in layers:
                    kernel.w4a8_mm(inputs[k], blocks, n)
                seconds[distance].append(time.perf_counter() - started)
        for distance, times in seconds.items():
            median = statistics.median(times)
            cells.append(
                {
                    "rows": rows,
                    "prefetch_groups": distance,
                    "ms": round(median * 1000, 3),
                    "weight_gb_per_s": round(weight_bytes / median / 1e9, 1),
                }
            )
            print(cells[-1], flush=True)
    record = {"cpu": cpu_name(), "isa": w4a8.best_isa(), "weight_bytes": weight_bytes, "cells": cells}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
