"""Run the benchmark: our drafting methods and transformers' ``generate()`` on the same prompts, in one run.

The unit of work is a *group* of prompts that run in order on one drafter: one prompt (the default), one
session of a session task (``multi-edit``), or with ``drafter_state="task"`` all of a task's prompts.
Every contestant (each of our methods, each transformers peer) decodes the group ``repeats`` times,
interleaved and in a rotating order, so a burst of load from other processes slows all of them alike
instead of one cell.  Our drafter is reset at the start of every repeat of a group and keeps what it
learns within the group — so drafters that learn across requests are measured cold on single prompts
and warm within a session.  Raw measurements are saved per prompt after every group; a rerun skips what
is already measured (resume), and the aggregation into cells (``report.py``) only ever reads the raw data.

Timing is end to end around one call that takes token ids and returns token ids (ours: ``generate()``,
which also detokenises as it streams; theirs: ``model.generate()``).  Every call is greedy with
``ignore_eos``, so every contestant produces exactly ``max_new_tokens`` tokens and times are comparable.
"""

from __future__ import annotations

import functools
import inspect
import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from specdecode.bench import peers
from specdecode.bench.common import (
    PromptEncoder,
    check_known_tasks,
    check_positive_ints,
    drafter_options,
    given_settings,
    load_average,
    package_versions,
    read_previous,
    save_json,
    split_names,
)
from specdecode.bench.tasks import GROUNDED_TASKS, TASK_NAMES, Prompt, Task, load_tasks
from specdecode.config import GenerationConfig
from specdecode.drafters import drafter_class
from specdecode.errors import SpecDecodeError
from specdecode.generator import SpeculativeGenerator
from specdecode.models.loading import LoadedModel, fast_path_default, load_model
from specdecode.stats import GenerationStats
from specdecode.threads import fixed_threads

# 2: ``drafter_state`` joined the fingerprint (a version-1 file is read as drafter_state "request").
# 3: ``default_k`` joined it: a method without ``k=`` (``pld``) drafted K=5 before "auto" became the default.
SCHEMA_VERSION = 3
RESULTS_FILE = "results.json"
DEFAULT_K = GenerationConfig().num_draft_tokens
#: transformers has no cost-model schedule: a peer matching one of our adaptive methods drafts this many.
PEER_K = 5
WARMUP_TOKENS = 8
#: How long our drafters keep what they learn: "request" — reset before every prompt (a session task's
#: session still runs on one drafter); "task" — reset once per task, kept across its prompts in order
#: (the setting of the Token Recycling paper).
DRAFTER_STATES = ("request", "task")

# --------------------------------------------------------------------------------------------------------
# Methods: ``NAME`` or ``NAME:OPTION=VALUE[:OPTION=VALUE...]``


@dataclass(frozen=True)
class MethodSpec:
    """One drafter configuration.  ``spec`` is the name results are keyed by; it does not take part in
    equality, so two spellings of the same configuration compare equal."""

    drafter: str
    k: int | str = DEFAULT_K  # an integer, or an adaptive policy (ADAPTIVE_K)
    options: tuple[tuple[str, Any], ...] = ()
    spec: str = field(default="", compare=False)

    @property
    def draft_model(self) -> str | None:
        return dict(self.options).get("draft_model")

    def option(self, name: str) -> Any:
        """The option's value, or the drafter's default for it."""
        given = dict(self.options)
        if name in given:
            return given[name]
        return inspect.signature(drafter_class(self.drafter).__init__).parameters[name].default

    def with_k(self, k: int) -> MethodSpec:
        """The same configuration drafting ``k`` tokens, spelled canonically."""
        parts = [self.drafter]
        if self.draft_model is not None:
            parts.append(self.draft_model)
        parts.append(f"k={k}")
        parts += [f"{key}={value}" for key, value in self.options if key != "draft_model"]
        return replace(self, k=k, spec=":".join(parts))


def _convert(raw: str) -> Any:
    for convert in (int, float):
        try:
            return convert(raw)
        except ValueError:
            continue
    return raw


