"""``specdecode bench throughput``: tokens/s of batched decoding, per drafting method and batch size.

Every cell is one (method, batch size B): all prompts are submitted at once to one :class:`BatchEngine`
with at most B sequences decoding together (continuous batching), on a fresh generator (drafter state
cold), after one short untimed warm-up per method.  Every request is greedy with ``ignore_eos``, so it
makes exactly ``max_new_tokens`` tokens.  A cell's wall time runs from the submission of all prompts to
the last finish (prefill included); a request's latency from that submission to its own finish.

The reference for equality is method ``none`` at B=1 (solo plain decoding): always measured, first.  The
peer ``hf-plain-batched`` is transformers' batched ``generate()`` (left-padded, plain) on a model loaded
without our fast path, on chunks of B prompts in input order.  ``results.json`` is written after every
cell; a rerun with the same model, ``max_new_tokens`` and prompts skips the cells it already holds.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from specdecode.bench import peers, runner
from specdecode.bench.runner import MethodSpec, parse_int_list, parse_methods, save_json, torch_threads
from specdecode.bench.tasks import TASK_NAMES, Task, load_tasks
from specdecode.bench.throughput_report import summarize_cell, write_report
from specdecode.engine import BatchEngine, BatchRequest
from specdecode.errors import SpecDecodeError
from specdecode.generator import SpeculativeGenerator
from specdecode.models.loading import LoadedModel, fast_path_default, load_model

SCHEMA_VERSION = 1
RESULTS_FILE = "results.json"
PEER = "hf-plain-batched"
REFERENCE = "none"  # at batch size 1: the solo plain outputs every cell is compared with
WARMUP_TOKENS = 8
DEFAULTS: dict[str, Any] = {
    "model": "smollm2-135m",
    "methods": "none,pld,suffix",
    "batch_sizes": "1,2,4,8",
    "tasks": TASK_NAMES,
    "prompts_per_task": 1,
    "max_new_tokens": 96,
    "seed": 0,
    "out": "bench-out/throughput",
    "peers": True,
}


@dataclass(frozen=True)
class ThroughputSettings:
    model: str
    methods: tuple[MethodSpec, ...]
    batch_sizes: tuple[int, ...]
    tasks: tuple[str, ...]
    prompts_per_task: int
    max_new_tokens: int
    seed: int
    peers: bool
    threads: int
    out: Path

    def __post_init__(self) -> None:
        for label, value in (
            ("--prompts-per-task", self.prompts_per_task),
            ("--max-new-tokens", self.max_new_tokens),
            ("--threads", self.threads),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise SpecDecodeError(f"{label} must be a positive integer, got {value!r}")
        if not self.tasks:
            raise SpecDecodeError("no benchmark tasks selected")
        for task in self.tasks:
            if task not in TASK_NAMES:
                raise SpecDecodeError(f"unknown benchmark task {task!r}; choose from {', '.join(TASK_NAMES)}")
        sizes = self.batch_sizes
        if not sizes or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in sizes):
            raise SpecDecodeError(f"--batch-sizes takes comma-separated positive integers, got {self.batch_sizes!r}")

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(methods=[m.spec for m in self.methods], batch_sizes=list(self.batch_sizes), out=str(self.out))
        return {**data, "tasks": list(self.tasks)}


def resolve_settings(**overrides: Any) -> ThroughputSettings:
    """The defaults, overridden by every given (non-None) value; strings are parsed as on the command line."""
    given = {key: value for key, value in overrides.items() if value is not None}
    if unknown := sorted(set(given) - set(ThroughputSettings.__dataclass_fields__)):
        raise SpecDecodeError(f"unknown throughput setting(s): {', '.join(unknown)}")
    values = {**DEFAULTS, "threads": os.cpu_count() or 1, **given}
    methods = values["methods"]
    if isinstance(methods, str):
        methods = parse_methods(methods)
    sizes = values["batch_sizes"]
    if isinstance(sizes, str):
        sizes = parse_int_list(sizes, "--batch-sizes")
    tasks = values["tasks"]
    if isinstance(tasks, str):
        tasks = tuple(t.strip() for t in tasks.split(",") if t.strip())
    return ThroughputSettings(
        model=values["model"],
        methods=tuple(methods),
        batch_sizes=tuple(sorted(set(sizes))),
        tasks=tuple(tasks),
        prompts_per_task=values["prompts_per_task"],
        max_new_tokens=values["max_new_tokens"],
        seed=values["seed"],
        peers=bool(values["peers"]),
        threads=values["threads"],
        out=Path(values["out"]),
    )


def cell_order(settings: ThroughputSettings) -> list[tuple[str, int]]:
    """Every (method, batch size) to measure, in order: the solo plain reference first, the peer last."""
    cells = [(REFERENCE, 1)]
    cells += [(m.spec, b) for m in settings.methods for b in settings.batch_sizes if (m.spec, b) != (REFERENCE, 1)]
    return cells + ([(PEER, b) for b in settings.batch_sizes] if settings.peers else [])


# --------------------------------------------------------------------------------------------------------
# Measuring one cell


def run_ours(
    generator: SpeculativeGenerator,
    method: MethodSpec,
    prompts: Sequence[list[int]],
    batch_size: int,
    max_new_tokens: int,
) -> tuple[list[list[int]], list[float], float, list[float]]:
    """All prompts submitted at once to one engine of ``batch_size`` → (tokens, latencies, wall s, accepted)."""
    config = generator.config_for(max_new_tokens=max_new_tokens, num_draft_tokens=method.k, ignore_eos=True)
    # As SpeculativeGenerator.run_batch builds it (it gives no finish times, so the engine is driven here).
    engine = BatchEngine(
        generator.target.backend,
        generator.drafter,
        lambda c, drafter: generator.draft_length_policy(c.num_draft_tokens, drafter),
        generator.eos_ids,
        batch_size,
    )
    tokens: list[list[int]] = [[] for _ in prompts]
    latencies = [0.0] * len(prompts)
    accepted = [0.0] * len(prompts)
    start = time.perf_counter()
    for index, prompt_ids in enumerate(prompts):
        engine.submit(BatchRequest(prompt_ids, config, tag=index))
    for event in engine.run():
        if event.finished:
            latencies[event.tag] = time.perf_counter() - start
            tokens[event.tag] = list(event.sequence.generated)
            accepted[event.tag] = event.sequence.stats.mean_accepted_tokens
    return tokens, latencies, max(latencies), accepted


def run_peer(
    model: Any, prompts: Sequence[list[int]], batch_size: int, max_new_tokens: int, pad_token_id: int | None
) -> tuple[list[list[int]], list[float], float]:
    """transformers' batched generate() on chunks of ``batch_size`` prompts in order → (tokens, latencies, wall)."""
    tokens: list[list[int]] = []
    latencies: list[float] = []
    start = time.perf_counter()
    for first in range(0, len(prompts), batch_size):
        chunk = list(prompts[first : first + batch_size])
        result = peers.hf_plain_batched(model, chunk, max_new_tokens, ignore_eos=True, pad_token_id=pad_token_id)
        end = time.perf_counter() - start
        tokens += result.token_ids
        latencies += [end] * len(chunk)
    return tokens, latencies, max(latencies)


