"""Draft-length policies: pure-function behaviour of the schedule and the cost model."""

from __future__ import annotations

import pytest

from specdecode.draft_length import CostModelLength, FixedLength, HeuristicLength, StepObservation, make_policy
from specdecode.errors import SpecDecodeError


def feed(policy, steps: int, *, accept_rate: float, cost, depth: int = 8, draft_s: float = 0.0) -> None:
    """Deterministic observations: verification of width w costs ``cost(w)`` seconds (every width is
    measured once up front), and each draft position is accepted in about ``accept_rate`` of steps."""
    for width in range(1, depth + 2):
        policy.observe(StepObservation(depth=0, nodes=width - 1, accepted=0, draft_s=0.0, verify_s=cost(width)))
    for step in range(steps):
        accepted = 0
        while accepted < depth and ((step * 7 + accepted * 13) % 100) / 100 < accept_rate:
            accepted += 1
        policy.observe(StepObservation(depth=depth, nodes=depth, accepted=accepted, draft_s=draft_s,
                                       verify_s=cost(depth + 1)))


def test_fixed_and_limit():
    assert FixedLength(5).next_length(3) == 3
    assert FixedLength(5).next_length(10) == 5


def test_heuristic_schedule_like_transformers():
    policy = HeuristicLength(k=5)
    policy.observe(StepObservation(depth=5, nodes=5, accepted=5, draft_s=0, verify_s=0))
    assert policy.k == 7
    policy.observe(StepObservation(depth=7, nodes=7, accepted=2, draft_s=0, verify_s=0))
    assert policy.k == 6
    policy.observe(StepObservation(depth=0, nodes=0, accepted=0, draft_s=0, verify_s=0))
    assert policy.k == 6


def test_cost_model_drafts_deep_when_verification_is_cheap_and_acceptance_high():
    policy = CostModelLength()
    feed(policy, 60, accept_rate=0.9, cost=lambda w: 0.1 + 0.001 * w)
    assert policy.next_length(12) >= 8


def test_cost_model_drafts_shallow_when_wide_forwards_are_expensive():
    cheap, steep = CostModelLength(), CostModelLength()
    feed(cheap, 60, accept_rate=0.7, cost=lambda w: 0.1 + 0.002 * w)
    feed(steep, 60, accept_rate=0.7, cost=lambda w: 0.1 + 0.05 * w)
    assert steep.next_length(12) < cheap.next_length(12)


def test_cost_model_stops_drafting_useless_drafts_but_keeps_probing():
    policy = CostModelLength(probe_every=4)
    feed(policy, 80, accept_rate=0.0, cost=lambda w: 0.1 + 0.03 * w, depth=2)
    lengths = [policy.next_length(12) for _ in range(8)]
    assert lengths.count(0) == 6 and lengths.count(1) == 2


def test_cost_model_counts_a_slow_drafter():
    free, slow = CostModelLength(), CostModelLength()
    feed(free, 60, accept_rate=0.7, cost=lambda w: 0.1 + 0.01 * w, draft_s=0.0)
    feed(slow, 60, accept_rate=0.7, cost=lambda w: 0.1 + 0.01 * w, draft_s=8 * 0.08)
    assert slow.next_length(12) < free.next_length(12)


def test_verify_cost_interpolates_between_measured_widths():
    policy = CostModelLength()
    for width, seconds in [(1, 1.0), (5, 3.0)]:
        policy.observe(StepObservation(depth=width - 1, nodes=width - 1, accepted=0, draft_s=0, verify_s=seconds))
    assert policy._verify_seconds(3) == pytest.approx(2.0, rel=0.05)
    assert policy._verify_seconds(9) == pytest.approx(5.0, rel=0.05)


@pytest.mark.parametrize("bad", [-1, "fast", 2.5, None])
def test_bad_specs_are_refused(bad):
    with pytest.raises(SpecDecodeError, match="num-draft-tokens"):
        make_policy(bad)
