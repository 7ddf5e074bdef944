"""Stats that add up: every step yields the target's own token plus the draft tokens kept, so
``new_tokens == steps + accepted_tokens`` and ``mean_accepted_tokens == new_tokens / steps``, also when EOS or
the token limit cuts a step short (draft tokens accepted past the stop are not counted)."""

from __future__ import annotations

import json

from helpers import PROMPTS, hf_greedy
from specdecode.cli import main
from specdecode.config import GenerationConfig
from specdecode.drafters import create_drafter
from specdecode.engine import DecodeOutcome, speculative_decode

K = 4


def assert_adds_up(stats, tokens: list[int]) -> None:
    assert stats.new_tokens == len(tokens) == stats.steps + stats.accepted_tokens
    assert stats.mean_accepted_tokens == len(tokens) / stats.steps
    assert sum(stats.accepted_at) == stats.accepted_tokens <= stats.drafted_tokens


def test_tokens_accepted_past_eos_are_not_counted(tiny_target):
    """A draft equal to the target is accepted whole; EOS in the middle of the second draft ends the request."""
    plain = hf_greedy(tiny_target, PROMPTS[0], 2 * (K + 1))
    # Step 1 yields plain[0..K]; EOS at plain[eos_at] falls inside step 2's accepted draft plain[K+1..2K].
    eos_at = next(i for i in range(K + 2, 2 * K + 1) if plain[i] not in plain[:i])
    drafter = create_drafter("draft-model", tiny_target, draft_model=tiny_target)
    outcome = DecodeOutcome()
    config = GenerationConfig(max_new_tokens=64, num_draft_tokens=K)
    steps = speculative_decode(tiny_target.backend, drafter, PROMPTS[0], config, frozenset({plain[eos_at]}), outcome)
    tokens = [token for chunk in steps for token in chunk]
    assert tokens == plain[: eos_at + 1] and outcome.finish_reason == "eos"
    stats = outcome.stats
    # Step 2 accepted all K draft tokens, but only eos_at - K of the tokens it yielded were kept: the first
    # counts as the step's own token, the rest as accepted.
    assert stats.steps == 2 and stats.accepted_tokens == K + (eos_at - K - 1)
    assert_adds_up(stats, tokens)


def test_stats_add_up_at_the_token_limit_and_in_the_json(capsys, tiny_dirs):
    code = main(
        [
            "generate",
            "w1 w2 w3 w1 w2 w3 w1 w2",
            "--model",
            str(tiny_dirs["target"]),
            "--max-new-tokens",
            "11",
            "--num-draft-tokens",
            str(K),
            "--ignore-eos",
            "--json",
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    result = json.loads(out)
    stats = result["stats"]
    assert stats["new_tokens"] == len(result["token_ids"]) == 11 == stats["steps"] + stats["accepted_tokens"]
    assert stats["mean_accepted_tokens"] == round(11 / stats["steps"], 4)
