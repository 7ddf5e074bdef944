"""Metrics: small pure functions over the raw records the benchmarks save (see ``cells.py`` for how the
``bench`` report aggregates them)."""

from __future__ import annotations

import random
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

Records = Mapping[str, Mapping[str, Any]]  # prompt id → raw record of one contestant on one task


def median_wall_s(record: Mapping[str, Any]) -> float:
    return statistics.median(record["wall_s"])


def tokens_per_s(records: Iterable[Mapping[str, Any]]) -> float:
    """Total tokens over total (median) time of raw records."""
    return tokens_per_s_of((r["new_tokens"], median_wall_s(r)) for r in records)


def tokens_per_s_of(measurements: Iterable[tuple[int, float]]) -> float:
    """Total tokens over total time of ``(tokens, seconds)`` pairs (0 when no time was measured)."""
    tokens = seconds = 0.0
    for count, wall in measurements:
        tokens, seconds = tokens + count, seconds + wall
    return tokens / seconds if seconds > 0 else 0.0


def paired_speedups(record: Mapping[str, Any], reference: Mapping[str, Any]) -> list[float]:
    """One prompt's speed-up in each repeat: its tokens/s over the reference's *in the same repeat*.  A repeat
    runs every contestant on the prompt within a minute or so (interleaved: ``runner.run_group``; ours in
    lockstep, side by side), so a host that slows down between repeats moves both sides of each ratio alike,
    where a ratio of the two medians can take them from different repeats."""
    return [
        (record["new_tokens"] / ours) / (reference["new_tokens"] / theirs)
        for ours, theirs in zip(record["wall_s"], reference["wall_s"])
        if ours > 0 and theirs > 0
    ]


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


#: Resamples of the bootstrap: enough that the interval's ends hardly depend on its seed.
BOOTSTRAP_RESAMPLES = 2000


def bootstrap_speedup(
    records: Records, reference: Records, confidence: float = 0.95, seed: int = 0
) -> tuple[float, float] | None:
    """A percentile-bootstrap confidence interval of ``tokens_per_s(records) / tokens_per_s(reference)``.

    Prompts are resampled with replacement, each drawn prompt contributing both its records (a paired
    bootstrap: a prompt that is slow for every contestant moves both sides alike), and the ratio is
    pooled as the report pools it — total tokens over total time.  None with fewer than two common
    prompts, where there is nothing to resample.  The interval says how much the figure depends on which
    prompts were drawn; it does not cover timing noise within a prompt (the repeats' median does that).
    """
    common = [pid for pid in records if pid in reference]
    if len(common) < 2:
        return None
    ours = [(records[pid]["new_tokens"], median_wall_s(records[pid])) for pid in common]
    theirs = [(reference[pid]["new_tokens"], median_wall_s(reference[pid])) for pid in common]
    rng = random.Random(seed)
    ratios = []
    for _ in range(BOOTSTRAP_RESAMPLES):
        drawn = [rng.randrange(len(common)) for _ in common]
        speed = tokens_per_s_of(ours[i] for i in drawn)
        plain = tokens_per_s_of(theirs[i] for i in drawn)
        if speed > 0 and plain > 0:
            ratios.append(speed / plain)
    if not ratios:
        return None
    ratios.sort()
    tail = (1 - confidence) / 2
    return ratios[int(tail * (len(ratios) - 1))], ratios[round((1 - tail) * (len(ratios) - 1))]


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


#: What a generation's stats count, as the per-prompt records of ``bench coupling`` and ``bench quality`` keep them.
DECODE_COUNTS = ("new_tokens", "steps", "drafted_tokens", "accepted_tokens")


def decode_record(stats: Any) -> dict[str, Any]:
    """A :class:`~specdecode.stats.GenerationStats`' counts and wall time, as a record keeps them."""
    return {**{key: getattr(stats, key) for key in DECODE_COUNTS}, "wall_s": round(stats.wall_s, 5)}


def pooled_counts(records: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """The counts of :data:`DECODE_COUNTS` summed over records."""
    records = list(records)
    return {key: sum(r[key] for r in records) for key in DECODE_COUNTS}


def tokens_per_step(counts: Mapping[str, int]) -> float:
    """Tokens per target forward, the target's own token included (plain decoding: 1.0)."""
    return (counts["accepted_tokens"] + counts["steps"]) / counts["steps"] if counts["steps"] else 0.0