# --------------------------------------------------------------------------------------------------------
# The run


def prompt_fingerprint(tasks: Sequence[Task]) -> list[str]:
    """``task/id#hash`` of every request, in order: what a resumed run must share with the first."""
    return [
        f"{task.name}/{p.id}#{hashlib.sha256(p.text.encode()).hexdigest()[:12]}" for task in tasks for p in task.prompts
    ]


def _load_previous(settings: ThroughputSettings, fingerprint: dict[str, Any]) -> dict[str, Any] | None:
    path = settings.out / RESULTS_FILE
    if not path.exists():
        return None
    try:
        previous = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SpecDecodeError(f"cannot resume from {path}: {exc}; delete it or choose another --out") from exc
    if previous.get("schema_version") != SCHEMA_VERSION or previous.get("fingerprint") != fingerprint:
        old = previous.get("fingerprint") or {}
        raise SpecDecodeError(
            f"{path} holds results of other settings (model {old.get('model')!r}, max_new_tokens "
            f"{old.get('max_new_tokens')}, {len(old.get('prompts', []))} prompts; now {fingerprint['model']!r}, "
            f"{fingerprint['max_new_tokens']}, {len(fingerprint['prompts'])}): choose another --out or empty it"
        )
    return previous


def run_throughput(
    settings: ThroughputSettings, tasks: Sequence[Task] | None = None, progress: bool = True
) -> dict[str, Any]:
    """Measure every cell not yet in ``settings.out``; write results.json, results.md and throughput.png.

    ``tasks`` replaces the real prompt sets (tests inject tiny ones).  Returns the results JSON."""
    tasks = list(tasks) if tasks is not None else load_tasks(settings.tasks, settings.prompts_per_task, settings.seed)
    if not any(task.prompts for task in tasks):
        raise SpecDecodeError("the selected tasks have no prompts")
    fingerprint = {
        "model": settings.model,
        "max_new_tokens": settings.max_new_tokens,
        "prompts": prompt_fingerprint(tasks),
    }
    results = _load_previous(settings, fingerprint) or {
        "schema_version": SCHEMA_VERSION,
        "fingerprint": fingerprint,
        "cells": [],
        "measure_s": 0.0,
    }
    results["settings"] = settings.to_json()
    done = {(c["method"], c["batch_size"]) for c in results["cells"]}
    if pending := [cell for cell in cell_order(settings) if cell not in done]:
        with torch_threads(settings.threads):
            _measure(settings, tasks, pending, results, progress)
    order = {cell: i for i, cell in enumerate(cell_order(settings))}
    results["cells"].sort(key=lambda c: order.get((c["method"], c["batch_size"]), len(order)))
    save_json(settings.out / RESULTS_FILE, results)
    write_report(results, settings.out)
    return results


