"""From raw measurements to cells, a Markdown report and plots.

Everything here reads only the results JSON written by ``runner.py``, so a report can be rebuilt without
measuring again.  Aggregation rules:

* per prompt, the time is the median over repeats;
* a cell's tokens/s is total tokens over total (median) time, so long prompts weigh by their cost;
* acceptance pools the raw counts of every step of every prompt (not a mean of per-prompt ratios);
* a speed-up is a ratio of tokens/s measured in the same run, on the same prompts, on the same machine.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specdecode.bench.tasks import GROUNDED_TASKS, Task

ALL_TASKS = "all"
Records = Mapping[str, Mapping[str, Any]]  # prompt id → raw record of one contestant on one task


# --------------------------------------------------------------------------------------------------------
# Metrics: small pure functions over raw records


def median_wall_s(record: Mapping[str, Any]) -> float:
    return statistics.median(record["wall_s"])


def tokens_per_s(records: Iterable[Mapping[str, Any]]) -> float:
    records = list(records)
    wall = sum(median_wall_s(r) for r in records)
    return sum(r["new_tokens"] for r in records) / wall if wall > 0 else 0.0


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


def equal_pct(records: Records, reference: Records) -> float | None:
    """Percentage of the prompts measured by both whose generated tokens are identical."""
    common = [pid for pid in records if pid in reference]
    if not common:
        return None
    same = sum(records[pid]["token_ids"] == reference[pid]["token_ids"] for pid in common)
    return 100.0 * same / len(common)


@dataclass(frozen=True)
class Acceptance:
    mean_accepted_tokens: float  # tokens per target forward, the target's own token included
    acceptance_rate: float | None  # accepted / drafted; None when nothing was drafted
    by_position: list[float]  # acceptance rate at draft position 1, 2, ...


def acceptance(records: Iterable[Mapping[str, Any]]) -> Acceptance:
    """Pooled over every step of every record (raw counts, summed)."""
    steps = drafted = accepted = 0
    drafted_at: list[int] = []
    accepted_at: list[int] = []
    for record in records:
        steps += record["steps"]
        drafted += record["drafted_tokens"]
        accepted += record["accepted_tokens"]
        for totals, counts in ((drafted_at, record["drafted_at"]), (accepted_at, record["accepted_at"])):
            totals.extend([0] * (len(counts) - len(totals)))
            for i, count in enumerate(counts):
                totals[i] += count
    return Acceptance(
        mean_accepted_tokens=(accepted + steps) / steps if steps else 0.0,
        acceptance_rate=accepted / drafted if drafted else None,
        by_position=[a / d if d else 0.0 for a, d in zip(accepted_at, drafted_at)],
    )


@dataclass(frozen=True)
class TimeShares:
    draft: float  # drafting / whole generation
    overhead: float  # neither drafting nor a target forward: the engine's own time


def time_shares(records: Iterable[Mapping[str, Any]]) -> TimeShares | None:
    """Pooled over every run of every record; None for records written before the split was recorded."""
    records = list(records)
    if not records or any("engine_wall_s" not in r for r in records):
        return None
    wall = sum(r["engine_wall_s"] for r in records)
    draft = sum(r["draft_s"] for r in records)
    forward = sum(r["forward_s"] for r in records)
    if wall <= 0:
        return None
    return TimeShares(draft=draft / wall, overhead=max(0.0, wall - draft - forward) / wall)


# --------------------------------------------------------------------------------------------------------
# Cells


@dataclass
class CellResult:
    """One (model, method, task): ``method`` is our method spec or a peer's name; task may be "all"."""

    model: str
    method: str
    kind: str  # "ours", "sweep" (a draft-length variant of one of ours) or "peer"
    task: str
    prompts: int
    new_tokens: int
    wall_s: float
    tokens_per_s: float
    speedup: float | None  # tokens/s over our plain decoding on the same prompts
    equal_to_plain_pct: float | None  # % of prompts token-identical to our plain decoding
    repeats_identical: bool  # every repeat produced the same tokens
    mean_accepted_tokens: float | None = None
    acceptance_rate: float | None = None
    acceptance_by_position: list[float] = field(default_factory=list)
    draft_share: float | None = None  # of our generation time, spent drafting
    overhead_share: float | None = None  # of our generation time, spent outside drafting and target forwards
    matches: str | None = None  # peers: our method with the same configuration
    ours_over_theirs: float | None = None  # peers: our tokens/s / theirs
    equal_to_ours_pct: float | None = None  # peers: % of prompts where their tokens equal ours

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        return {key: round(value, 4) if isinstance(value, float) else value for key, value in data.items()} | {
            "acceptance_by_position": [round(x, 4) for x in self.acceptance_by_position]
        }


