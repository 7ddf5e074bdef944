"""``results.md`` and ``contention.png`` of ``specdecode bench contention``, from its results JSON alone."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from specdecode.bench import common
from specdecode.bench.contention import CONDITIONS, CONTESTANTS, KEEP_GOAL, LABELS, SPEEDUP_DRIFT_GOAL, summary
from specdecode.bench.markdown import fmt, table


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
        common.machine_line(env, ("torch", "transformers", "specdecode")),
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
    fig, ax = common.pyplot().subplots(figsize=(8, 4.5))
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
    common.save_figure(fig, path)


def write_report(results: Mapping[str, Any], out: Path) -> list[Path]:
    """``results.md`` and ``contention.png`` in ``out``."""
    return common.write_markdown_and_plot(results, out, markdown, plot_contention, "contention.png")
