"""What the benchmark commands share: ``bench`` (``runner.py``), ``bench throughput`` and ``bench serve``.

They validate their settings alike, key and encode their prompts alike, keep their measurements in a
``results.json`` that a rerun resumes from (and refuses when it was written with other settings), and the two
cell benchmarks (one cell per method and batch size or concurrency) build their Markdown tables and plots
alike.  One copy of each of those rules here keeps the commands' error messages, files and checks in step.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from specdecode.bench.markdown import table
from specdecode.data.tasks import TASK_NAMES, Prompt, Task
from specdecode.errors import SpecDecodeError
from specdecode.generator import SpeculativeGenerator
from specdecode.threads import fixed_threads

# --------------------------------------------------------------------------------------------------------
# Settings: the same flag gets the same check and the same one-line error in every command


def is_positive_int(value: Any) -> bool:
    """An ``int`` of at least 1 (``True`` is not a count, though Python calls it an int)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_positive_ints(*labelled: tuple[str, Any]) -> None:
    """Every ``(flag label, value)`` must be a positive integer; the first that is not is the error."""
    for label, value in labelled:
        if not is_positive_int(value):
            raise SpecDecodeError(f"{label} must be a positive integer, got {value!r}")


def check_known_tasks(names: Iterable[str]) -> None:
    for task in names:
        if task not in TASK_NAMES:
            raise SpecDecodeError(f"unknown benchmark task {task!r}; choose from {', '.join(TASK_NAMES)}")


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
    """``defaults`` (threads: the number of cores) overridden by the given ``overrides``; a string value of a
    key in ``parsers`` is parsed as on the command line, in the order of ``parsers`` (so the first bad flag
    is the one reported)."""
    values = {**defaults, "threads": os.cpu_count() or 1, **given_settings(overrides, settings_class, what)}
    for key, parse in parsers.items():
        if isinstance(values[key], str):
            values[key] = parse(values[key])
    return values


def drafter_options(method: Any, drafts: Mapping[str, Any]) -> dict[str, Any]:
    """A :class:`~specdecode.bench.methods.MethodSpec`'s drafter options, its draft model's name replaced by
    that model as loaded (``drafts``: name → loaded model)."""
    options = dict(method.options)
    if method.draft_model is not None:
        options["draft_model"] = drafts[method.draft_model]
    return options


# --------------------------------------------------------------------------------------------------------
# Prompts: keyed ``task/id``, encoded once, and checked against the context before anything is measured


def prompt_fingerprint(tasks: Sequence[Task]) -> list[str]:
    """``task/id#hash`` of every request, in order: what a resumed run must share with the first."""
    return [
        f"{task.name}/{p.id}#{hashlib.sha256(p.text.encode()).hexdigest()[:12]}" for task in tasks for p in task.prompts
    ]


def run_fingerprint(settings: Any, tasks: Sequence[Task], *extra: str) -> dict[str, Any]:
    """What a cell benchmark's rerun must share with the run it resumes: model, ``max_new_tokens``, the
    ``extra`` settings named, and the prompts.  No prompt at all is an error."""
    if not any(task.prompts for task in tasks):
        raise SpecDecodeError("the selected tasks have no prompts")
    return {
        "model": settings.model,
        "max_new_tokens": settings.max_new_tokens,
        **{name: getattr(settings, name) for name in extra},
        "prompts": prompt_fingerprint(tasks),
    }


@dataclass(frozen=True)
class EncodedPrompt:
    key: str  # ``task/id``
    text: str
    ids: list[int]


class PromptEncoder:
    """Prompt text → token ids as every contestant gets them: through the chat template when the target has
    one (a base model gets the plain text), refused when the prompt and ``max_new_tokens`` overflow the
    target's context (before any time is spent measuring)."""

    def __init__(self, target: Any, model: str, max_new_tokens: int) -> None:
        self.chat = bool(getattr(target.tokenizer, "chat_template", None))
        self._encoder = SpeculativeGenerator.build(target, "none")
        self._max_context = target.backend.max_context
        self._model = model
        self._max_new_tokens = max_new_tokens

    def __call__(self, prompt: Prompt) -> list[int]:
        ids = self._encoder.encode_prompt(prompt.text, chat=self.chat)
        if len(ids) + self._max_new_tokens > self._max_context:
            raise SpecDecodeError(
                f"prompt {prompt.id} is {len(ids)} tokens: with {self._max_new_tokens} new tokens it exceeds "
                f"the {self._max_context}-token context of {self._model!r}"
            )
        return ids

    def encode_tasks(self, tasks: Sequence[Task]) -> list[EncodedPrompt]:
        """Every prompt of every task, in order."""
        return [EncodedPrompt(f"{task.name}/{p.id}", p.text, self(p)) for task in tasks for p in task.prompts]


