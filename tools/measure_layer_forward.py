"""Time a model with the decoder layers' written-out forward (``models/layer_forward.py``) and with transformers'.

In one process, the two alternated: whole forwards of 1, 4, 8, 32 and 128 new tokens after 100 cached (the cache
cropped back after each; the fastest of three rounds' means), then the serving workload offline (every ``bench serve``
quick prompt, 2 per task, through a fresh ``BatchEngine``, C in flight, up to 96 tokens each; tokens per second, two
alternated runs each way) for plain decoding and ``pld`` at C = 1 and 8.

    python tools/measure_layer_forward.py --model smollm2-135m --out docs/results/DIR/layer-forward.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from specdecode.batch_engine import BatchRequest
from specdecode.bench import common
from specdecode.bench import serve as serve_bench
from specdecode.bench.suites import load_tasks
from specdecode.config import GenerationConfig
from specdecode.drafters import create_drafter
from specdecode.generator import SpeculativeGenerator
from specdecode.models.layer_forward import install_layer_forward, remove_layer_forward
from specdecode.models.loading import load_model

ROWS = (1, 4, 8, 32, 128)
WAYS = ("transformers", "written-out")


def forward_ms(backend, rows: int) -> float:
    ids = torch.randint(100, 1000, (100 + rows,), generator=torch.Generator().manual_seed(rows))
    means = []
    for _ in range(3):
        cache = backend.new_cache()
        backend.forward(ids[:100], cache)
        calls = 20 if rows < 100 else 5
        started = time.perf_counter()
        for _ in range(calls):
            backend.forward(ids[100:], cache)
            cache.crop(100)
        means.append((time.perf_counter() - started) / calls * 1000)
    return round(min(means), 2)


def workload(target, encoded: list, drafter: str, concurrency: int, max_new_tokens: int) -> float:
    """Tokens per second of one pass over every prompt through a fresh engine."""
    generator = SpeculativeGenerator(target, create_drafter("pld", target), GenerationConfig())
    engine = generator.batch_engine(8)
    engine.preallocate(2048)
    draft = {} if drafter == "pld" else {"num_draft_tokens": 0}
    queue, in_flight, tokens = list(encoded), 0, 0
    started = time.perf_counter()
    while queue or not engine.idle:
        while queue and in_flight < concurrency:
            item = queue.pop(0)
            engine.submit(BatchRequest(item.ids, GenerationConfig(max_new_tokens=max_new_tokens, **draft)))
            in_flight += 1
        for event in engine.step():
            tokens += len(event.new_tokens)
            in_flight -= event.finished
    return round(tokens / (time.perf_counter() - started), 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    target = load_model(args.model)
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
                forwards[way][rows].append(forward_ms(target.backend, rows))
        print(forwards, flush=True)
    settings = serve_bench.resolve_settings(model=args.model, prompts_per_task=2)
    tasks = load_tasks(settings.tasks, settings.prompts_per_task, settings.seed)
    encoded = common.PromptEncoder(target, args.model, settings.max_new_tokens).encode_tasks(tasks)
    workloads = []
    for concurrency in (1, 8):
        for drafter in ("none", "pld"):
            row = {"concurrency": concurrency, "drafter": drafter, **{way: [] for way in WAYS}}
            for _ in range(2):
                for way in WAYS:
                    use(way)
                    row[way].append(workload(target, encoded, drafter, concurrency, settings.max_new_tokens))
            workloads.append(row)
            print(row, flush=True)
    use("written-out")
    record = {
        "model": args.model,
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