ADAPTIVE_K = ("auto", "heuristic")


def parse_method(text: str) -> MethodSpec:
    """``pld:k=6:max_ngram=4``, ``draft-model:qwen2.5-coder-0.5b:k=4`` → :class:`MethodSpec`."""
    spec = text.strip()
    name, *parts = spec.split(":")
    if not name:
        raise SpecDecodeError(f"method {text!r} has no drafter name (syntax NAME[:OPTION=VALUE...])")
    drafter_class(name)  # an unknown drafter fails here, before any model is loaded
    k: int | str = DEFAULT_K
    k_given = False
    options: dict[str, Any] = {}
    for part in parts:
        key, sep, raw = part.partition("=")
        if not sep and name == "draft-model" and "draft_model" not in options and part:
            options["draft_model"] = part
            continue
        if not sep or not key or not raw:
            raise SpecDecodeError(f"method {spec!r}: expected OPTION=VALUE after ':', got {part!r}")
        key = key.replace("-", "_")
        if key in options or (key == "k" and k_given):
            raise SpecDecodeError(f"method {spec!r} sets {key!r} twice")
        if key == "k":
            k_given = True
            k = raw if raw in ADAPTIVE_K else _convert(raw)
            if not (k in ADAPTIVE_K or (isinstance(k, int) and k >= 1)):
                raise SpecDecodeError(
                    f"method {spec!r}: k (draft length) must be a positive integer, auto or heuristic, got {raw!r}"
                )
        else:
            options[key] = _convert(raw)
    if name == "draft-model" and "draft_model" not in options:
        raise SpecDecodeError(f"method {spec!r} needs a draft model, e.g. draft-model:qwen2.5-coder-0.5b")
    return MethodSpec(drafter=name, k=k, options=tuple(sorted(options.items())), spec=spec)


def parse_methods(text: str) -> list[MethodSpec]:
    methods = [parse_method(part) for part in text.split(",") if part.strip()]
    if not methods:
        raise SpecDecodeError("--methods is empty; give e.g. none,pld")
    seen: set[str] = set()
    for method in methods:
        if method.spec in seen:
            raise SpecDecodeError(f"method {method.spec!r} is listed twice")
        seen.add(method.spec)
    return methods


