"""Run the benchmark: our drafting methods and transformers' ``generate()`` on the same prompts, in one run.

The unit of work is a *group* of prompts that run in order on one drafter: one prompt (the default), one
session of a session task (``multi-edit``), or with ``drafter_state="task"`` all of a task's prompts.
Every contestant (each of our methods, each peer) decodes the group ``repeats`` times, interleaved and in
a shuffled order, so a burst of load from other processes slows all of them alike instead of one cell —
our methods in turns, a step at a time, on each prompt (``interleave="step"``, :mod:`specdecode.bench.lockstep`),
peers a whole request at a time.  Our drafter is reset at the start of every repeat of a group and keeps what it
learns within the group — so drafters that learn across requests are measured cold on single prompts
and warm within a session.  Raw measurements are saved per prompt after every group; a rerun skips what
is already measured (resume), and the aggregation into cells (``cells.py``) only ever reads the raw data.

Timing is end to end: a request of ours from its prompt ids to its token ids (``generate()``'s work, which
also detokenises as it streams; in lockstep the sum of its turns), a peer's one call (``model.generate()``).
Every call is greedy with ``ignore_eos``, so every contestant produces exactly ``max_new_tokens`` tokens and
times are comparable.
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from specdecode.bench.cells import build_cells
from specdecode.bench.common import PromptEncoder, environment, load_average, settings_json
from specdecode.bench.contestants import Contestant, build_contestants, peer_specs
from specdecode.bench.lockstep import run_lockstep
from specdecode.bench.report import write_report
from specdecode.bench.resume import resume, save_json
from specdecode.bench.suites import BenchSettings, resolve_settings, sweep_methods
from specdecode.data.long_context import context_tokens_of
from specdecode.data.prompt_file import read_prompt_file
from specdecode.data.tasks import Prompt, Task
from specdecode.errors import SpecDecodeError
from specdecode.models.cost import relative_cost_curve, verification_costs
from specdecode.models.loading import fast_path_default, load_model
from specdecode.stats import GenerationStats
from specdecode.threads import fixed_threads

SCHEMA_VERSION = 4  # each version added a setting to the fingerprint (see _upgrade)
RESULTS_FILE = "results.json"
WARMUP_TOKENS = 8

# --------------------------------------------------------------------------------------------------------
# Measuring


def run_group(
    contestants: Sequence[Contestant],
    group: Sequence[list[int]],
    max_new_tokens: int,
    repeats: int,
    seed: int = 0,
    on_run: Callable[[str], None] = lambda name: None,
    lockstep: bool = True,
) -> dict[str, list[dict[str, Any]]]:
    """Every contestant decodes the prompts of ``group`` in order, ``repeats`` times, interleaved; → raw
    records per contestant, one per prompt.

    A contestant is reset at the start of each repeat and keeps its state through the group, so a repeat
    never profits from the previous repeat while a session profits from its own earlier requests.  The
    order is shuffled for every repeat (seeded by ``seed`` and the repeat), so no contestant always runs
    first or right after the same neighbour.  With ``lockstep`` the contestants that can take turns (ours)
    decode each prompt together, in turns (:mod:`specdecode.bench.lockstep`, ties drawn from the same seed);
    the others, and all of them without it, one request after another.  Acceptance counts are summed over
    repeats.
    """
    records: dict[str, list[dict[str, Any]]] = {}
    for repeat in range(repeats):
        draws = random.Random(f"{seed}/{repeat}")
        order = draws.sample(list(contestants), len(contestants))
        for contestant in order:
            contestant.reset()
        for index, prompt_ids in enumerate(group):
            streams = {c.name: c.stream(prompt_ids, max_new_tokens) for c in order if lockstep and c.stream}
            in_turns = run_lockstep(streams, draws) if streams else {}
            for contestant in order:
                measured = in_turns.get(contestant.name) or contestant.run(prompt_ids, max_new_tokens)
                if repeat == 0:
                    records.setdefault(contestant.name, []).append(
                        {"token_ids": measured.token_ids, "wall_s": [], "repeats_identical": True}
                    )
                record = records[contestant.name][index]
                record["wall_s"].append(round(measured.wall_s, 5))
                record["new_tokens"] = len(measured.token_ids)
                record["repeats_identical"] &= measured.token_ids == record["token_ids"]
                if measured.stats is not None:
                    add_acceptance(record, measured.stats)
                on_run(contestant.name)
    return records


def add_acceptance(record: dict[str, Any], stats: GenerationStats) -> None:
    """Add one generation's draft/accept counts and its split of time (drafting, target forwards, the whole
    generation: the rest is engine overhead; the prompt's reading) to a raw record, as sums so they pool exactly."""
    for key in ("steps", "drafted_tokens", "accepted_tokens"):
        record[key] = record.get(key, 0) + getattr(stats, key)
    timed = (("draft_s", stats.draft_s), ("forward_s", stats.forward_s), ("engine_wall_s", stats.wall_s))
    for key, seconds in (*timed, ("prefill_s", stats.prefill_s)):
        record[key] = round(record.get(key, 0.0) + seconds, 5)
    for key in ("drafted_at", "accepted_at"):
        totals = record.setdefault(key, [])
        counts = getattr(stats, key)
        totals.extend([0] * (len(counts) - len(totals)))
        for i, count in enumerate(counts):
            totals[i] += count


