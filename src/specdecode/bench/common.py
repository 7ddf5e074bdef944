"""What the benchmarks share while they measure: their settings' checks, the encoding of their prompts, the cells
of the cell benchmarks (``bench throughput``, ``bench serve``, ``bench contention``) and the environment they
record.  One copy of each rule keeps the commands' error messages, files and checks in step (their results
files: :mod:`specdecode.bench.resume`; their reports: :mod:`specdecode.bench.reporting`).
"""

from __future__ import annotations

import dataclasses
import os
import platform
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from specdecode.bench.methods import parse_int_list, parse_methods
from specdecode.bench.resume import save_json
from specdecode.data.long_context import fit_prompt
from specdecode.data.tasks import Prompt, Task, known_task, task_choices
from specdecode.errors import SpecDecodeError
from specdecode.generator import SpeculativeGenerator
from specdecode.machine import cpu_name
from specdecode.threads import default_threads, fixed_threads

# --------------------------------------------------------------------------------------------------------
# Settings: the same flag gets the same check and the same one-line error in every command


def is_positive_int(value: Any) -> bool:
    """An ``int`` of at least 1 (``True`` is not a count, though Python calls it an int)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def is_number(value: Any) -> bool:
    """An ``int`` or a ``float`` (not ``True``)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_positive_ints(*labelled: tuple[str, Any]) -> None:
    """Every ``(flag label, value)`` must be a positive integer; the first that is not is the error."""
    for label, value in labelled:
        if not is_positive_int(value):
            raise SpecDecodeError(f"{label} must be a positive integer, got {value!r}")


def check_positive_int_list(label: str, values: Sequence[Any]) -> None:
    """``--batch-sizes``-like settings: at least one value, each a positive integer."""
    if not values or not all(is_positive_int(v) for v in values):
        raise SpecDecodeError(f"{label} takes comma-separated positive integers, got {values!r}")


def check_known_tasks(names: Iterable[str]) -> None:
    for task in names:
        if not known_task(task):
            raise SpecDecodeError(f"unknown benchmark task {task!r}; choose from {task_choices()}")


def check_tasks(tasks: Sequence[str]) -> None:
    """At least one task, and only known ones."""
    if not tasks:
        raise SpecDecodeError("no benchmark tasks selected")
    check_known_tasks(tasks)


def split_names(text: str) -> tuple[str, ...]:
    """``"edit, rag,"`` → ``("edit", "rag")``: a comma-separated flag, blanks dropped."""
    return tuple(t.strip() for t in text.split(",") if t.strip())


def given_settings(overrides: Mapping[str, Any], settings_class: type, what: str) -> dict[str, Any]:
    """The overrides actually given (None means "not given": an unset CLI flag); a name that is no field of
    ``settings_class`` is an error ("unknown ``what``(s)")."""
    given = {key: value for key, value in overrides.items() if value is not None}
    if unknown := sorted(set(given) - set(settings_class.__dataclass_fields__)):
        raise SpecDecodeError(f"unknown {what}(s): {', '.join(unknown)}")
    return given


def resolve_values(
    settings_class: type,
    defaults: Mapping[str, Any],
    overrides: Mapping[str, Any],
    what: str,
    parsers: Mapping[str, Callable[[str], Any]],
) -> dict[str, Any]:
    """``defaults`` (threads, where the settings have them: :func:`default_threads`) overridden by the given
    ``overrides``; a string value of a key in ``parsers`` is parsed as on the command line, in the order of
    ``parsers`` (so the first bad flag is the one reported).  Lists come back as tuples, ``out`` as a path."""
    cores = {"threads": default_threads()} if "threads" in settings_class.__dataclass_fields__ else {}
    values = {**defaults, **cores, **given_settings(overrides, settings_class, what)}
    for key, parse in parsers.items():
        if isinstance(values[key], str):
            values[key] = parse(values[key])
    values = {key: tuple(value) if isinstance(value, list) else value for key, value in values.items()}
    return {**values, "out": Path(values["out"])}


@dataclass(frozen=True)
class PromptSettings:
    """What every benchmark of the built-in prompt sets is given: the target, the prompts (``tasks``, a seeded
    selection of ``prompts_per_task`` each), the new tokens per request and where the results go; checked when
    built, a bad value in one line naming its flag."""

    model: str
    tasks: tuple[str, ...]
    prompts_per_task: int
    max_new_tokens: int
    seed: int
    out: Path

    def __post_init__(self) -> None:
        check_positive_ints(("--prompts-per-task", self.prompts_per_task), ("--max-new-tokens", self.max_new_tokens))
        check_tasks(self.tasks)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise SpecDecodeError(f"--seed must be an integer, got {self.seed!r}")

    def to_json(self) -> dict[str, Any]:
        return settings_json(self)


def cell_parsers(column: str, flag: str) -> dict[str, Callable[[str], Any]]:
    """How a cell benchmark parses its flags' strings: the methods, the values of its ``column`` (``flag``,
    such as ``--batch-sizes``) and the tasks, in that order."""
    return {"methods": parse_methods, column: lambda text: parse_int_list(text, flag), "tasks": split_names}


def settings_json(settings: Any) -> dict[str, Any]:
    """A settings dataclass as its results record it: field by field, a method or verifier by its spec, a
    tuple as a list, a path as a string."""

    def plain(value: Any) -> Any:
        if isinstance(value, tuple | list):
            return [plain(item) for item in value]
        if isinstance(value, Path):
            return str(value)
        return getattr(value, "spec", value)

    return {field.name: plain(getattr(settings, field.name)) for field in dataclasses.fields(settings)}


