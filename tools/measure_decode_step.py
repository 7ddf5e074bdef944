"""Time a model's one-token decoding step as verification runs it (a row-invariant forward of one sequence), and
its reading of a prompt.

Loads the model in the given weight format, reads 200 tokens into a cache, then times one-token forwards after it
(the mean of 20 after 5 that warm up; the cache grows by one token each), and records the mean with the machine's
instruction sets: what one plain decoding step costs with this build of the kernels.  Then reads a prompt of
``--prompt-tokens`` (725: the quick suite's longest) into a fresh cache twice and records the faster.

    python tools/measure_decode_step.py --model qwen2.5-coder-1.5b --quantize w4a8 --out docs/results/DIR/step.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from specdecode.machine import cpu_name
from specdecode.models.base import SequenceInput
from specdecode.models.loading import load_model

CACHED = 200


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--quantize", default="w4a8")
    parser.add_argument("--prompt-tokens", type=int, default=725)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    backend = load_model(args.model, quantize=args.quantize).backend
    ids = torch.randint(100, 40000, (max(CACHED + 25, args.prompt_tokens),), generator=torch.Generator().manual_seed(0))
    cache = backend.new_cache()
    backend.forward(ids[:CACHED], cache, logits_rows=slice(-1, None), invariant=False)
    seconds = []
    for position in range(CACHED, CACHED + 25):
        started = time.perf_counter()
        backend.forward_batch([SequenceInput(ids[position : position + 1], cache, choices_only=True)])
        seconds.append(time.perf_counter() - started)
    prompt_seconds = []
    for _ in range(2):
        started = time.perf_counter()
        backend.forward(ids[: args.prompt_tokens], backend.new_cache(), logits_rows=slice(-1, None), invariant=False)
        prompt_seconds.append(time.perf_counter() - started)
    record = {
        "model": args.model,
        "quantize": args.quantize,
        "cpu": cpu_name(),
        "isa": str(torch.backends.cpu.get_cpu_capability()),
        "threads": torch.get_num_threads(),
        "cached_tokens": CACHED,
        "step_ms": round(sum(seconds[5:]) / 20 * 1000, 2),
        "prompt_tokens": args.prompt_tokens,
        "prompt_tokens_per_s": round(args.prompt_tokens / min(prompt_seconds), 1),
    }
    print(record)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
