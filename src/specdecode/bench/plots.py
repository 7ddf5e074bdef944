"""The ``bench`` report's plots: speed-up per task and, with a draft-length sweep, the curves over k."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from specdecode.bench.cells import CellResult, task_order
from specdecode.bench.reporting import pyplot, save_figure


def plot_speedup(cells: Sequence[CellResult], path: Path, title: str, baseline: str | None) -> None:
    """Grouped bars: speed-up over our plain decoding (the line at 1) per task, one bar per method and peer."""
    plt = pyplot()
    tasks = task_order(cells)
    methods = list(
        dict.fromkeys(c.method for c in cells if c.kind != "sweep" and c.speedup is not None and c.method != baseline)
    )
    by_key = {(c.method, c.task): c.speedup for c in cells}
    width = 0.8 / max(1, len(methods))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(tasks) + 2), 4))
    for i, method in enumerate(methods):
        xs = [j + (i - (len(methods) - 1) / 2) * width for j in range(len(tasks))]
        ax.bar(xs, [by_key.get((method, t)) or 0 for t in tasks], width, label=method)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(tasks)), tasks)
    ax.set_ylabel("speed-up over our plain decoding")
    ax.set_title(title)
    ax.legend(fontsize="small")
    save_figure(fig, path)


def plot_draft_length(curves: Mapping[tuple[str, str], list], path: Path, title: str) -> None:
    """Mean accepted tokens (left) and speed-up (right) against the draft length k."""
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for (base, task), points in curves.items():
        ks = [k for k, _ in points]
        left.plot(ks, [c.mean_accepted_tokens for _, c in points], marker="o", label=f"{base} on {task}")
        right.plot(ks, [c.speedup or 0 for _, c in points], marker="o", label=f"{base} on {task}")
    left.set_ylabel("mean accepted tokens per step")
    right.set_ylabel("speed-up over our plain decoding")
    for ax in (left, right):
        ax.set_xlabel("draft length k")
        ax.legend(fontsize="small")
    fig.suptitle(title)
    save_figure(fig, path)