def _records(results: Mapping[str, Any], name: str, task: Task) -> dict[str, Mapping[str, Any]]:
    """The contestant's records on the task's current prompts (an older run may hold more)."""
    by_prompt = results["runs"].get(name, {}).get(task.name, {})
    return {p.id: by_prompt[p.id] for p in task.prompts if p.id in by_prompt}


def build_cells(results: Mapping[str, Any], tasks: Sequence[Task]) -> list[CellResult]:
    """Every (contestant, task) with measurements, plus (contestant, "all") pooled over the tasks when there
    are several and the contestant ran them all."""
    settings = results["settings"]
    baseline = settings["baseline"]
    peers = settings["peers"]
    sweep_only = [spec for spec in settings["sweep"] if spec not in settings["methods"]]
    names = [*settings["methods"], *sweep_only, *peers]
    data = {name: {task.name: _records(results, name, task) for task in tasks} for name in names}
    for name in names:
        if len(tasks) > 1 and all(data[name][t.name] for t in tasks):
            data[name][ALL_TASKS] = {f"{task}/{pid}": r for task, recs in data[name].items() for pid, r in recs.items()}
    cells = []
    for name in names:
        kind = "peer" if name in peers else "sweep" if name in sweep_only else "ours"
        for task, records in data[name].items():
            if not records:
                continue
            plain = data[baseline].get(task, {}) if baseline else {}
            speed = tokens_per_s(records.values())
            cell = CellResult(
                model=settings["model"],
                method=name,
                kind=kind,
                task=task,
                prompts=len(records),
                new_tokens=sum(r["new_tokens"] for r in records.values()),
                wall_s=sum(median_wall_s(r) for r in records.values()),
                tokens_per_s=speed,
                speedup=ratio(speed, tokens_per_s(plain.values())) if plain else None,
                equal_to_plain_pct=equal_pct(records, plain),
                repeats_identical=all(r["repeats_identical"] for r in records.values()),
            )
            if kind == "peer":
                ours = data[peers[name]["matches"]].get(task, {})
                cell.matches = peers[name]["matches"]
                cell.ours_over_theirs = ratio(tokens_per_s(ours.values()) if ours else None, speed)
                cell.equal_to_ours_pct = equal_pct(records, ours)
            else:
                accepted = acceptance(records.values())
                cell.mean_accepted_tokens = accepted.mean_accepted_tokens
                cell.acceptance_rate = accepted.acceptance_rate
                cell.acceptance_by_position = accepted.by_position
                if shares := time_shares(records.values()):
                    cell.draft_share, cell.overhead_share = shares.draft, shares.overhead
            cells.append(cell)
    return cells


# --------------------------------------------------------------------------------------------------------
# Markdown


