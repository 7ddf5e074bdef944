"""Time one layer's attention of one sequence through the ragged attention kernel (``kernels/ragged_attention.cpp``):
1 to 16 new rows (a chain, as a verification of a draft feeds them) after 128, 300 and 1,000 cached positions, a
model's head layout, fp32; the median of 60 calls after five.  One JSON line is appended to ``--out`` per run, labelled,
so that runs of two builds alternated (one from a worktree of another commit, with its own ``TORCH_EXTENSIONS_DIR``)
land in one file.

    python tools/measure_attention_rows.py --label new --out docs/results/DIR/attention-rows.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path

import torch

import specdecode
from specdecode.machine import cpu_name
from specdecode.models.attention_kernel import ragged_attention_op
from specdecode.models.ragged import RaggedBatch, SequenceSlice, ragged_attention

CONTEXTS = (128, 300, 1000)
ROWS = (1, 4, 8, 12, 16)


class _Attention:  # what ragged_attention reads of an attention module
    class config:
        attn_logit_softcapping = None


def median_us(call, calls: int = 60) -> float:
    for _ in range(5):
        call()
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return round(statistics.median(times) * 1e6, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--label", required=True, help="names the build measured")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if ragged_attention_op() is None:
        raise SystemExit("the attention kernel is not built here: nothing to time")
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(1, args.kv_heads, max(CONTEXTS) + max(ROWS), args.dim, generator=generator)
    values = torch.randn(keys.shape, generator=generator)
    microseconds = {}
    for context in CONTEXTS:
        for rows in ROWS:
            query = torch.randn(1, args.heads, rows, args.dim, generator=generator)
            chain = SequenceSlice(0, slice(0, rows), context, torch.arange(context, context + rows), None)
            batch = RaggedBatch([chain])
            microseconds[f"{context}/{rows}"] = median_us(
                lambda q=query, b=batch: ragged_attention(_Attention, q, keys, values, None, 0.125, ragged=b)
            )
    source = Path(specdecode.__file__).resolve().parents[2]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=source, capture_output=True, text=True)
    record = {
        "label": args.label,
        "commit": commit.stdout.strip(),
        "cpu": cpu_name(),
        "capability": str(torch.backends.cpu.get_cpu_capability()),
        "threads": torch.get_num_threads(),
        "layout": {"heads": args.heads, "kv_heads": args.kv_heads, "dim": args.dim},
        "microseconds_by_context_and_rows": microseconds,
    }
    print(json.dumps(record))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as out:
        out.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
