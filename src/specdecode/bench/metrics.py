"""Metrics: small pure functions over the raw records the benchmarks save (see ``cells.py`` for how the
``bench`` report aggregates them)."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

Records = Mapping[str, Mapping[str, Any]]  # prompt id → raw record of one contestant on one task


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