def _measure(
    settings: ThroughputSettings,
    tasks: Sequence[Task],
    pending: list[tuple[str, int]],
    results: dict[str, Any],
    progress: bool,
) -> None:
    from tqdm import tqdm

    target = load_model(settings.model)
    methods = {m.spec: m for m in settings.methods}
    methods.setdefault(REFERENCE, MethodSpec("none", spec=REFERENCE))
    drafts = {name: load_model(name) for name in sorted({m.draft_model for m in methods.values()} - {None})}
    chat = bool(getattr(target.tokenizer, "chat_template", None))  # a base model gets the plain text
    encoder = SpeculativeGenerator.build(target, "none")
    keys, prompts = [], []
    for task in tasks:
        for p in task.prompts:
            ids = encoder.encode_prompt(p.text, chat=chat)
            if len(ids) + settings.max_new_tokens > target.backend.max_context:
                raise SpecDecodeError(
                    f"prompt {p.id} is {len(ids)} tokens: with {settings.max_new_tokens} new tokens it exceeds "
                    f"the {target.backend.max_context}-token context of {settings.model!r}"
                )
            keys.append(f"{task.name}/{p.id}")
            prompts.append(ids)
    results["chat_template"] = chat
    results["prompts"] = [{"prompt": key, "prompt_tokens": len(ids)} for key, ids in zip(keys, prompts)]
    results["environment"] = {**runner.environment(settings.threads), "fast_path": fast_path_default()}
    peer_model: LoadedModel | None = None
    warm: set[str] = set()

    def generator_for(method: MethodSpec) -> SpeculativeGenerator:
        options = dict(method.options)
        if method.draft_model is not None:
            options["draft_model"] = drafts[method.draft_model]
        return SpeculativeGenerator.build(target, method.drafter, **options)

    started = time.perf_counter()
    with tqdm(
        total=len(pending), unit="cell", desc="bench throughput", disable=not progress, dynamic_ncols=True
    ) as bar:
        for name, batch_size in pending:
            bar.set_postfix_str(f"{name} B={batch_size}", refresh=False)
            reference = _reference(results)
            if name == PEER:
                if peer_model is None:
                    peer_model = load_model(settings.model, fast_path=False)
                tokenizer = peer_model.tokenizer
                pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
                model = peer_model.backend.model
                if name not in warm:  # warm-up: first-call allocations and kernel choice are not decoding
                    run_peer(model, prompts[:2], 2, WARMUP_TOKENS, pad)
                    warm.add(name)
                tokens, latencies, wall_s = run_peer(model, prompts, batch_size, settings.max_new_tokens, pad)
                cell = summarize_cell(name, "peer", batch_size, keys, tokens, latencies, wall_s, None, reference)
            else:
                method = methods[name]
                if name not in warm:
                    run_ours(generator_for(method), method, prompts[:2], 2, WARMUP_TOKENS)
                    warm.add(name)
                tokens, latencies, wall_s, accepted = run_ours(
                    generator_for(method), method, prompts, batch_size, settings.max_new_tokens
                )
                if (name, batch_size) == (REFERENCE, 1):
                    reference = dict(zip(keys, tokens))
                cell = summarize_cell(name, "ours", batch_size, keys, tokens, latencies, wall_s, accepted, reference)
            results["cells"].append(cell)
            now = time.perf_counter()
            results["measure_s"] = round(results["measure_s"] + now - started, 2)
            started = now
            save_json(settings.out / RESULTS_FILE, results)
            bar.update()
    results["environment"]["load_average_end"] = [round(x, 2) for x in os.getloadavg()]


def _reference(results: dict[str, Any]) -> dict[str, list[int]] | None:
    """The solo plain outputs (method ``none`` at B=1) by prompt key, once measured."""
    cell = next((c for c in results["cells"] if (c["method"], c["batch_size"]) == (REFERENCE, 1)), None)
    return None if cell is None else {r["prompt"]: r["token_ids"] for r in cell["per_request"]}
