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

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from specdecode.batch_engine import BatchRequest
from specdecode.bench import common, peers
from specdecode.bench.methods import MethodSpec
from specdecode.bench.resume import resume, run_fingerprint
from specdecode.bench.throughput_report import summarize_cell, write_report
from specdecode.data.tasks import TASK_NAMES, Task, load_tasks
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
class ThroughputSettings(common.PromptSettings):
    methods: tuple[MethodSpec, ...]
    batch_sizes: tuple[int, ...]
    peers: bool
    threads: int

    def __post_init__(self) -> None:
        super().__post_init__()
        common.check_positive_ints(("--threads", self.threads))
        common.check_positive_int_list("--batch-sizes", self.batch_sizes)


def resolve_settings(**overrides: Any) -> ThroughputSettings:
    """The defaults, overridden by every given (non-None) value; strings are parsed as on the command line."""
    parsers = common.cell_parsers("batch_sizes", "--batch-sizes")
    values = common.resolve_values(ThroughputSettings, DEFAULTS, overrides, "throughput setting", parsers)
    return ThroughputSettings(
        **{**values, "batch_sizes": tuple(sorted(set(values["batch_sizes"]))), "peers": bool(values["peers"])}
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
    engine = generator.batch_engine(batch_size)  # driven here for each request's finish time
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


def run_throughput(
    settings: ThroughputSettings, tasks: Sequence[Task] | None = None, progress: bool = True
) -> dict[str, Any]:
    """Measure every cell not yet in ``settings.out``; write results.json, results.md and throughput.png.

    ``tasks`` replaces the real prompt sets (tests inject tiny ones).  Returns the results JSON."""
    tasks = list(tasks) if tasks is not None else load_tasks(settings.tasks, settings.prompts_per_task, settings.seed)
    fingerprint = run_fingerprint(settings, tasks)
    previous = resume(settings.out / RESULTS_FILE, fingerprint, SCHEMA_VERSION)
    results = previous or common.new_results(SCHEMA_VERSION, fingerprint)

    def measure(pending: list[tuple[str, int]]) -> None:
        _measure(settings, tasks, pending, results, progress)

    return common.run_cells(
        results, settings, cell_order(settings), "batch_size", measure, write_report, settings.out / RESULTS_FILE
    )


def _measure(
    settings: ThroughputSettings,
    tasks: Sequence[Task],
    pending: list[tuple[str, int]],
    results: dict[str, Any],
    progress: bool,
) -> None:
    target = load_model(settings.model)
    methods = {m.spec: m for m in settings.methods}
    methods.setdefault(REFERENCE, MethodSpec("none", spec=REFERENCE))
    drafts = {name: load_model(name) for name in sorted({m.draft_model for m in methods.values()} - {None})}
    encode = common.PromptEncoder(target, settings.model, settings.max_new_tokens)
    encoded = encode.encode_tasks(tasks)
    keys, prompts = [e.key for e in encoded], [e.ids for e in encoded]
    results["chat_template"] = encode.chat
    results["prompts"] = [{"prompt": key, "prompt_tokens": len(ids)} for key, ids in zip(keys, prompts)]
    results["environment"] = {**common.environment(settings.threads), "fast_path": fast_path_default()}
    peer_model: LoadedModel | None = None
    warm: set[str] = set()

    def generator_for(method: MethodSpec) -> SpeculativeGenerator:
        return SpeculativeGenerator.build(target, method.drafter, **common.drafter_options(method, drafts))

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
            started = common.add_cell(results, cell, settings.out / RESULTS_FILE, started)
            bar.update()
    results["environment"]["load_average_end"] = common.load_average()


def _reference(results: dict[str, Any]) -> dict[str, list[int]] | None:
    """The solo plain outputs (method ``none`` at B=1) by prompt key, once measured."""
    cell = next((c for c in results["cells"] if (c["method"], c["batch_size"]) == (REFERENCE, 1)), None)
    return None if cell is None else {r["prompt"]: r["token_ids"] for r in cell["per_request"]}