def _fmt(value: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "–" if value is None else f"{value:{spec}}{suffix}"


def _table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def _task_order(cells: Sequence[CellResult]) -> list[str]:
    tasks = list(dict.fromkeys(c.task for c in cells if c.task != ALL_TASKS))
    return [*tasks, ALL_TASKS] if any(c.task == ALL_TASKS for c in cells) else tasks


def _environment_lines(results: Mapping[str, Any]) -> list[str]:
    env = results.get("environment", {})
    s = results["settings"]
    load = env.get("load_average_start"), env.get("load_average_end")
    return [
        f"- Machine: {env.get('cpu')} ({env.get('cpu_capability', 'vector width not recorded')}), "
        f"{env.get('cores')} cores, {env.get('threads')} torch threads; "
        f"load average (1/5/15 min) at start {load[0]}, at end {load[1]} "
        "(anything near or above the core count means other processes shared the CPU).",
        f"- Software: Python {env.get('python')}, torch {env.get('torch')}, transformers {env.get('transformers')}, "
        f"specdecode {env.get('specdecode')}; {env.get('platform')}.",
        f"- Settings: model `{s['model']}`, {s['prompts_per_task']} prompt(s) per task (seed {s['seed']}), "
        f"{s['max_new_tokens']} new tokens per prompt (greedy, EOS ignored), median of {s['repeats']} "
        f"interleaved repeat(s) after a warm-up, chat template {'on' if results.get('chat_template') else 'off'}; "
        f"{results.get('measure_s', 0) / 60:.1f} min of measuring.",
        _DRAFTER_STATE[s.get("drafter_state", "request")],
    ]


_DRAFTER_STATE = {
    "request": "- Drafter state: reset before every prompt (cold), except within a session task (`multi-edit`), "
    "whose requests run in order on one drafter, reset before each repeat of the session.",
    "task": "- Drafter state: reset once per task and repeat; kept across the task's prompts in order (warm).",
}


def markdown(results: Mapping[str, Any], cells: Sequence[CellResult]) -> str:
    s = results["settings"]
    tasks = _task_order(cells)
    by_key = {(c.method, c.task): c for c in cells}
    title = f"# specdecode benchmark: suite `{s['suite']}`, model `{s['model']}`"
    lines = [title, "", *_environment_lines(results), ""]

    lines += [
        "## Speed-up over our plain decoding",
        "",
        f"Tokens/s divided by that of `{s['baseline']}` on the same prompts; peers are transformers "
        "`generate()` on the same model.",
        "",
    ]
    main = [name for name in [*s["methods"], *s["peers"]] if any((name, t) in by_key for t in tasks)]
    lines += _table(
        ["method", *tasks],
        (
            [f"`{name}`", *(_fmt(by_key[name, t].speedup if (name, t) in by_key else None, ".2f", "x") for t in tasks)]
            for name in main
        ),
    )

    lines += [
        "",
        "## Per task",
        "",
        "Drafting and engine overhead are shares of our generation time; the rest is target forwards.",
        "",
    ]
    lines += _table(
        [
            "method",
            "task",
            "prompts",
            "mean accepted tokens",
            "acceptance rate",
            "tokens/s",
            "speed-up",
            "identical to plain",
            "drafting",
            "engine overhead",
        ],
        (
            [
                f"`{c.method}`",
                c.task,
                str(c.prompts),
                _fmt(c.mean_accepted_tokens),
                _fmt(c.acceptance_rate, ".1%"),
                _fmt(c.tokens_per_s, ".1f"),
                _fmt(c.speedup, ".2f", "x"),
                _fmt(c.equal_to_plain_pct, ".0f", "%"),
                _fmt(c.draft_share, ".1%"),
                _fmt(c.overhead_share, ".1%"),
            ]
            for c in cells
            if c.kind != "sweep"
        ),
    )

    peer_cells = [c for c in cells if c.kind == "peer"]
    if peer_cells:
        lines += [
            "",
            "## Against transformers",
            "",
            "Our tokens/s divided by transformers' for the matching configuration (above 1: we are faster).",
            "",
        ]
        header = ["task", "ours", "tokens/s", "transformers", "tokens/s", "ours / theirs", "same output", "verdict"]
        lines += _table(header, (_peer_row(c, by_key[c.matches, c.task]) for c in peer_cells))

    drafting = [c for c in cells if c.kind == "ours" and c.task == tasks[-1] and c.acceptance_by_position]
    if drafting:
        lines += ["", f"## Acceptance by draft position (task `{tasks[-1]}`)", ""]
        width = max(len(c.acceptance_by_position) for c in drafting)
        lines += _table(
            ["method", *(str(i + 1) for i in range(width))],
            (
                [
                    f"`{c.method}`",
                    *(_fmt(x, ".0%") for x in c.acceptance_by_position),
                    *("–" for _ in range(width - len(c.acceptance_by_position))),
                ]
                for c in drafting
            ),
        )

    sweep = _sweep_cells(results, cells)
    if sweep:
        lines += ["", "## Draft length", ""]
        header = ["varied method", "task", "k", "mean accepted tokens", "acceptance rate", "tokens/s", "speed-up"]
        lines += _table(
            header,
            (
                [
                    f"`{base}`",
                    c.task,
                    str(k),
                    _fmt(c.mean_accepted_tokens),
                    _fmt(c.acceptance_rate, ".1%"),
                    _fmt(c.tokens_per_s, ".1f"),
                    _fmt(c.speedup, ".2f", "x"),
                ]
                for (base, _), points in sweep.items()
                for k, c in points
            ),
        )

    lines += ["", "## Goals", "", *_goal_lines(cells), ""]
    return "\n".join(lines)


def _peer_row(peer: CellResult, ours: CellResult) -> list[str]:
    if peer.ours_over_theirs is None:
        verdict = "–"
    else:
        verdict = "we are faster" if peer.ours_over_theirs >= 1 else "**we are slower**"
    return [
        peer.task,
        f"`{ours.method}`",
        _fmt(ours.tokens_per_s, ".1f"),
        f"`{peer.method}`",
        _fmt(peer.tokens_per_s, ".1f"),
        _fmt(peer.ours_over_theirs, ".2f", "x"),
        _fmt(peer.equal_to_ours_pct, ".0f", "%"),
        verdict,
    ]


def _sweep_cells(results: Mapping[str, Any], cells: Sequence[CellResult]) -> dict[tuple[str, str], list]:
    """(base method, task) → [(k, cell)] sorted by k, over the sweep tasks."""
    sweep = results["settings"]["sweep"]
    by_key = {(c.method, c.task): c for c in cells}
    curves: dict[tuple[str, str], list] = {}
    for spec, info in sweep.items():
        for task in results["settings"]["sweep_tasks"]:
            if (spec, task) in by_key:
                curves.setdefault((info["base"], task), []).append((info["k"], by_key[spec, task]))
    return {key: sorted(points, key=lambda p: p[0]) for key, points in curves.items()}


def _goal_lines(cells: Sequence[CellResult]) -> list[str]:
    """The issue's goals, stated as measured — never asserted, and misses are said plainly."""
    lines = []
    grounded = [c for c in cells if c.kind == "ours" and c.method.split(":")[0] == "pld" and c.task in GROUNDED_TASKS]
    for c in grounded:
        verdict = "met" if c.speedup is not None and c.speedup >= 2 else "**not met**"
        lines.append(
            f"- `{c.method}` on grounded task {c.task}: {_fmt(c.speedup, '.2f', 'x')} over plain "
            f"decoding (goal >= 2x: {verdict})."
        )
    lines += _model_free_goal_lines(cells)
    slower = [c for c in cells if c.kind == "peer" and c.ours_over_theirs is not None and c.ours_over_theirs < 1]
    compared = [c for c in cells if c.kind == "peer" and c.ours_over_theirs is not None]
    if compared and not slower:
        lines.append(f"- Our tokens/s >= transformers' in all {len(compared)} matching (configuration, task) pairs.")
    for c in slower:
        lines.append(
            f"- **Slower than transformers**: `{c.matches}` vs `{c.method}` on {c.task}: "
            f"{c.ours_over_theirs:.2f}x their tokens/s."
        )
    unequal = [c for c in cells if c.equal_to_plain_pct is not None and c.equal_to_plain_pct < 100]
    for c in unequal:
        lines.append(
            f"- **Output differs from plain decoding**: `{c.method}` on {c.task}, "
            f"{c.equal_to_plain_pct:.0f}% of prompts identical."
        )
    for c in cells:
        if not c.repeats_identical:
            lines.append(f"- **Repeats disagree**: `{c.method}` on {c.task} generated different tokens across repeats.")
    return lines or ["- Nothing to compare (no plain baseline or peers in this run)."]


def _model_free_goal_lines(cells: Sequence[CellResult]) -> list[str]:
    """Issue 4's goals: ``suffix`` >= 1.3x the tokens/s of ``pld`` on grounded tasks; ``recycling`` above
    ``pld`` in mean accepted tokens on mt-bench.  Every ``suffix`` / ``recycling`` method is compared with
    the first listed ``pld`` method."""
    ours = [c for c in cells if c.kind == "ours"]
    pld: dict[str, CellResult] = {}
    for c in ours:
        if c.method.split(":")[0] == "pld":
            pld.setdefault(c.task, c)
    lines = []
    for c in ours:
        drafter = c.method.split(":")[0]
        if drafter == "suffix" and c.task in GROUNDED_TASKS and c.task in pld:
            over = ratio(c.tokens_per_s, pld[c.task].tokens_per_s)
            verdict = "met" if over is not None and over >= 1.3 else "**not met**"
            lines.append(
                f"- `{c.method}` on {c.task}: {_fmt(over, '.2f', 'x')} the tokens/s of "
                f"`{pld[c.task].method}` (goal >= 1.3x: {verdict})."
            )
        if drafter == "recycling" and c.task == "mt-bench" and c.task in pld:
            reference = pld[c.task]
            above = (c.mean_accepted_tokens or 0) > (reference.mean_accepted_tokens or 0)
            lines.append(
                f"- `{c.method}` on mt-bench: {_fmt(c.mean_accepted_tokens)} mean accepted tokens vs "
                f"{_fmt(reference.mean_accepted_tokens)} for `{reference.method}` "
                f"(goal: above: {'met' if above else '**not met**'})."
            )
    return lines


# --------------------------------------------------------------------------------------------------------
# Plots


def plot_speedup(cells: Sequence[CellResult], path: Path, title: str, baseline: str | None) -> None:
    """Grouped bars: speed-up over our plain decoding (the line at 1) per task, one bar per method and peer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = _task_order(cells)
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
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_draft_length(curves: Mapping[tuple[str, str], list], path: Path, title: str) -> None:
    """Mean accepted tokens (left) and speed-up (right) against the draft length k."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(results: Mapping[str, Any], cells: Sequence[CellResult], out: Path) -> list[Path]:
    """``results.md``, ``speedup.png`` and (with a sweep) ``draft_length.png`` in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    model = results["settings"]["model"]
    written = [out / "results.md"]
    written[0].write_text(markdown(results, cells))
    if any(c.speedup is not None for c in cells):
        title = f"{Path(model).name}: speed-up per task"
        plot_speedup(cells, out / "speedup.png", title, results["settings"]["baseline"])
        written.append(out / "speedup.png")
    if curves := _sweep_cells(results, cells):
        plot_draft_length(curves, out / "draft_length.png", f"{Path(model).name}: draft length")
        written.append(out / "draft_length.png")
    return written
