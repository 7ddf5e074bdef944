"""Time the batched engine's step the way a server at concurrency C runs it, with our CPU kernels and without.

Two measurements per kind of kernels (each in a process of its own, ``SPECDECODE_CPU_KERNELS`` set for it: our
attention kernel and panel products, or torch's SDPA and oneDNN's products):

- the steady decoding step: C prompts of the quick suite read, then plain decoding of all C together; the mean step
  over 40 steps, and the torch profiler's time in attention and in the linear layers per step;
- the serving workload offline: every prompt of ``bench serve``'s quick suite (2 per task) through one
  ``BatchEngine``, C in flight, a new one joining as one ends, up to 96 tokens each, prefix cache emptied; tokens
  per second over the whole run (what ``bench serve`` measures, without HTTP and client).

    python tools/measure_batched_step.py --model smollm2-135m --concurrency 8 --out docs/results/DIR/step.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch


def measure(model: str, quantize: str, concurrency: int) -> dict:
    from serving_workload import pld_engine, quick_prompts, serve_offline
    from torch.profiler import profile

    from specdecode.batch_engine import BatchRequest
    from specdecode.config import GenerationConfig
    from specdecode.models.cpu_kernels import cpu_kernels_built
    from specdecode.models.loading import load_model

    target = load_model(model, quantize=quantize)
    encoded, max_new_tokens = quick_prompts(target, model)
    engine = pld_engine(target, 16)

    def plain(tokens: int, ignore_eos: bool = False) -> GenerationConfig:
        return GenerationConfig(max_new_tokens=tokens, num_draft_tokens=0, ignore_eos=ignore_eos)

    for item in [e for e in encoded if len(e.ids) < 400][:concurrency]:
        engine.submit(BatchRequest(item.ids, plain(400, ignore_eos=True), tag=item.key))
    while engine.waiting or any(seq.reading for _, seq in engine.running.values()):
        engine.step()
    for _ in range(10):
        engine.step()
    started = time.perf_counter()
    for _ in range(40):
        engine.step()
    step_ms = (time.perf_counter() - started) / 40 * 1000
    with profile() as profiler:
        for _ in range(20):
            engine.step()
    per_step = {}
    for event in profiler.key_averages():
        if "linear" in event.key or "attention" in event.key:
            per_step[event.key] = round(event.self_cpu_time_total / 20 / 1000, 2)
    for tag, _ in list(engine.running.values()):
        engine.cancel(tag)

    def workload() -> tuple[int, float]:
        done = serve_offline(engine, encoded, plain(max_new_tokens), concurrency)
        return done.tokens, done.seconds

    workload()  # first-call allocations
    tokens, seconds = workload()
    return {
        "kernels": "ours" if cpu_kernels_built() else "torch",
        "decode_step_ms": round(step_ms, 2),
        "profiled_ms_per_step": per_step,
        "workload_tokens": tokens,
        "workload_s": round(seconds, 2),
        "workload_tokens_per_s": round(tokens / seconds, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--quantize", default="none")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--one", choices=["ours", "torch"], help=argparse.SUPPRESS)  # a child's measurement
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.model, args.quantize, args.concurrency)))
        return
    runs = []
    for kernels in ("torch", "ours"):
        env = {**os.environ, "SPECDECODE_CPU_KERNELS": "1" if kernels == "ours" else "0"}
        argv = [sys.argv[0], "--model", args.model, "--quantize", args.quantize]
        argv += ["--concurrency", str(args.concurrency), "--out", str(args.out), "--one", kernels]
        child = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True, check=True)
        runs.append(json.loads(child.stdout.strip().splitlines()[-1]))
        print(runs[-1])
    record = {
        "model": args.model,
        "quantize": args.quantize,
        "concurrency": args.concurrency,
        "threads": torch.get_num_threads(),
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
