"""The serving workload offline, shared by the measuring tools: ``bench serve``'s quick prompts (2 per task) and one
pass of them through a ``BatchEngine``, C in flight, a new one joining as one ends: what ``bench serve`` measures,
without HTTP and client.  Imported by the tools run from this directory (``python tools/measure_....py``)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from specdecode.batch_engine import BatchEngine, BatchRequest
from specdecode.bench import common
from specdecode.bench import serve as serve_bench
from specdecode.bench.suites import load_tasks
from specdecode.config import GenerationConfig
from specdecode.drafters import create_drafter
from specdecode.generator import SpeculativeGenerator


def quick_prompts(target, model: str, room: int | None = None) -> tuple[list, int]:
    """The quick prompts encoded for ``target``, each leaving ``room`` new tokens (default: ``bench serve``'s), and
    ``bench serve``'s new tokens per request."""
    settings = serve_bench.resolve_settings(model=model, prompts_per_task=2)
    tasks = load_tasks(settings.tasks, settings.prompts_per_task, settings.seed)
    encoder = common.PromptEncoder(target, model, settings.max_new_tokens if room is None else room)
    return encoder.encode_tasks(tasks), settings.max_new_tokens


def pld_engine(target, max_batch: int) -> BatchEngine:
    """A fresh batched engine drafting with ``pld`` (a request asks for no drafts with ``num_draft_tokens=0``)."""
    engine = SpeculativeGenerator(target, create_drafter("pld", target), GenerationConfig()).batch_engine(max_batch)
    engine.preallocate(2048)
    return engine


@dataclass
class Pass:
    """One pass over every prompt: the tokens generated, its seconds and steps, and each request's tokens."""

    tokens: int
    seconds: float
    steps: int
    outputs: dict[str, list[int]]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def serve_offline(engine: BatchEngine, encoded: list, config: GenerationConfig, concurrency: int) -> Pass:
    """Every prompt of ``encoded`` through ``engine`` with ``config``, ``concurrency`` in flight, the prefix cache
    emptied first."""
    engine.prefix_cache.clear()
    queue, in_flight, steps, outputs = list(encoded), 0, 0, {}
    started = time.perf_counter()
    while queue or not engine.idle:
        while queue and in_flight < concurrency:
            item = queue.pop(0)
            engine.submit(BatchRequest(item.ids, config, tag=item.key))
            in_flight += 1
        for event in engine.step():
            outputs.setdefault(event.tag, []).extend(event.new_tokens)
            in_flight -= event.finished
        steps += 1
    seconds = time.perf_counter() - started
    return Pass(sum(len(tokens) for tokens in outputs.values()), seconds, steps, outputs)
