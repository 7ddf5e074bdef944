"""Time the w4a8 kernel on a model's layer shapes beside oneDNN's bf16 matmul of the same weights (the copy prompts
took before the kernel beat it), at the row counts of decoding, verification and prompts.

Random weights of each shape of ``qwen2.5-coder-1.5b`` (fused query-key-value and gate-up as the decoding step
calls them, the output, down and LM head projections); the median of 7 calls after 2 that warm up; the LM head
from one row to 8 only (prompts ask it for their last row).

    python tools/measure_w4a8_layers.py --out docs/results/DIR/layers.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from specdecode.machine import cpu_name
from specdecode.models import quantized_layers, w4a8

#: (name, out_features, in_features) of qwen2.5-coder-1.5b's projections.
SHAPES = (
    ("qkv", 2048, 1536),
    ("o", 1536, 1536),
    ("gate_up", 17920, 1536),
    ("down", 1536, 8960),
    ("lm_head", 151936, 1536),
)
ROWS = (1, 4, 8, 32, 128)


def median_ms(call, *args, repeats: int = 7) -> float:
    for _ in range(2):
        call(*args)
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        call(*args)
        seconds.append(time.perf_counter() - started)
    return round(statistics.median(seconds) * 1000, 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--isa", choices=sorted(w4a8.ISA_BUILDS), help="the kernel build to time (default: the best)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.isa:  # e.g. avx2 on a VNNI CPU: the build an AVX2-only CPU runs, held to its instructions
        w4a8.best_isa = lambda: args.isa
    torch.manual_seed(0)
    cells = []
    for name, out_features, in_features in SHAPES:
        layer = w4a8.W4A8Linear(nn.Linear(in_features, out_features, bias=False), tied=False)
        copy = torch.ops.mkldnn._reorder_linear_weight(layer.dequantized().bfloat16(), None)
        for rows in ROWS if name != "lm_head" else ROWS[:3]:
            x = torch.randn(rows, in_features)
            kernel_ms = median_ms(layer.matmul, x)
            bf16_ms = median_ms(quantized_layers._packed_bf16_call, copy, x.bfloat16())
            macs = rows * out_features * in_features
            cells.append(
                {
                    "layer": name,
                    "rows": rows,
                    "w4a8_ms": kernel_ms,
                    "onednn_bf16_ms": bf16_ms,
                    "w4a8_gmac_per_s": round(macs / kernel_ms / 1e6),
                    "w4a8_weight_gb_per_s": round(layer.blocks.numel() / kernel_ms / 1e6, 1),
                }
            )
            print(cells[-1], flush=True)
    record = {
        "cpu": cpu_name(),
        "isa": w4a8.best_isa(),
        "threads": torch.get_num_threads(),
        "cells": cells,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
