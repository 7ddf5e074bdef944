"""The benchmark's suites (``quick``, ``full``) and the settings of one run: a suite's defaults overridden by
the flags the user gave, checked once; and the draft-length variants a run sweeps.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdecode.bench.common import check_known_tasks, check_positive_ints, given_settings, split_names
from specdecode.bench.methods import DEFAULT_K, MethodSpec, draft_weights, parse_int_list, parse_methods
from specdecode.data.long_context import LONG_CONTEXT_TASK, expand
from specdecode.data.prompt_file import PromptFile, read_prompt_file
from specdecode.data.tasks import GROUNDED_TASKS, TASK_NAMES, Task, load_tasks
from specdecode.errors import SpecDecodeError
from specdecode.models.quantize import check_quantize
from specdecode.threads import default_threads

#: The peers ``bench`` can run beside us: transformers' ``generate()`` (in process, always installed) and the
#: native CPU engines of :mod:`specdecode.bench.native_peers` (optional extras); ``openvino`` means both
#: OpenVINO weight formats.
PEER_FAMILIES = ("transformers", "llamacpp", "openvino-int8", "openvino-int4")
_PEER_ALIASES = {"openvino": ("openvino-int8", "openvino-int4")}

#: How long our drafters keep what they learn: "request" — reset before every prompt (a session task's
#: session still runs on one drafter); "task" — reset once per task, kept across its prompts in order
#: (the setting of the Token Recycling paper).
DRAFTER_STATES = ("request", "task")
#: How our methods share the machine within a repeat: in turns step by step (lockstep), or request by request.
INTERLEAVES = ("step", "request")

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
    # Minutes on a 2-core CPU (docs/results/quick); --prompts-per-task 3 covers each task better at about 3x the
    # time.
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
    # Hours on the same CPU (docs/results/qwen2.5-coder-1.5b).
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
    peers: tuple[str, ...]  # peer families (PEER_FAMILIES), in order; () for none
    threads: int
    draft_lengths: tuple[int, ...]
    sweep_tasks: tuple[str, ...]
    out: Path
    drafter_state: str = "request"
    interleave: str = "step"
    quantize: str = "none"  # our target's weights (none, int8, int4, bf16); peers keep their own precision
    quantize_draft: str | None = None  # our draft models' weights (None: no draft model, or as ``quantize``)
    prompts_file: str | None = None  # the user's prompts (``--prompts``) instead of the built-in tasks
    prompts_sha256: str | None = None  # of that file, as read when the settings were resolved

    def __post_init__(self) -> None:
        check_positive_ints(
            ("prompts per task", self.prompts_per_task),
            ("max-new-tokens", self.max_new_tokens),
            ("repeats", self.repeats),
            ("threads", self.threads),
        )
        if unknown := [family for family in self.peers if family not in PEER_FAMILIES]:
            raise SpecDecodeError(
                f"unknown peer(s) {', '.join(unknown)}; choose from {', '.join((*PEER_FAMILIES, *_PEER_ALIASES))}"
            )
        check_quantize(self.quantize)
        if self.quantize_draft is not None:
            check_quantize(self.quantize_draft, "--quantize-draft")
        if self.prompts_file is None:  # a file's tasks were checked against the file
            check_known_tasks((*self.tasks, *self.sweep_tasks))
        if not self.tasks:
            raise SpecDecodeError("no benchmark tasks selected")
        if self.drafter_state not in DRAFTER_STATES:
            raise SpecDecodeError(
                f"drafter state must be one of {', '.join(DRAFTER_STATES)}, got {self.drafter_state!r}"
            )
        if self.interleave not in INTERLEAVES:
            raise SpecDecodeError(f"interleave must be one of {', '.join(INTERLEAVES)}, got {self.interleave!r}")
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
            "interleave": self.interleave,
            "default_k": DEFAULT_K,
            # Only when set: results written without these settings resume as they are.
            **({"quantize": self.quantize} if self.quantize != "none" else {}),
            **({"quantize_draft": self.quantize_draft} if self.quantize_draft is not None else {}),
            **({"prompts_sha256": self.prompts_sha256} if self.prompts_file is not None else {}),
        }

    def load_tasks(self) -> list[Task]:
        """The prompts to measure: the built-in tasks' seeded selection, or the prompts file's (which must
        not have changed since the settings were resolved: results are keyed by prompt id)."""
        if self.prompts_file is None:
            return load_tasks(self.tasks, self.prompts_per_task, self.seed)
        prompt_file = read_prompt_file(self.prompts_file)
        if prompt_file.sha256 != self.prompts_sha256:
            raise SpecDecodeError(f"{self.prompts_file} changed while the benchmark was being set up")
        return prompt_file.select(self.tasks, self.prompts_per_task)


def resolve_settings(suite: str = "quick", **overrides: Any) -> BenchSettings:
    """The suite's defaults, overridden by every given (non-None) value; strings are parsed as on the CLI.

    ``prompts_file`` (a path or a read :class:`PromptFile`) replaces the built-in tasks by the file's: all of
    them and every prompt, unless ``tasks`` or ``prompts_per_task`` choose fewer."""
    if suite not in SUITES:
        raise SpecDecodeError(f"unknown suite {suite!r}; choose from {', '.join(SUITES)}")
    base = SUITES[suite]
    prompt_file: PromptFile | str | Path | None = overrides.pop("prompts_file", None)
    if isinstance(prompt_file, str | Path):
        prompt_file = read_prompt_file(prompt_file)
    context_tokens = overrides.pop("long_context_tokens", None)
    given = given_settings(overrides, BenchSettings, "benchmark setting")
    tasks = given.get("tasks", base.tasks if prompt_file is None else None)
    if isinstance(tasks, str):
        tasks = split_names(tasks)
    if prompt_file is None:
        tasks = _long_context_tasks(tasks, context_tokens)
    elif context_tokens is not None:
        raise SpecDecodeError("--long-context-tokens sets the lengths of the built-in longctx task, not of --prompts")
    prompts_per_task = given.get("prompts_per_task", base.prompts_per_task)
    if prompt_file is not None:  # every prompt of the file unless the user cut it
        tasks = tuple(task.name for task in prompt_file.select(tasks, None))
        prompts_per_task = given.get("prompts_per_task", prompt_file.largest_task)
    methods = given.get("methods", base.methods)
    if isinstance(methods, str):
        methods = parse_methods(methods)
    lengths = given.get("draft_lengths", base.draft_lengths)
    if isinstance(lengths, str):
        lengths = () if lengths.strip() in {"", "0", "none"} else parse_int_list(lengths, "--draft-lengths")
    quantize = given.get("quantize", "none")
    quantize_draft = draft_weights(methods, quantize, given.get("quantize_draft"))
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
        prompts_per_task=prompts_per_task,
        max_new_tokens=given.get("max_new_tokens", base.max_new_tokens),
        repeats=given.get("repeats", base.repeats),
        seed=given.get("seed", 0),
        peers=_peer_families(given.get("peers", True)),
        threads=given.get("threads", default_threads()),
        draft_lengths=tuple(lengths),
        sweep_tasks=tuple(sweep_tasks) if lengths else (),
        out=Path(given.get("out", Path("bench-out") / suite)),
        drafter_state=given.get("drafter_state", "request"),
        interleave=given.get("interleave", "step"),
        quantize=quantize,
        quantize_draft=quantize_draft,
        prompts_file=str(prompt_file.path) if prompt_file is not None else None,
        prompts_sha256=prompt_file.sha256 if prompt_file is not None else None,
    )


def _long_context_tasks(tasks: tuple[str, ...], context_tokens: str | tuple[int, ...] | None) -> tuple[str, ...]:
    """``tasks`` with ``longctx`` as one ``longctx-N`` per length of ``context_tokens`` (``--long-context-tokens``,
    default :data:`~specdecode.data.long_context.DEFAULT_CONTEXT_TOKENS`), which only ``longctx`` takes."""
    if context_tokens is None:
        return expand(tasks)
    if LONG_CONTEXT_TASK not in tasks:
        raise SpecDecodeError(
            f"--long-context-tokens sets the lengths of the {LONG_CONTEXT_TASK} task: name it in --tasks"
        )
    if isinstance(context_tokens, str):
        context_tokens = parse_int_list(context_tokens, "--long-context-tokens")
    return expand(tasks, context_tokens)


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


def _peer_families(peers: bool | str | tuple[str, ...]) -> tuple[str, ...]:
    """``--peers`` as families: True (the default) is transformers alone, False none; a comma-separated
    string or a tuple names them (``openvino`` stands for both weight formats); unknown ones are left for
    ``BenchSettings`` to refuse."""
    if isinstance(peers, bool):
        return ("transformers",) if peers else ()
    names = split_names(peers) if isinstance(peers, str) else tuple(peers)
    if names in {("none",), ()}:
        return ()
    return tuple(dict.fromkeys(family for name in names for family in _PEER_ALIASES.get(name, (name,))))
