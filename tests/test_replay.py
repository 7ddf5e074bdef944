"""Policy replay: with a context-only drafter, replaying a plain greedy output reproduces exactly the steps
and acceptance of a real speculative run, and times steps from the given cost curve."""

from __future__ import annotations

import pytest

from specdecode.bench.replay import StepCosts, accepted_path, replay
from specdecode.config import GenerationConfig
from specdecode.draft_length.base import FixedLength
from specdecode.drafters import create_drafter
from specdecode.engine import DecodeOutcome, speculative_decode
from specdecode.types import Draft

PROMPT = [12, 13, 14, 12, 13, 14, 12, 13, 5, 12, 13, 14]


def test_accepted_path_follows_the_expected_tokens_down_a_tree():
    tree = Draft(tokens=[1, 2, 3, 4], parents=[-1, -1, 1, 2])
    assert accepted_path(tree, [2, 3, 9]) == [1, 2]
    assert accepted_path(tree, [2, 3, 4]) == [1, 2, 3]
    assert accepted_path(Draft(tokens=[7, 8]), [7, 9]) == [0]
    assert accepted_path(Draft(tokens=[]), [7]) == []


@pytest.mark.parametrize("name", ["pld", "suffix", "cacheback"])
def test_replay_matches_a_real_run_step_for_step(tiny_target, name):
    config = GenerationConfig(max_new_tokens=40, ignore_eos=True, num_draft_tokens=4)
    plain = [
        t
        for chunk in speculative_decode(
            tiny_target.backend,
            create_drafter("none", tiny_target),
            PROMPT,
            GenerationConfig(max_new_tokens=40, ignore_eos=True),
        )
        for t in chunk
    ]
    outcome = DecodeOutcome()
    list(speculative_decode(tiny_target.backend, create_drafter(name, tiny_target), PROMPT, config, outcome=outcome))
    costs = StepCosts(one_input_s=0.01, curve=(1.0, 1.1, 1.2, 1.3, 1.4), draft_s=0.001)
    result = replay(create_drafter(name, tiny_target), FixedLength(4), PROMPT, plain, costs)
    stats = outcome.stats
    assert (result.tokens, result.steps, result.drafted, result.accepted) == (
        40,
        stats.steps,
        stats.drafted_tokens,
        stats.accepted_tokens,
    )
    assert result.accepted > 0
    assert result.plain_seconds == pytest.approx(40 * 0.01)
    assert result.seconds >= result.steps * 0.01


def test_step_costs_extrapolate_the_curve_linearly():
    costs = StepCosts(one_input_s=2.0, curve=(1.0, 1.5, 2.0))
    assert costs.verify_s(3) == 4.0
    assert costs.verify_s(5) == pytest.approx(6.0)
