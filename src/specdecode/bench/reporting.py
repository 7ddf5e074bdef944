"""What every benchmark report does alike: numbers and tables in Markdown, the sentence on the machine, the
tables of the cell benchmarks (a row per method, a column per batch size or concurrency) and the plots.

Reports read only a benchmark's results JSON, so a report can be rebuilt without measuring again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any


def fmt(value: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "–" if value is None else f"{value:{spec}}{suffix}"


def table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def machine_line(env: Mapping[str, Any], packages: Sequence[str]) -> str:
    """The report's sentence on what the numbers depend on besides the code (see ``common.environment``)."""
    load = env.get("load_average_start"), env.get("load_average_end")
    return (
        f"One run on one machine: {env.get('cpu')} with CPU capability **{env.get('cpu_capability')}**, "
        f"{env.get('cores')} cores, {env.get('threads')} torch threads, fast path "
        f"{'on' if env.get('fast_path') else 'off'}; load average (1/5/15 min) at start {load[0]}, at end {load[1]}. "
        + ", ".join(f"{package} {env.get(package)}" for package in packages)
        + "."
    )


def closing_line(results: Mapping[str, Any]) -> str:
    """A report's last sentence: the machine (:func:`machine_line`) and how long measuring took."""
    env = results.get("environment", {})
    return machine_line(env, ("torch", "transformers", "specdecode")) + (
        f" Measured in {results.get('measure_s', 0) / 60:.1f} min."
    )


# --------------------------------------------------------------------------------------------------------
# The cell benchmarks (``bench throughput``, ``bench serve``): one table per metric

Cells = dict[tuple[str, int], Mapping[str, Any]]


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


def metric_sections(
    tables: Iterable[tuple[str, Callable[[str, int], str]]], names: Sequence[str], columns: Sequence[int], prefix: str
) -> list[str]:
    """A ``## title`` section per (title, value) with a method × ``prefix=column`` table of ``value``."""
    lines: list[str] = []
    for title, value in tables:
        rows = ([f"`{n}`", *(value(n, c) for c in columns)] for n in names)
        lines += ["", f"## {title}", "", *table(["method", *(f"{prefix}={c}" for c in columns)], rows)]
    return lines


# --------------------------------------------------------------------------------------------------------
# Plots


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (files only: no display is needed).  Imported here, when a plot is
    drawn: matplotlib takes a second to import and no measurement needs it."""
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
    pyplot().close(fig)


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