@dataclass
class _Item:
    task: Task
    prompts: list[Prompt]  # a group: run in order on one drafter
    pending: list[str]  # contestants still to measure on some prompt of the group


def contestant_names(settings: BenchSettings, task: str) -> list[str]:
    """Who runs on ``task``: every method and peer; the draft-length variants on sweep tasks only."""
    main = [m.spec for m in settings.methods]
    sweep = [spec for spec in sweep_methods(settings) if spec not in main] if task in settings.sweep_tasks else []
    return [*main, *sweep, *(spec.name for spec in peer_specs(settings))]


def groups(settings: BenchSettings, task: Task) -> list[list[Prompt]]:
    """The task's prompts in the groups that share one drafter (see :data:`DRAFTER_STATES`)."""
    return [list(task.prompts)] if settings.drafter_state == "task" else task.sessions()


def _plan(settings: BenchSettings, tasks: Sequence[Task], runs: dict[str, dict[str, dict]]) -> list[_Item]:
    """What is still to measure; a group missing any prompt for a contestant is measured again whole."""
    items = []
    for task in tasks:
        names = contestant_names(settings, task.name)
        for group in groups(settings, task):
            pending = [name for name in names if any(p.id not in runs.get(name, {}).get(task.name, {}) for p in group)]
            if pending:
                items.append(_Item(task, group, pending))
    return items


def _upgrade(previous: dict[str, Any]) -> dict[str, Any]:
    """Results of an older schema as the current one: each version added a setting to the fingerprint, which the
    older results had at the value they were measured with."""
    added = {
        1: ("drafter_state", "request"),  # version 1 reset every drafter per request
        2: ("default_k", 5),  # a method without ``k=`` drafted 5 tokens
        3: ("interleave", "request"),  # every contestant ran request by request
    }
    while (version := previous.get("schema_version")) in added:
        key, value = added[version]
        previous["fingerprint"] = {**previous.get("fingerprint", {}), key: value}
        previous["schema_version"] = version + 1
    return previous


def _load_previous(settings: BenchSettings) -> dict[str, Any] | None:
    path = settings.out / RESULTS_FILE

    def refusal(old: dict[str, Any]) -> SpecDecodeError:
        return SpecDecodeError(
            f"{path} holds results of another configuration ({old}; now "
            f"{settings.fingerprint}): choose another --out or delete it"
        )

    return resume(path, settings.fingerprint, SCHEMA_VERSION, refusal, admit=_upgrade)


def results_settings(settings: BenchSettings) -> dict[str, Any]:
    """The settings as results.json records them, with what the report needs of them: the baseline, the peers'
    configurations and the sweep's variants."""
    data = settings_json(settings)
    data["baseline"] = next((m.spec for m in settings.methods if m.drafter == "none"), None)
    data["peers"] = {
        spec.name: {"matches": spec.matches.spec, "family": spec.family, **spec.config} for spec in peer_specs(settings)
    }
    data["peer_families"] = list(settings.peers)
    data["sweep"] = {
        spec: {"base": base.spec, "k": variant.k} for spec, (variant, base) in sweep_methods(settings).items()
    }
    return data


def resolve_flags(suite: str, prompts: str | None, **given: Any) -> BenchSettings:
    """``bench``'s flags as settings: the prompts file ``prompts`` (``--prompts``) is read here, and the lines of it
    that were skipped are said on stderr."""
    prompt_file = read_prompt_file(prompts) if prompts is not None else None
    for problem in prompt_file.skipped if prompt_file else ():
        print(f"specdecode: {problem}", file=sys.stderr)
    return resolve_settings(suite, prompts_file=prompt_file, **given)