def parse_int_list(text: str, label: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise SpecDecodeError(f"{label} takes comma-separated positive integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise SpecDecodeError(f"{label} takes comma-separated positive integers, got {text!r}")
    return values


# --------------------------------------------------------------------------------------------------------
# Suites and settings


@dataclass(frozen=True)
class Suite:
    """Defaults a suite gives every flag the user did not set."""

    model: str
    methods: str
    tasks: tuple[str, ...]
    prompts_per_task: int
    max_new_tokens: int
    repeats: int
    draft_lengths: tuple[int, ...]
    sweep_tasks: tuple[str, ...]


SUITES: dict[str, Suite] = {
    # Sized for under 10 minutes on an idle 2-core CPU: smollm2 decodes ~12 tokens/s plainly, so each of the
    # ~85 timed runs (multi-edit's session adds 3 requests x 4 contestants x 2 repeats) takes 4-9 s.
    # --prompts-per-task 3 covers each task better at about 3x the time.
    "quick": Suite(
        model="smollm2-135m",
        methods="none,pld",
        tasks=TASK_NAMES,
        prompts_per_task=1,
        max_new_tokens=96,
        repeats=2,
        draft_lengths=(1, 2, 4, 8),
        sweep_tasks=("edit",),
    ),
    # The 1.5B target decodes ~2 tokens/s plainly on the same CPU: expect 1.5-2 hours.
    "full": Suite(
        model="qwen2.5-coder-1.5b",
        methods="none,pld,draft-model:qwen2.5-coder-0.5b",
        tasks=TASK_NAMES,
        prompts_per_task=2,
        max_new_tokens=64,
        repeats=2,
        draft_lengths=(1, 2, 4, 8),
        sweep_tasks=("humaneval",),
    ),
}


@dataclass(frozen=True)
class BenchSettings:
    suite: str
    model: str
    methods: tuple[MethodSpec, ...]
    tasks: tuple[str, ...]
    prompts_per_task: int
    max_new_tokens: int
    repeats: int
    seed: int
    peers: bool
    threads: int
    draft_lengths: tuple[int, ...]
    sweep_tasks: tuple[str, ...]
    out: Path
    drafter_state: str = "request"

    def __post_init__(self) -> None:
        check_positive_ints(
            ("prompts per task", self.prompts_per_task),
            ("max-new-tokens", self.max_new_tokens),
            ("repeats", self.repeats),
            ("threads", self.threads),
        )
        check_known_tasks((*self.tasks, *self.sweep_tasks))
        if not self.tasks:
            raise SpecDecodeError("no benchmark tasks selected")
        if self.drafter_state not in DRAFTER_STATES:
            raise SpecDecodeError(
                f"drafter state must be one of {', '.join(DRAFTER_STATES)}, got {self.drafter_state!r}"
            )
        if missing := sorted(set(self.sweep_tasks) - set(self.tasks)):
            raise SpecDecodeError(f"sweep task(s) {', '.join(missing)} are not among the selected tasks")

    @property
    def fingerprint(self) -> dict[str, Any]:
        """What must not change between a run and its resumption (methods, tasks and prompts may grow)."""
        return {
            "model": self.model,
            "max_new_tokens": self.max_new_tokens,
            "repeats": self.repeats,
            "threads": self.threads,
            "drafter_state": self.drafter_state,
            "default_k": DEFAULT_K,
        }


def resolve_settings(suite: str = "quick", **overrides: Any) -> BenchSettings:
    """The suite's defaults, overridden by every given (non-None) value; strings are parsed as on the CLI."""
    if suite not in SUITES:
        raise SpecDecodeError(f"unknown suite {suite!r}; choose from {', '.join(SUITES)}")
    base = SUITES[suite]
    given = given_settings(overrides, BenchSettings, "benchmark setting")
    tasks = given.get("tasks", base.tasks)
    if isinstance(tasks, str):
        tasks = split_names(tasks)
    methods = given.get("methods", base.methods)
    if isinstance(methods, str):
        methods = parse_methods(methods)
    lengths = given.get("draft_lengths", base.draft_lengths)
    if isinstance(lengths, str):
        lengths = () if lengths.strip() in {"", "0", "none"} else parse_int_list(lengths, "--draft-lengths")
    sweep_tasks = given.get("sweep_tasks")
    if isinstance(sweep_tasks, str):
        sweep_tasks = split_names(sweep_tasks)
    if sweep_tasks is None:  # the suite's sweep tasks still selected, else the first grounded one, else any
        sweep_tasks = tuple(t for t in base.sweep_tasks if t in tasks) or next(
            ((t,) for t in tasks if t in GROUNDED_TASKS), tuple(tasks[:1])
        )
    return BenchSettings(
        suite=suite,
        model=given.get("model", base.model),
        methods=tuple(methods),
        tasks=tuple(tasks),
        prompts_per_task=given.get("prompts_per_task", base.prompts_per_task),
        max_new_tokens=given.get("max_new_tokens", base.max_new_tokens),
        repeats=given.get("repeats", base.repeats),
        seed=given.get("seed", 0),
        peers=given.get("peers", True),
        threads=given.get("threads", os.cpu_count() or 1),
        draft_lengths=tuple(lengths),
        sweep_tasks=tuple(sweep_tasks) if lengths else (),
        out=Path(given.get("out", Path("bench-out") / suite)),
        drafter_state=given.get("drafter_state", "request"),
    )


def sweep_methods(settings: BenchSettings) -> dict[str, tuple[MethodSpec, MethodSpec]]:
    """Draft-length variants of every drafting method: spec → (variant, the method it varies).

    The method's own k is a point of its curve; a variant equal to a listed method reuses that method's
    measurements (same key).
    """
    listed = {method: method for method in settings.methods}
    variants: dict[str, tuple[MethodSpec, MethodSpec]] = {}
    for method in settings.methods:
        if method.drafter == "none":
            continue
        own_k = {method.k} if isinstance(method.k, int) else set()  # an adaptive method is not a point on the curve
        for k in sorted({*settings.draft_lengths, *own_k}) if settings.draft_lengths else ():
            variant = method.with_k(k)
            variant = listed.get(variant, variant)
            variants[variant.spec] = (variant, method)
    return variants


# --------------------------------------------------------------------------------------------------------
# Contestants: anything that turns prompt ids into ``max_new_tokens`` generated ids


@dataclass(frozen=True)
class PeerSpec:
    """A transformers configuration and the method of ours it is configured like."""

    name: str
    matches: MethodSpec
    config: dict[str, Any]


def peer_specs(settings: BenchSettings) -> list[PeerSpec]:
    """``hf-plain`` for ``none``, ``hf-pld`` for the first ``pld`` method, ``hf-assisted`` for the first
    ``draft-model`` method — each only when that method is benchmarked."""
    if not settings.peers:
        return []
    # Peers take a fixed draft length: match the first method of each kind that has one, else the first
    # method of that kind, drafting PEER_K.
    first = {
        name: next(
            (m for m in settings.methods if m.drafter == name and isinstance(m.k, int)),
            next((m for m in settings.methods if m.drafter == name), None),
        )
        for name in ("none", "pld", "draft-model")
    }
    specs = []
    if first["none"] is not None:
        specs.append(PeerSpec("hf-plain", first["none"], {}))
    if (pld := first["pld"]) is not None:
        config = {"prompt_lookup_num_tokens": _peer_k(pld), "max_matching_ngram_size": pld.option("max_ngram")}
        specs.append(PeerSpec("hf-pld", pld, config))
    if (assisted := first["draft-model"]) is not None:
        # A constant schedule with no confidence cut-off drafts exactly k tokens per step, as ours does.
        config = {
            "assistant_model": assisted.draft_model,
            "num_assistant_tokens": _peer_k(assisted),
            "num_assistant_tokens_schedule": "constant",
            "assistant_confidence_threshold": 0.0,
        }
        specs.append(PeerSpec("hf-assisted", assisted, config))
    return specs


def _peer_k(method: MethodSpec) -> int:
    return method.k if isinstance(method.k, int) else PEER_K


@dataclass
class Measurement:
    token_ids: list[int]
    wall_s: float
    stats: GenerationStats | None  # None for peers (transformers reports no acceptance counts)


@dataclass
class Contestant:
    name: str
    run: Callable[[list[int], int], Measurement]  # (prompt ids, max new tokens) → measurement
    reset: Callable[[], None] = lambda: None  # forget what was learned from earlier runs (ours: the drafter)


def _ours(target: LoadedModel, method: MethodSpec, drafts: dict[str, LoadedModel]) -> Contestant:
    generator = SpeculativeGenerator.build(target, method.drafter, **drafter_options(method, drafts))

    def run(prompt_ids: list[int], max_new_tokens: int) -> Measurement:
        start = time.perf_counter()
        result = generator.generate(
            prompt_ids, max_new_tokens=max_new_tokens, num_draft_tokens=method.k, ignore_eos=True
        )
        return Measurement(result.token_ids, time.perf_counter() - start, result.stats)

    # Resetting is not timed: it stands for a fresh server, not for work a request pays for.
    return Contestant(method.spec, run, generator.reset_drafter)


def _peer(target: LoadedModel, spec: PeerSpec, drafts: dict[str, LoadedModel]) -> Contestant:
    model = target.backend.model
    if spec.name == "hf-plain":
        call = functools.partial(peers.hf_plain, model)
    elif spec.name == "hf-pld":
        call = functools.partial(peers.hf_prompt_lookup, model, **spec.config)
    else:
        options = {key: value for key, value in spec.config.items() if key != "assistant_model"}
        assistant = drafts[spec.config["assistant_model"]].backend.model
        call = functools.partial(peers.hf_assisted, model, assistant, **options)

    def run(prompt_ids: list[int], max_new_tokens: int) -> Measurement:
        result = call(prompt_ids=prompt_ids, max_new_tokens=max_new_tokens, ignore_eos=True)
        return Measurement(result.token_ids, result.wall_s, None)

    return Contestant(spec.name, run)


def build_contestants(
    settings: BenchSettings,
    target: LoadedModel,
    drafts: dict[str, LoadedModel],
    peer_models: tuple[LoadedModel, dict[str, LoadedModel]] | None = None,
) -> dict[str, Contestant]:
    """Our methods and draft-length variants, then the transformers peers.

    ``peer_models`` (target, drafts) are what the peers run on — loaded without our CPU fast path, so
    that they measure transformers as a user would run it; default: the same models as ours."""
    peer_target, peer_drafts = peer_models or (target, drafts)
    contestants: dict[str, Contestant] = {}
    for method in [*settings.methods, *(variant for variant, _ in sweep_methods(settings).values())]:
        if method.spec not in contestants:  # a variant may be a listed method under the same key
            contestants[method.spec] = _ours(target, method, drafts)
    contestants.update({spec.name: _peer(peer_target, spec, peer_drafts) for spec in peer_specs(settings)})
    return contestants


# --------------------------------------------------------------------------------------------------------
# Measuring


def run_group(
    contestants: Sequence[Contestant],
    group: Sequence[list[int]],
    max_new_tokens: int,
    repeats: int,
    rotation: int = 0,
    on_run: Callable[[str], None] = lambda name: None,
) -> dict[str, list[dict[str, Any]]]:
    """Every contestant decodes the prompts of ``group`` in order, ``repeats`` times, interleaved; → raw
    records per contestant, one per prompt.

    A contestant is reset at the start of each repeat and keeps its state through the group, so a repeat
    never profits from the previous repeat while a session profits from its own earlier requests.  The
    order rotates with every repeat (starting at ``rotation``), so no contestant always runs first or right
    after the same neighbour.  Acceptance counts are summed over repeats.
    """
    records: dict[str, list[dict[str, Any]]] = {}
    for repeat in range(repeats):
        shift = (rotation + repeat) % len(contestants)
        for contestant in [*contestants[shift:], *contestants[:shift]]:
            contestant.reset()
            for index, prompt_ids in enumerate(group):
                measured = contestant.run(prompt_ids, max_new_tokens)
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
    generation: the rest is engine overhead) to a raw record, as sums so they pool exactly."""
    for key in ("steps", "drafted_tokens", "accepted_tokens"):
        record[key] = record.get(key, 0) + getattr(stats, key)
    for key, seconds in (("draft_s", stats.draft_s), ("forward_s", stats.forward_s), ("engine_wall_s", stats.wall_s)):
        record[key] = round(record.get(key, 0.0) + seconds, 5)
    for key in ("drafted_at", "accepted_at"):
        totals = record.setdefault(key, [])
        counts = getattr(stats, key)
        totals.extend([0] * (len(counts) - len(totals)))
        for i, count in enumerate(counts):
            totals[i] += count


def environment(threads: int) -> dict[str, Any]:
    """What the numbers depend on besides the code: CPU, threads, library versions, load from others."""
    cpu = platform.processor() or platform.machine()
    try:
        names = [line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")]
        cpu = names[0].split(":", 1)[1].strip() if names else cpu
    except OSError:
        pass
    versions = package_versions(("torch", "transformers", "specdecode"))
    return {
        "cpu": cpu,
        # The widest vector instructions torch uses here (AVX2, AVX512...): what the CPU fast path gains
        # depends on it more than on the CPU's name.
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cores": os.cpu_count(),
        "threads": threads,
        "python": platform.python_version(),
        "platform": platform.platform(),
        **versions,
        "load_average_start": load_average(),
    }


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


def _load_previous(settings: BenchSettings) -> dict[str, Any] | None:
    path = settings.out / RESULTS_FILE
    previous = read_previous(path)
    if previous is None:
        return None
    if previous.get("schema_version") == 1:  # before drafter_state existed every run reset per request
        previous["fingerprint"] = {**previous.get("fingerprint", {}), "drafter_state": "request"}
        previous["schema_version"] = 2
    if previous.get("schema_version") == 2:  # before default_k existed the default was K=5
        previous["fingerprint"] = {**previous.get("fingerprint", {}), "default_k": 5}
        previous["schema_version"] = SCHEMA_VERSION
    if previous.get("schema_version") != SCHEMA_VERSION or previous.get("fingerprint") != settings.fingerprint:
        raise SpecDecodeError(
            f"{path} holds results of another configuration ({previous.get('fingerprint')}; now "
            f"{settings.fingerprint}): choose another --out or delete it"
        )
    return previous


def settings_json(settings: BenchSettings) -> dict[str, Any]:
    data = asdict(settings)
    data["methods"] = [m.spec for m in settings.methods]
    data["out"] = str(settings.out)
    data["baseline"] = next((m.spec for m in settings.methods if m.drafter == "none"), None)
    data["peers"] = {spec.name: {"matches": spec.matches.spec, **spec.config} for spec in peer_specs(settings)}
    data["sweep"] = {
        spec: {"base": base.spec, "k": variant.k} for spec, (variant, base) in sweep_methods(settings).items()
    }
    return data


def run_benchmark(
    settings: BenchSettings, tasks: Sequence[Task] | None = None, progress: bool = True
) -> dict[str, Any]:
    """Measure everything not yet in ``settings.out``, write the raw JSON and the report there.

    ``tasks`` replaces the real prompt sets (tests inject tiny ones).  Returns the results JSON.
    """
    from specdecode.bench import report

    results = _load_previous(settings) or {
        "schema_version": SCHEMA_VERSION,
        "fingerprint": settings.fingerprint,
        "prompts": {},
        "runs": {},
        "measure_s": 0.0,
    }
    tasks = list(tasks) if tasks is not None else load_tasks(settings.tasks, settings.prompts_per_task, settings.seed)
    results["settings"] = settings_json(settings)
    if plan := _plan(settings, tasks, results["runs"]):
        with fixed_threads(settings.threads):
            _measure(settings, tasks, plan, results, progress)
    cells = report.build_cells(results, tasks)
    results["cells"] = [cell.to_json() for cell in cells]
    save_json(settings.out / RESULTS_FILE, results)
    report.write_report(results, cells, settings.out)
    return results


def _measure(
    settings: BenchSettings, tasks: Sequence[Task], plan: list[_Item], results: dict[str, Any], progress: bool
) -> None:
    from tqdm import tqdm

    target = load_model(settings.model)
    draft_names = sorted({m.draft_model for m in settings.methods} - {None})
    drafts = {name: load_model(name) for name in draft_names}
    peer_models = None
    if peer_specs(settings):
        peer_models = (
            load_model(settings.model, fast_path=False),
            {name: load_model(name, fast_path=False) for name in draft_names},
        )
    contestants = build_contestants(settings, target, drafts, peer_models)
    encode = PromptEncoder(target, settings.model, settings.max_new_tokens)  # a base model gets the plain text
    results["environment"] = environment(settings.threads)
    results["environment"]["fast_path"] = fast_path_default()
    results["chat_template"] = encode.chat
    encoded = {(task.name, p.id): encode(p) for task in tasks for p in task.prompts}
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
                rotation=index,
                on_run=lambda _: bar.update(),
            )
            for name, per_prompt in records.items():
                by_prompt = results["runs"].setdefault(name, {}).setdefault(item.task.name, {})
                by_prompt.update({p.id: record for p, record in zip(item.prompts, per_prompt)})
            now = time.perf_counter()
            results["measure_s"] = round(results["measure_s"] + now - started, 2)
            started = now
            save_json(settings.out / RESULTS_FILE, results)
    results["environment"]["load_average_end"] = load_average()
