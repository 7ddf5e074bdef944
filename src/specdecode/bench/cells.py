"""From raw measurements to cells: one (model, method, task) each, the report's rows.

Everything here reads only the results JSON written by ``runner.py``, so a report can be rebuilt without
measuring again.  Aggregation rules:

* per prompt, the time is the median over repeats;
* a cell's tokens/s is total tokens over total (median) time, so long prompts weigh by their cost;
* acceptance pools the raw counts of every step of every prompt (not a mean of per-prompt ratios);
* a speed-up is a ratio of tokens/s measured in the same run, on the same prompts, on the same machine.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from specdecode.bench.metrics import (
    acceptance,
    bootstrap_speedup,
    equal_pct,
    median_wall_s,
    paired_speedups,
    ratio,
    time_shares,
    tokens_per_s,
)
from specdecode.data.tasks import Task

ALL_TASKS = "all"


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
    equal_to_own_plain_pct: float | None = None  # speculative peers: % equal to their own engine's plain decoding
    speedup_ci: list[float] | None = None  # the speed-up's 95% bootstrap interval over prompts (from 2 prompts)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        rounded = {key: round(value, 4) if isinstance(value, float) else value for key, value in data.items()}
        return rounded | {
            "acceptance_by_position": [round(x, 4) for x in self.acceptance_by_position],
            "speedup_ci": [round(x, 4) for x in self.speedup_ci] if self.speedup_ci else None,
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
                speedup_ci=list(interval) if plain and (interval := bootstrap_speedup(records, plain)) else None,
                equal_to_plain_pct=equal_pct(records, plain),
                repeats_identical=all(r["repeats_identical"] for r in records.values()),
            )
            if kind == "peer":
                ours = data[peers[name]["matches"]].get(task, {})
                cell.matches = peers[name]["matches"]
                cell.ours_over_theirs = ratio(tokens_per_s(ours.values()) if ours else None, speed)
                cell.equal_to_ours_pct = equal_pct(records, ours)
                own_plain = _own_plain(peers, name)
                if own_plain is not None and own_plain in data:
                    cell.equal_to_own_plain_pct = equal_pct(records, data[own_plain].get(task, {}))
            else:
                accepted = acceptance(records.values())
                cell.mean_accepted_tokens = accepted.mean_accepted_tokens
                cell.acceptance_rate = accepted.acceptance_rate
                cell.acceptance_by_position = accepted.by_position
                if shares := time_shares(records.values()):
                    cell.draft_share, cell.overhead_share = shares.draft, shares.overhead
            cells.append(cell)
    return cells


def _own_plain(peers: Mapping[str, Mapping[str, Any]], name: str) -> str | None:
    """The plain decoding of the engine the peer ``name`` belongs to (None for a plain peer itself): a
    speculative peer is exact only if its tokens equal its own engine's plain tokens, whatever ours are."""

    def is_plain(info: Mapping[str, Any]) -> bool:
        return info["matches"].split(":")[0] == "none"

    if is_plain(peers[name]):
        return None
    family = peers[name].get("family", "transformers")
    same_engine = (other for other, info in peers.items() if info.get("family", "transformers") == family)
    return next((other for other in same_engine if is_plain(peers[other])), None)


@dataclass(frozen=True)
class PromptSpeedup:
    """One method's speed-up on one prompt, paired repeat by repeat with the baseline (``paired_speedups``)."""

    method: str
    task: str
    prompt: str
    by_repeat: list[float]
    drafted: int = 0  # draft tokens over every repeat: none makes the cell plain decoding under another name

    @property
    def median(self) -> float:
        return statistics.median(self.by_repeat)


def prompt_speedups(results: Mapping[str, Any]) -> list[PromptSpeedup]:
    """Every one of our methods' speed-up on every prompt over the baseline, paired repeat by repeat."""
    settings, runs = results["settings"], results["runs"]
    baseline = settings["baseline"]
    prompts = [(task, entry["id"]) for task, entries in results["prompts"].items() for entry in entries]
    measured = []
    for name in settings["methods"]:
        if name == baseline or name not in runs:
            continue
        for task, pid in prompts:
            record, plain = runs[name].get(task, {}).get(pid), runs.get(baseline, {}).get(task, {}).get(pid)
            if record and plain and (speedups := paired_speedups(record, plain)):
                measured.append(PromptSpeedup(name, task, pid, speedups, int(record.get("drafted_tokens", 0))))
    return measured


def slowest_prompts(measured: Sequence[PromptSpeedup]) -> list[PromptSpeedup]:
    """Each method's prompt with the lowest median paired speed-up over the baseline: where a user of ``auto``
    would most regret drafting (the goal: no prompt below ``report.NEVER_SLOWER``)."""
    by_method: dict[str, list[PromptSpeedup]] = {}
    for cell in measured:
        by_method.setdefault(cell.method, []).append(cell)
    return [min(cells, key=lambda p: p.median) for cells in by_method.values()]


def task_order(cells: Sequence[CellResult]) -> list[str]:
    tasks = list(dict.fromkeys(c.task for c in cells if c.task != ALL_TASKS))
    return [*tasks, ALL_TASKS] if any(c.task == ALL_TASKS for c in cells) else tasks