# --------------------------------------------------------------------------------------------------------
# results.json: written after every unit of work, resumed by a rerun with the same settings


def save_json(path: Path, data: dict[str, Any]) -> None:
    """Write atomically: an interrupted run never leaves a half-written file to resume from."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def read_previous(path: Path) -> dict[str, Any] | None:
    """The results an earlier run left at ``path``, or None if there are none; unreadable ones are an error
    (they are never silently overwritten).  Whether they fit this run is for the caller to check."""
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SpecDecodeError(f"cannot resume from {path}: {exc}; delete it or choose another --out") from exc


def other_settings_error(
    path: Path, old: Mapping[str, Any] | None, new: Mapping[str, Any], extra: Sequence[tuple[str, str]] = ()
) -> SpecDecodeError:
    """The one-line refusal to resume a run fingerprinted ``old`` (see :func:`run_fingerprint`) with ``new``;
    ``extra`` names the further settings compared, as (label, fingerprint key)."""
    old = old or {}
    was = [f"model {old.get('model')!r}", f"max_new_tokens {old.get('max_new_tokens')}"]
    was += [f"{label} {old.get(key)}" for label, key in extra]
    now = [repr(new["model"]), str(new["max_new_tokens"]), *(str(new[key]) for _, key in extra)]
    return SpecDecodeError(
        f"{path} holds results of other settings ({', '.join(was)}, {len(old.get('prompts', []))} prompts; now "
        f"{', '.join(now)}, {len(new['prompts'])}): choose another --out or empty it"
    )


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


# --------------------------------------------------------------------------------------------------------
# Reports of the cell benchmarks: one table per metric, a row per method, a column per batch size/concurrency

Cells = dict[tuple[str, int], Mapping[str, Any]]


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def cells_by(results: Mapping[str, Any], column: str) -> tuple[Cells, list[int]]:
    """The cells by (method, value of ``column``), and the column values in ascending order."""
    cells = {(c["method"], c[column]): c for c in results["cells"]}
    return cells, sorted({value for _, value in cells})


def cell_getter(cells: Cells) -> Callable[[str, int, str], Any]:
    """``get(method, column value, key)``: the cell's value, None where the cell or the key is missing."""

    def get(name: str, column: int, key: str) -> Any:
        cell = cells.get((name, column))
        return None if cell is None else cell.get(key)

    return get


def request_count(results: Mapping[str, Any]) -> int:
    return len(results.get("prompts", [])) or next((c["requests"] for c in results["cells"]), 0)


def machine_line(env: Mapping[str, Any], packages: Sequence[str]) -> str:
    """The report's sentence on what the numbers depend on besides the code (see ``runner.environment``)."""
    load = env.get("load_average_start"), env.get("load_average_end")
    return (
        f"One run on one machine: {env.get('cpu')} with CPU capability **{env.get('cpu_capability')}**, "
        f"{env.get('cores')} cores, {env.get('threads')} torch threads, fast path "
        f"{'on' if env.get('fast_path') else 'off'}; load average (1/5/15 min) at start {load[0]}, at end {load[1]}. "
        + ", ".join(f"{package} {env.get(package)}" for package in packages)
        + "."
    )


def metric_sections(
    tables: Iterable[tuple[str, Callable[[str, int], str]]], names: Sequence[str], columns: Sequence[int], prefix: str
) -> list[str]:
    """A ``## title`` section per (title, value) with a method × ``prefix=column`` table of ``value``."""
    lines: list[str] = []
    for title, value in tables:
        rows = ([f"`{n}`", *(value(n, c) for c in columns)] for n in names)
        lines += ["", f"## {title}", "", *table(["method", *(f"{prefix}={c}" for c in columns)], rows)]
    return lines


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (files only: no display is needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def log2_axis(ax: Any, columns: Sequence[int], xlabel: str, ylabel: str) -> None:
    """Batch sizes and concurrencies double from point to point: a log-2 x axis ticked at each."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(columns, [str(c) for c in columns])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)


def save_figure(fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    import matplotlib.pyplot as plt

    plt.close(fig)


def write_markdown_and_plot(
    results: Mapping[str, Any],
    out: Path,
    markdown: Callable[[Mapping[str, Any]], str],
    plot: Callable[[Mapping[str, Any], Path], None],
    png: str,
) -> list[Path]:
    """``results.md`` and the plot ``png`` in ``out``, both from the results JSON alone."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text(markdown(results))
    plot(results, out / png)
    return [out / "results.md", out / png]