def drafter_options(method: Any, drafts: Mapping[str, Any]) -> dict[str, Any]:
    """A :class:`~specdecode.bench.methods.MethodSpec`'s drafter options, its draft model's name replaced by
    that model as loaded (``drafts``: name → loaded model)."""
    options = dict(method.options)
    if method.draft_model is not None:
        options["draft_model"] = drafts[method.draft_model]
    return options


# --------------------------------------------------------------------------------------------------------
# Prompts: encoded once, and checked against the context before anything is measured


@dataclass(frozen=True)
class EncodedPrompt:
    key: str  # ``task/id``
    text: str
    ids: list[int]


class PromptEncoder:
    """Prompt text → token ids as every contestant gets them: through the chat template when the target has
    one (a base model gets the plain text), refused when the prompt and ``max_new_tokens`` overflow the
    target's context (before any time is spent measuring).  A long-context prompt is first cut to its length
    in this target's tokens, or to the target's context less ``max_new_tokens`` where that is shorter (said once
    per length on stderr)."""

    def __init__(self, target: Any, model: str, max_new_tokens: int) -> None:
        self.chat = bool(getattr(target.tokenizer, "chat_template", None))
        self._encoder = SpeculativeGenerator.build(target, "none")
        self._max_context = target.backend.max_context
        self._model = model
        self._max_new_tokens = max_new_tokens
        self._cut_to_window: set[int] = set()

    def __call__(self, prompt: Prompt) -> list[int]:
        return self.encode(prompt, prompt.id).ids

    def encode(self, prompt: Prompt, key: str) -> EncodedPrompt:
        if prompt.context_tokens:
            prompt = self._fitted(prompt)
        ids = self._encoder.encode_prompt(prompt.text, chat=self.chat)
        if len(ids) + self._max_new_tokens > self._max_context:
            raise SpecDecodeError(
                f"prompt {prompt.id} is {len(ids)} tokens: with {self._max_new_tokens} new tokens it exceeds "
                f"the {self._max_context}-token context of {self._model!r}"
            )
        return EncodedPrompt(key, prompt.text, ids)

    def _fitted(self, prompt: Prompt) -> Prompt:
        window = self._max_context - self._max_new_tokens
        if prompt.context_tokens > window and prompt.context_tokens not in self._cut_to_window:
            self._cut_to_window.add(prompt.context_tokens)
            print(
                f"specdecode: prompts of {prompt.context_tokens} tokens are cut to {window}: {self._model!r} has a "
                f"context of {self._max_context} tokens, {self._max_new_tokens} of them for new tokens",
                file=sys.stderr,
            )
        return fit_prompt(prompt, self._count, min(prompt.context_tokens, window))

    def _count(self, text: str) -> int:
        """The prompt's tokens; the context's size for one the target refuses as longer than its context."""
        try:
            return len(self._encoder.encode_prompt(text, chat=self.chat))
        except SpecDecodeError:
            return self._max_context

    def encode_tasks(self, tasks: Sequence[Task]) -> list[EncodedPrompt]:
        """Every prompt of every task, in order."""
        return [self.encode(p, f"{task.name}/{p.id}") for task in tasks for p in task.prompts]


# --------------------------------------------------------------------------------------------------------
# The cell benchmarks' results (one cell per method and batch size or concurrency)


def new_results(schema_version: int, fingerprint: dict[str, Any], **head: Any) -> dict[str, Any]:
    """The results of a cell benchmark before its first cell (``head``: fields that come first)."""
    return {**head, "schema_version": schema_version, "fingerprint": fingerprint, "cells": [], "measure_s": 0.0}


def run_cells(
    results: dict[str, Any],
    settings: Any,
    order: Sequence[tuple[str, int]],
    column: str,
    measure: Callable[[list[tuple[str, int]]], None],
    write_report: Callable[[dict[str, Any], Path], Any],
    path: Path,
) -> dict[str, Any]:
    """A cell benchmark's run after its resumable ``results`` are known: record ``settings``, ``measure``
    (with ``settings.threads`` torch threads) the cells of ``order`` — (method, value of ``column``) — that
    ``results`` does not hold yet, sort every cell into ``order`` (unknown ones last), save the results to
    ``path`` and write the report next to them.  Returns the results."""
    results["settings"] = settings.to_json()
    done = {(c["method"], c[column]) for c in results["cells"]}
    if pending := [cell for cell in order if cell not in done]:
        with fixed_threads(settings.threads):
            measure(pending)
    index = {cell: i for i, cell in enumerate(order)}
    results["cells"].sort(key=lambda c: index.get((c["method"], c[column]), len(index)))
    save_json(path, results)
    write_report(results, settings.out)
    return results


def add_cell(results: dict[str, Any], cell: dict[str, Any], path: Path, started: float) -> float:
    """Keep one measured cell: add it and the time since ``started`` to ``results``, save them to ``path``
    (an interruption loses at most the cell being measured); the time now, where the next cell starts."""
    results["cells"].append(cell)
    now = time.perf_counter()
    results["measure_s"] = round(results["measure_s"] + now - started, 2)
    save_json(path, results)
    return now


def package_versions(packages: Iterable[str]) -> dict[str, str | None]:
    """The installed version of each package (None: not installed), for the results' environment."""
    versions: dict[str, str | None] = {}
    for package in packages:
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    return versions


def load_average() -> list[float]:
    """The 1/5/15-minute load average: how busy other processes kept the machine."""
    return [round(x, 2) for x in os.getloadavg()]


def environment(threads: int | None) -> dict[str, Any]:
    """What the numbers depend on besides the code: CPU, threads, library versions, load from others."""
    versions = package_versions(("torch", "transformers", "specdecode"))
    return {
        "cpu": cpu_name(),
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
