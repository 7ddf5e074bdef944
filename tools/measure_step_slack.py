"""Sweep how much longer than a plain step a batched speculative step may take (``batch_plan.STEP_COST_SLACK``) on the
serving workload offline.

Every prompt of ``bench serve``'s quick suite (2 per task) through one ``BatchEngine``, C in flight, a new one joining
as one ends, up to 96 tokens each, the draft length ``auto`` (the engine's default), prefix cache emptied; per drafter
and slack, tokens per second and steps of two runs after an untimed one.  What ``bench serve`` measures, without HTTP
and client; its inter-token latencies need the served run.

    python tools/measure_step_slack.py --drafters pld,suffix --concurrency 8 --slack 0.08,0.25,0.5,1,2 \\
        --out docs/results/DIR/slack.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from serving_workload import quick_prompts, serve_offline

from specdecode import batch_plan
from specdecode.batch_engine import BatchEngine
from specdecode.config import GenerationConfig
from specdecode.drafters import create_drafter
from specdecode.generator import SpeculativeGenerator
from specdecode.models.loading import load_model


def workload(engine: BatchEngine, encoded: list, concurrency: int, max_new_tokens: int) -> tuple[float, int]:
    """Tokens per second and steps of one pass over every prompt."""
    done = serve_offline(engine, encoded, GenerationConfig(max_new_tokens=max_new_tokens), concurrency)
    return done.tokens_per_s, done.steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--drafters", default="pld,suffix")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--slack", default="0.08,0.25,0.5,1,2")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    target = load_model(args.model)
    encoded, max_new_tokens = quick_prompts(target, args.model)
    runs = []
    for drafter in args.drafters.split(","):
        engine = SpeculativeGenerator(target, create_drafter(drafter, target), GenerationConfig()).batch_engine(16)
        engine.preallocate(2048)
        for slack in [float(value) for value in args.slack.split(",")]:
            batch_plan.STEP_COST_SLACK = slack
            workload(engine, encoded, args.concurrency, max_new_tokens)  # drafters and caches warm
            measured = [workload(engine, encoded, args.concurrency, max_new_tokens) for _ in range(2)]
            runs.append(
                {
                    "drafter": drafter,
                    "slack": slack,
                    "tokens_per_s": [round(rate, 1) for rate, _ in measured],
                    "steps": [steps for _, steps in measured],
                }
            )
            print(runs[-1], flush=True)
    record = {
        "model": args.model,
        "concurrency": args.concurrency,
        "threads": torch.get_num_threads(),
        "prompts": len(encoded),
        "max_new_tokens": max_new_tokens,
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
