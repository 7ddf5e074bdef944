"""Time the ragged attention kernel (``kernels/ragged_attention.cpp``) per call and in the serving workload.

- per call: one layer's attention of 8 sequences with 1 to 12 new rows each at 400 and 1,000 cached positions, the
  model's head layout, fp32 (the median of 50 calls after five);
- the serving workload offline (``bench serve``'s quick prompts, ``pld``, C in flight): tokens per second of three
  passes after an untimed one, then one pass under the torch profiler for the kernel's share of the time, its mean
  microseconds per call and the rows per sequence it was given.

    python tools/measure_ragged_attention.py --model smollm2-135m --out docs/results/DIR/ragged-attention.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import Counter
from pathlib import Path

import torch
from serving_workload import pld_engine, quick_prompts, serve_offline
from torch.profiler import profile

import specdecode.models.ragged as ragged
from specdecode.config import GenerationConfig
from specdecode.models.loading import load_model

SEQUENCES = 8


def per_call(heads: int, kv_heads: int, dim: int) -> list[dict]:
    """Microseconds and GFLOPS per call at every rows-per-sequence and cached length."""
    op = ragged.ragged_attention_op()
    results = []
    for cached in (400, 1000):
        for rows in (1, 3, 7, 12):
            generator = torch.Generator().manual_seed(rows * cached)
            capacity = cached + rows + 16 * SEQUENCES
            keys = torch.randn(SEQUENCES, kv_heads, capacity, dim, generator=generator)
            values = torch.randn(SEQUENCES, kv_heads, capacity, dim, generator=generator)
            query = torch.randn(heads, SEQUENCES * rows, dim, generator=generator)
            pasts = [cached + 16 * s for s in range(SEQUENCES)]  # a batch's sequences differ in length
            meta = torch.tensor([[s, s * rows, rows, past, -1] for s, past in enumerate(pasts)])
            positions = torch.cat([torch.arange(past, past + rows) for past in pasts])
            out = torch.empty(SEQUENCES * rows, heads, dim)
            args = (query, keys, values, meta, torch.zeros(0, dtype=torch.bool), positions, dim**-0.5, 0, out)
            for _ in range(5):
                op(*args)
            times = []
            for _ in range(50):
                started = time.perf_counter()
                op(*args)
                times.append(time.perf_counter() - started)
            seconds = statistics.median(times)
            flops = sum(4 * heads * rows * (past + rows) * dim for past in pasts)
            results.append(
                {"rows": rows, "cached": cached, "us": round(seconds * 1e6, 1), "gflops": round(flops / seconds / 1e9)}
            )
            print(results[-1], flush=True)
    return results


def workload(model: str, concurrency: int) -> dict:
    """The serving workload's tokens per second, and the kernel's part of one profiled pass."""
    target = load_model(model)
    encoded, max_new_tokens = quick_prompts(target, model)
    engine = pld_engine(target, 16)
    config = GenerationConfig(max_new_tokens=max_new_tokens)
    serve_offline(engine, encoded, config, concurrency)  # drafters, caches and cost curves warm
    rates = [round(serve_offline(engine, encoded, config, concurrency).tokens_per_s, 1) for _ in range(3)]
    rows = Counter()
    kernel = ragged.ragged_attention_op()

    def counting(*args):
        for new in args[3][:, 2].tolist():
            rows[new] += 1
        return kernel(*args)

    ragged.ragged_attention_op = lambda: counting
    try:
        with profile() as profiled:
            serve_offline(engine, encoded, config, concurrency)
    finally:
        ragged.ragged_attention_op = lambda: kernel
    events = {event.key: event for event in profiled.key_averages()}
    total_us = sum(event.self_cpu_time_total for event in events.values())
    attention = events["specdecode_attention::ragged_attention"]
    layers = target.backend.model.config.num_hidden_layers
    return {
        "concurrency": concurrency,
        "tokens_per_s": rates,
        "kernel_share": round(attention.self_cpu_time_total / total_us, 3),
        "kernel_us_per_call": round(attention.self_cpu_time_total / attention.count, 1),
        "sequences_by_rows": {str(new): count // layers for new, count in sorted(rows.items())},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    config = load_model(args.model).backend.model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    record = {
        "model": args.model,
        "threads": torch.get_num_threads(),
        "per_call": per_call(heads, kv_heads, dim),
        "workload": workload(args.model, args.concurrency),
    }
    print(record["workload"], flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
