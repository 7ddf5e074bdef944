"""What ``specdecode bench contention`` measures and aims at, and its ``results.md`` and ``contention.png``, from
its results JSON alone."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from specdecode.bench.reporting import fmt, machine_line, pyplot, save_figure, table, write_markdown_and_plot

CONDITIONS = ("idle", "busy")
CONTESTANTS = ("none", "pld", "none-fixed-threads", "hf-plain", "hf-prompt-lookup")
LABELS = {
    "none": "specdecode plain (governed threads)",
    "pld": "specdecode pld (governed threads)",
    "none-fixed-threads": "specdecode plain, threads fixed at the CPU count",
    "hf-plain": "transformers plain",
    "hf-prompt-lookup": "transformers prompt lookup",
}
#: Share of its idle tokens/s our plain decoding keeps with one busy competitor on 2 cores.
KEEP_GOAL = 0.45
#: How far ``pld``'s speed-up over plain decoding may drift from its idle value under that load.
SPEEDUP_DRIFT_GOAL = 0.20


def summary(results: Mapping[str, Any]) -> dict[str, Any]:
    """The goal figures from the cells: share of idle speed kept, pld's speed-up idle and busy."""
    speed = {(c["method"], c["condition"]): c["tokens_per_s"] for c in results["cells"]}

    def ratio(a: tuple[str, str], b: tuple[str, str]) -> float | None:
        return round(speed[a] / speed[b], 3) if a in speed and b in speed and speed[b] else None

    kept = {name: ratio((name, "busy"), (name, "idle")) for name in CONTESTANTS}
    speedup = {condition: ratio(("pld", condition), ("none", condition)) for condition in CONDITIONS}
    drift = None
    if speedup["idle"] and speedup["busy"]:
        drift = round(abs(speedup["busy"] / speedup["idle"] - 1), 3)
    return {
        "kept": kept,
        "pld_speedup": speedup,
        "pld_speedup_drift": drift,
        "keep_goal_met": kept["none"] is not None and kept["none"] >= KEEP_GOAL,
        "drift_goal_met": drift is not None and drift <= SPEEDUP_DRIFT_GOAL,
        "same_tokens": _same_tokens(results),
    }


def _same_tokens(results: Mapping[str, Any]) -> bool:
    """Our contestants' outputs agree across conditions and thread counts (greedy: they must)."""
    ours = [c["outputs"] for c in results["cells"] if not c["method"].startswith("hf-")]
    return all(outputs == ours[0] for outputs in ours)


def markdown(results: Mapping[str, Any]) -> str:
    s = results["settings"]
    env = results.get("environment", {})
    cells = {(c["method"], c["condition"]): c for c in results["cells"]}
    sums = summary(results)

    def cell(name: str, condition: str, key: str) -> Any:
        return cells.get((name, condition), {}).get(key)

    rows = [
        [
            f"`{name}`: {LABELS[name]}",
            *(fmt(cell(name, condition, "tokens_per_s"), ".1f") for condition in CONDITIONS),
            fmt(None if sums["kept"][name] is None else 100 * sums["kept"][name], ".0f", "%"),
            *(str(cell(name, condition, "threads_at_end") or "–") for condition in CONDITIONS),
        ]
        for name in CONTESTANTS
        if any((name, condition) in cells for condition in CONDITIONS)
    ]
    speedup = sums["pld_speedup"]
    lines = [
        f"# specdecode under contention: model `{s['model']}`",
        "",
        machine_line(env, ("torch", "transformers", "specdecode")),
        "",
        f"{len(results['fingerprint']['prompts'])} prompts ({', '.join(s['tasks'])}), {s['max_new_tokens']} new "
        "tokens each (greedy, EOS ignored), decoded one after another; tokens/s over the whole set, after an "
        "untimed warm-up. *busy*: one other process (a Python busy loop) runs for the whole cell, started "
        "before the warm-up. Our governed contestants choose their torch thread count before each forward from "
        "the CPU time other processes took (`specdecode.threads`); the others keep the CPU count. Each "
        "contestant runs idle then busy, one after the other. "
        f"{results.get('measure_s', 0) / 60:.1f} min of measuring.",
        "",
        *table(["contestant", "idle tokens/s", "busy tokens/s", "busy / idle", "threads idle", "threads busy"], rows),
        "",
        f"- Goal: keep ≥ {KEEP_GOAL:.0%} of our idle plain tokens/s under one busy competitor — "
        f"{_verdict(sums['keep_goal_met'])} (kept {_pct(sums['kept']['none'])}).",
        f"- Goal: `pld`'s speed-up over plain within {SPEEDUP_DRIFT_GOAL:.0%} of its idle value — "
        f"{_verdict(sums['drift_goal_met'])} (idle {fmt(speedup['idle'], '.2f', 'x')}, busy "
        f"{fmt(speedup['busy'], '.2f', 'x')}, {_pct(sums['pld_speedup_drift'])} apart).",
        f"- Under load, our governed plain decoding against transformers' plain `generate()`: "
        f"{fmt(_ratio(cells, 'none', 'hf-plain'), '.2f', 'x')}; our `pld` against transformers' prompt "
        f"lookup: {fmt(_ratio(cells, 'pld', 'hf-prompt-lookup'), '.2f', 'x')}.",
        f"- Our outputs (governed and fixed threads, idle and busy) are token-for-token the same: "
        f"{'yes' if sums['same_tokens'] else 'no'}.",
    ]
    return "\n".join(lines) + "\n"


def _verdict(met: bool) -> str:
    return "**met**" if met else "**missed**"


def _pct(value: float | None) -> str:
    return fmt(None if value is None else 100 * value, ".0f", "%")


def _ratio(cells: Mapping[tuple[str, str], Mapping[str, Any]], ours: str, peer: str) -> float | None:
    a, b = cells.get((ours, "busy")), cells.get((peer, "busy"))
    return a["tokens_per_s"] / b["tokens_per_s"] if a and b and b["tokens_per_s"] else None


def plot_contention(results: Mapping[str, Any], path: Path) -> None:
    """Idle and busy tokens/s side by side, one pair of bars per contestant."""
    cells = {(c["method"], c["condition"]): c["tokens_per_s"] for c in results["cells"]}
    names = [n for n in CONTESTANTS if any((n, c) in cells for c in CONDITIONS)]
    fig, ax = pyplot().subplots(figsize=(8, 4.5))
    width = 0.38
    for offset, condition in ((-width / 2, "idle"), (width / 2, "busy")):
        xs = [i + offset for i in range(len(names))]
        ax.bar(xs, [cells.get((n, condition), 0) for n in names], width, label=condition)
    ax.set_xticks(range(len(names)), names, rotation=15, fontsize="small")
    ax.set_ylabel("tokens/s")
    env = results.get("environment", {})
    ax.set_title(
        f"{Path(results['settings']['model']).name}: idle vs one busy process "
        f"({env.get('cores')} cores, {env.get('cpu_capability')})"
    )
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    save_figure(fig, path)


def write_report(results: Mapping[str, Any], out: Path) -> list[Path]:
    """``results.md`` and ``contention.png`` in ``out``."""
    return write_markdown_and_plot(results, out, markdown, plot_contention, "contention.png")