def run_benchmark(
    settings: BenchSettings, tasks: Sequence[Task] | None = None, progress: bool = True
) -> dict[str, Any]:
    """Measure everything not yet in ``settings.out``, write the raw JSON and the report there.

    ``tasks`` replaces the real prompt sets (tests inject tiny ones).  Returns the results JSON.
    """
    results = _load_previous(settings) or {
        "schema_version": SCHEMA_VERSION,
        "fingerprint": settings.fingerprint,
        "prompts": {},
        "runs": {},
        "measure_s": 0.0,
    }
    tasks = list(tasks) if tasks is not None else settings.load_tasks()
    results["settings"] = results_settings(settings)
    if plan := _plan(settings, tasks, results["runs"]):
        with fixed_threads(settings.threads):
            _measure(settings, tasks, plan, results, progress)
    cells = build_cells(results, tasks)
    results["cells"] = [cell.to_json() for cell in cells]
    save_json(settings.out / RESULTS_FILE, results)
    write_report(results, cells, settings.out)
    return results


def _measure(
    settings: BenchSettings, tasks: Sequence[Task], plan: list[_Item], results: dict[str, Any], progress: bool
) -> None:
    target = load_model(settings.model, quantize=settings.quantize)
    draft_names = sorted({m.draft_model for m in settings.methods} - {None})
    draft_quantize = settings.quantize_draft or settings.quantize
    drafts = {name: load_model(name, quantize=draft_quantize) for name in draft_names}
    peer_models = None
    if any(spec.family == "transformers" for spec in peer_specs(settings)):
        peer_models = (
            load_model(settings.model, fast_path=False),
            {name: load_model(name, fast_path=False) for name in draft_names},
        )
    contestants = build_contestants(settings, target, drafts, peer_models)
    encode = PromptEncoder(target, settings.model, settings.max_new_tokens)  # a base model gets the plain text
    results["environment"] = environment(settings.threads)
    results["environment"]["fast_path"] = fast_path_default()
    results["environment"]["quantize"] = target.quantize  # with --quantize auto, the format it chose here
    results["chat_template"] = encode.chat
    encoded = {(task.name, p.id): encode(p) for task in tasks for p in task.prompts}
    long_tasks = [(task, tokens) for task in tasks if (tokens := context_tokens_of(task.name)) is not None]
    costs = verification_costs(target.backend) if long_tasks else None
    for task, tokens in long_tasks:  # what verification costs at each long context, for the report (once per machine)
        curve = relative_cost_curve(target.backend, context_tokens=tokens)
        results.setdefault("cost_curves", {})[task.name] = [round(c, 4) for c in curve or ()]
        # And the curves the draft-length policy prices these requests by (one a power of two of context reached),
        # measured now: a request that first reached one not measured on this machine would time it, seconds of
        # forwards, inside its own decoding.
        for prompt in task.prompts if costs is not None else ():
            length = len(encoded[task.name, prompt.id])
            end = length + settings.max_new_tokens
            for reached in (length, *(1 << bits for bits in range(length.bit_length(), end.bit_length()))):
                costs.prepare(reached)
    for task in tasks:
        results["prompts"][task.name] = [
            {
                "id": p.id,
                "prompt_tokens": len(encoded[task.name, p.id]),
                "grounded": p.grounded,
                **({"session": p.session} if p.session else {}),
            }
            for p in task.prompts
        ]
    started = time.perf_counter()
    first = encoded[plan[0].task.name, plan[0].prompts[0].id]
    for contestant in contestants.values():  # warm-up: first-call allocations and kernel choice are not decoding
        contestant.run(first, WARMUP_TOKENS)
    total = sum(len(item.pending) * len(item.prompts) for item in plan) * settings.repeats
    with tqdm(total=total, unit="run", desc=f"bench {settings.suite}", disable=not progress, dynamic_ncols=True) as bar:
        for index, item in enumerate(plan):
            bar.set_postfix_str(item.prompts[0].session or item.prompts[0].id, refresh=False)
            records = run_group(
                [contestants[name] for name in item.pending],
                [encoded[item.task.name, p.id] for p in item.prompts],
                settings.max_new_tokens,
                settings.repeats,
                seed=index,
                on_run=lambda _: bar.update(),
                lockstep=settings.interleave == "step",
            )
            for name, per_prompt in records.items():
                by_prompt = results["runs"].setdefault(name, {}).setdefault(item.task.name, {})
                by_prompt.update({p.id: record for p, record in zip(item.prompts, per_prompt)})
            now = time.perf_counter()
            results["measure_s"] = round(results["measure_s"] + now - started, 2)
            started = now
            save_json(settings.out / RESULTS_FILE, results)
    results["environment"]["load_average_end"] = load_average()
