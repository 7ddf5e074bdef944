"""Time a model with the decoder layers' written-out forward (``models/layer_forward.py``) and with transformers'.

In one process, the two alternated: whole forwards of 1, 4, 8, 32 and 128 new tokens after 100 cached (the cache
cropped back after each; the fastest of three rounds' means), then the serving workload offline (every ``bench serve``
quick prompt, 2 per task, through a fresh ``BatchEngine``, C in flight, up to 96 tokens each; tokens per second, two
alternated runs each way) for plain decoding and ``pld`` at C = 1 and 8.

    python tools/measure_layer_forward.py --model smollm2-135m --quantize bf16 --out docs/results/DIR/layer-forward.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from forward_timing import CACHED, forward_ms
from serving_workload import pld_engine, quick_prompts, serve_offline

from specdecode.config import GenerationConfig
from specdecode.models.layer_forward import install_layer_forward, remove_layer_forward
from specdecode.models.loading import load_model

ROWS = (1, 4, 8, 32, 128)
WAYS = ("transformers", "written-out")


def prompt_ids(rows: int) -> torch.Tensor:
    """The cached tokens and ``rows`` new ones, pseudo-random (their values do not change a forward's cost)."""
    return torch.randint(100, 1000, (CACHED + rows,), generator=torch.Generator().manual_seed(rows))


def workload(target, encoded: list, drafter: str, concurrency: int, max_new_tokens: int) -> float:
    """Tokens per second of one pass over every prompt through a fresh engine."""
    draft = {} if drafter == "pld" else {"num_draft_tokens": 0}
    config = GenerationConfig(max_new_tokens=max_new_tokens, **draft)
    return round(serve_offline(pld_engine(target, 8), encoded, config, concurrency).tokens_per_s, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--quantize", default="none", help="the target's weights, as --quantize")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    target = load_model(args.model, quantize=args.quantize)
    model = target.backend.model
    layers = install_layer_forward(model)

    def use(way: str) -> None:
        remove_layer_forward(model)
        if way == "written-out":
            install_layer_forward(model)

    forwards: dict[str, dict[int, list[float]]] = {way: {rows: [] for rows in ROWS} for way in WAYS}
    for _ in range(2):
        for way in WAYS:
            use(way)
            for rows in ROWS:
                forwards[way][rows].append(forward_ms(target.backend, prompt_ids(rows), rows))
        print(forwards, flush=True)
    encoded, max_new_tokens = quick_prompts(target, args.model)
    workloads = []
    for concurrency in (1, 8):
        for drafter in ("none", "pld"):
            row = {"concurrency": concurrency, "drafter": drafter, **{way: [] for way in WAYS}}
            for _ in range(2):
                for way in WAYS:
                    use(way)
                    row[way].append(workload(target, encoded, drafter, concurrency, max_new_tokens))
            workloads.append(row)
            print(row, flush=True)
    use("written-out")
    record = {
        "model": args.model,
        "quantize": args.quantize,
        "threads": torch.get_num_threads(),
        "capability": str(torch.backends.cpu.get_cpu_capability()),
        "layers_written_out": layers,
        "forward_ms": forwards,
        "workload_tokens_per_s": workloads,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
