"""Time a prompt chunk's attention in the chunk kernel (``kernels/chunk_attention.cpp``) and in torch's SDPA, per call
and in whole prompts.

- per call: one layer's attention of a 128-token chunk at cached lengths 0 to 1920, the model's head layout, each
  way (the median of 20 calls after one);
- whole prompts: every prompt of ``bench serve``'s quick suite (2 per task) read alone through a ``BatchEngine`` up to
  its first token, prefix cache emptied, the chunk kernel on and off; prompt tokens per second (the better of two runs
  after an untimed one) and the torch profiler's time per kind of operation with the kernel on.

    python tools/measure_chunk_attention.py --model smollm2-135m --out docs/results/DIR/chunk-attention.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from serving_workload import quick_prompts
from torch import nn

import specdecode.models.ragged as ragged
from specdecode.batch_engine import BatchEngine, BatchRequest
from specdecode.config import GenerationConfig
from specdecode.drafters import create_drafter
from specdecode.generator import SpeculativeGenerator
from specdecode.models.loading import load_model

CHUNK = 128


def per_call(heads: int, kv_heads: int, dim: int) -> list[dict]:
    """Microseconds per call of each way at every cached length."""
    rows = []
    for past in (0, 128, 384, 640, 1024, 1920):
        generator = torch.Generator().manual_seed(past)
        keys = torch.randn(1, kv_heads, past + CHUNK, dim, generator=generator)
        values = torch.randn(1, kv_heads, past + CHUNK, dim, generator=generator)
        query = torch.randn(heads, CHUNK, dim, generator=generator)
        out = torch.empty(CHUNK, heads, dim)
        op = ragged.chunk_attention_op(query, None)
        visible = torch.ones(CHUNK, past + CHUNK, dtype=torch.bool).tril(past)
        kernel_us = _median_us(op, query, keys, values, 0, past, dim**-0.5, out)
        sdpa = nn.functional.scaled_dot_product_attention
        sdpa_us = _median_us(sdpa, query[None], keys, values, attn_mask=visible, enable_gqa=True)
        rows.append({"cached": past, "kernel_us": kernel_us, "sdpa_us": sdpa_us})
        print(rows[-1], flush=True)
    return rows


def _median_us(call, *args, **kwargs) -> float:
    call(*args, **kwargs)
    times = []
    for _ in range(20):
        started = time.perf_counter()
        call(*args, **kwargs)
        times.append(time.perf_counter() - started)
    return round(statistics.median(times) * 1e6, 1)


def read_prompts(engine: BatchEngine, prompts: list[list[int]]) -> float:
    """Seconds to read every prompt alone up to its first token."""
    config = GenerationConfig(max_new_tokens=1, num_draft_tokens=0)
    started = time.perf_counter()
    for ids in prompts:
        engine.prefix_cache.clear()
        engine.submit(BatchRequest(ids, config))
        while not engine.idle:
            engine.step()
    engine.prefix_cache.clear()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    target = load_model(args.model)
    config = target.backend.model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    calls = per_call(heads, kv_heads, dim)

    prompts = [item.ids for item in quick_prompts(target, args.model, room=1)[0]]
    engine = SpeculativeGenerator(target, create_drafter("pld", target), GenerationConfig()).batch_engine(8)
    engine.preallocate(2048)
    tokens = sum(len(ids) for ids in prompts)
    kernel_op = ragged.chunk_attention_op
    rates = {}
    for way, choose in (("kernel", kernel_op), ("sdpa", lambda query, window: None)):
        ragged.chunk_attention_op = choose
        read_prompts(engine, prompts)
        rates[way] = round(tokens / min(read_prompts(engine, prompts) for _ in range(2)), 1)
        print(way, rates[way], "prompt tokens/s", flush=True)
    ragged.chunk_attention_op = kernel_op
    with torch.profiler.profile() as profiler:
        read_prompts(engine, prompts)
    profile = {
        event.key: round(event.self_cpu_time_total / 1e6, 3)
        for event in profiler.key_averages()
        if event.self_cpu_time_total > 0.01 * 1e6
    }
    record = {
        "model": args.model,
        "threads": torch.get_num_threads(),
        "capability": str(torch.backends.cpu.get_cpu_capability()),
        "layout": {"heads": heads, "kv_heads": kv_heads, "head_dim": dim, "chunk": CHUNK},
        "per_call": calls,
        "prompts": len(prompts),
        "prompt_tokens": tokens,
        "prompt_tokens_per_s": rates,
        "profile_s_with_kernel": dict(sorted(profile.items(), key=lambda item: -item[1])),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
