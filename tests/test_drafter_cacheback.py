"""The ``cacheback`` drafter: its LRU n-gram tables against a reference model, its chained trees, its
bounded cross-request memory, and greedy losslessness on tiny and real models."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import PROMPTS, hf_greedy, run, session_for
from specdecode.drafters import create_drafter
from specdecode.drafters.cacheback import NgramCache
from specdecode.errors import SpecDecodeError


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 5), st.integers(0, 3)), max_size=60),
    st.integers(1, 4),
    st.integers(1, 3),
)
def test_lru_table_matches_a_reference_model(records, capacity, width):
    """Reference: leaders in order of last use, each with its followers in order of last use."""
    cache = NgramCache(1, width, capacity)
    order: list[int] = []  # leaders, least recently used first
    seen: dict[int, list[int]] = {}  # leader -> every follower, most recent first
    for leader, token in records:
        cache.record((leader,), token)
        if leader in order:
            order.remove(leader)
        else:
            seen[leader] = []
        order.append(leader)
        seen[leader] = [token, *(f for f in seen[leader] if f != token)]
        if len(order) > capacity:
            del seen[order.pop(0)]
    assert list(cache.table) == [(leader,) for leader in order]
    for leader in order:
        assert cache.followers((leader,)) == tuple(seen[leader][:width])


def started(prompt: list[int], **options):
    """A session of a fresh cacheback drafter for ``prompt``."""
    return session_for(create_drafter("cacheback", None, **options), prompt)


def test_chains_lookups_past_the_end_of_any_single_earlier_occurrence():
    # "1 2 -> 3", "2 3 -> 4", "3 4 -> 5" were seen in separate places; chaining them drafts 3 4 5.
    prompt = [1, 2, 3, 9, 2, 3, 4, 8, 3, 4, 5, 7, 1, 2]
    assert started(prompt).propose(prompt, 5).tokens[:3] == [3, 4, 5]
    shallow = started(prompt).propose(prompt, 2)  # the engine's depth limit wins
    assert shallow.tokens[:2] == [3, 4] and max(shallow.depths()) == 2


def test_recent_followers_first_distinct_siblings_and_one_token_fallback():
    prompt = [5, 6, 1, 5, 6, 2, 5, 6, 1, 0, 5, 6]  # after "5 6": 1 (most recent), then 2
    draft = started(prompt, min_prob=0.05).propose(prompt, 1)
    assert draft.tokens == [1, 2] and draft.parents == [-1, -1]
    assert started(prompt, followers=1).propose(prompt, 1).tokens == [1]
    # The leader "0 6" was never seen: the one-token table answers for "6".
    assert started(prompt, min_prob=0.05).propose([*prompt[:-2], 0, 6], 1).tokens == [1, 2]
    assert started([4, 4]).propose([7], 3).tokens == []  # nothing known about 7


def test_tables_stay_within_max_entries():
    cacheback = create_drafter("cacheback", None, max_entries=50, followers=2)
    for r in range(40):
        prompt = [(r * 31 + i * i) % 90 for i in range(200)]
        session_for(cacheback, prompt).propose(prompt, 4)
        assert all(len(table.table) <= 50 for table in cacheback.tables)
        assert all(len(f) <= 2 for table in cacheback.tables for f in table.table.values())
    cacheback.reset()
    assert all(not table.table for table in cacheback.tables)


@pytest.mark.parametrize(
    "options", [{}, {"leader": 1}, {"leader": 3, "followers": 5, "max_nodes": 20, "min_prob": 0.02}]
)
def test_greedy_output_equals_plain_decoding(tiny_target, options):
    cacheback = create_drafter("cacheback", tiny_target, **options)  # one drafter across all requests
    for prompt in PROMPTS:
        expected = hf_greedy(tiny_target, prompt, 48)
        for k in (1, 4):
            for _ in range(2):  # the second time the tables know the output
                tokens, _ = run(tiny_target, cacheback, prompt, max_new_tokens=48, num_draft_tokens=k)
                assert tokens == expected


@pytest.mark.parametrize(
    "options",
    [
        {"leader": 0},
        {"followers": 0},
        {"max_entries": 0},
        {"max_nodes": True},
        {"min_prob": 0},
        {"min_prob": "a"},
    ],
)
def test_bad_options_are_user_errors(options):
    with pytest.raises(SpecDecodeError, match="cacheback option"):
        create_drafter("cacheback", None, **options)
