"""The ``suffix`` drafter (SuffixDecoding): its suffix trie against brute force, its trees, its bounded
cross-request memory, and greedy losslessness on tiny and real models."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import PROMPTS, hf_greedy, run, session_for
from specdecode.drafters import create_drafter
from specdecode.drafters.suffix import SuffixTrie
from specdecode.errors import SpecDecodeError
from specdecode.types import Draft, StepFeedback

texts = st.lists(st.integers(0, 3), max_size=40)  # a tiny alphabet: many repeats, many branches
depths = st.integers(2, 6)


def occurrences(texts: list[list[int]], pattern: list[int]) -> int:
    return sum(text[i : i + len(pattern)] == pattern for text in texts for i in range(len(text) - len(pattern) + 1))


def substrings(texts: list[list[int]], depth: int) -> set[tuple[int, ...]]:
    return {tuple(t[i:j]) for t in texts for i in range(len(t)) for j in range(i + 1, min(len(t), i + depth) + 1)}


def assert_trie_counts(trie: SuffixTrie, texts: list[list[int]]) -> None:
    present = substrings(texts, trie.depth)
    assert trie.size == len(present)
    for pattern in present | {p[:-1] + (p[-1] + 1,) for p in present}:
        node = trie.find(pattern)
        expected = occurrences(texts, list(pattern))
        assert (trie.count(node) if node is not None else 0) == expected, pattern


@settings(max_examples=60, deadline=None)
@given(st.lists(texts, min_size=1, max_size=4), depths, st.data())
def test_trie_counts_equal_brute_force_after_adds_and_removals(added, depth, data):
    trie = SuffixTrie(depth)
    for text in added:
        trie.add(text)
    assert_trie_counts(trie, added)
    removed = data.draw(st.sets(st.integers(0, len(added) - 1)))
    for i in sorted(removed):
        trie.remove(added[i])
    kept = [text for i, text in enumerate(added) if i not in removed]
    assert_trie_counts(trie, kept)
    for text in kept:  # freed nodes are reused correctly
        trie.add(text)
    assert_trie_counts(trie, kept + kept)


@settings(max_examples=60, deadline=None)
@given(st.lists(texts, min_size=1, max_size=3), texts, depths)
def test_active_lists_are_the_longest_occurring_suffixes(indexed, context, depth):
    trie = SuffixTrie(depth)
    for text in indexed:
        trie.add(text)
    followed: list[int] = []
    for end in range(1, len(context) + 1):
        followed = trie.follow(followed, context[end - 1])
        # Brute force: every suffix of context[:end] (up to depth tokens) that occurs in an indexed text.
        longest = max(
            (m for m in range(1, min(end, depth) + 1) if occurrences(indexed, context[end - m : end])), default=0
        )
        assert len(followed) == longest
        assert followed == [trie.find(context[end - m : end]) for m in range(1, longest + 1)]
    assert trie.walk(context) == followed

    own = SuffixTrie(depth)  # extend: the text's own suffixes, all present
    assert own.add(context) == [own.find(context[len(context) - m :]) for m in range(1, min(len(context), depth) + 1)]


@settings(max_examples=60, deadline=None)
@given(texts, st.lists(st.integers(0, 3), min_size=1, max_size=4), st.sampled_from([0.0, 0.2, 0.5]))
def test_continuations_are_the_frequencies_of_next_tokens(text, pattern, floor):
    trie = SuffixTrie(len(pattern) + 1)
    trie.add(text)
    node = trie.find(pattern)
    if node is None:
        return
    nexts = [text[i + len(pattern)] for i in range(len(text) - len(pattern)) if text[i : i + len(pattern)] == pattern]
    got = trie.continuations(node, floor)
    expected = {t: nexts.count(t) / len(nexts) for t in set(nexts) if nexts.count(t) / len(nexts) >= floor}
    assert {token: p for token, p, _ in got} == pytest.approx(expected)
    assert [p for _, p, _ in got] == sorted((p for _, p, _ in got), reverse=True)
    assert all(child == trie.find([*pattern, token]) for token, _, child in got)


def drafter(**options):
    return create_drafter("suffix", None, **options)


def started(prompt: list[int], **options):
    """A session of a fresh suffix drafter for ``prompt``."""
    return session_for(drafter(**options), prompt)


def test_proposes_what_followed_the_earlier_occurrence_deeper_for_longer_matches():
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 40, 41, 1, 2, 3, 4]
    draft = started(prompt, spec_factor=1).propose(prompt, 16)
    assert draft.tokens == [5, 6, 7, 8] and draft.is_chain  # a 4-token match: speculate 4 deep (spec_factor 1)
    assert started(prompt).propose(prompt, 16).tokens == [5, 6, 7, 8, 9, 40, 41, 1]  # 8 deep by default
    assert started(prompt, spec_factor=0.5).propose(prompt, 8).tokens == [5, 6]
    assert started(prompt).propose(prompt, 2).tokens == [5, 6]  # the engine's depth limit wins
    assert started([1, 2, 3]).propose([1, 2, 3], 5).tokens == []  # nothing occurred before


def test_tree_branches_by_frequency_with_distinct_siblings():
    # After "7 8": 9 three times, 5 once, 6 once.
    prompt = [7, 8, 9, 1, 7, 8, 9, 2, 7, 8, 5, 3, 7, 8, 9, 4, 7, 8, 6, 0, 7, 8]
    draft = started(prompt, spec_factor=2.0, min_prob=0.05).propose(prompt, 3)
    roots = [draft.tokens[i] for i, parent in enumerate(draft.parent_list) if parent == -1]
    assert roots[0] == 9 and sorted(roots) == [5, 6, 9]
    for node in range(-1, len(draft.tokens)):
        children = [draft.tokens[i] for i, parent in enumerate(draft.parent_list) if parent == node]
        assert len(children) == len(set(children))
    assert max(draft.depths()) <= 3 and len(draft.tokens) <= 16
    # A stricter threshold drops the rare branches.
    assert started(prompt, spec_factor=2.0, min_prob=0.5).propose(prompt, 3).parent_list.count(-1) == 1


def feed(suffix, prompt: list[int], output: list[int]) -> None:
    """One request without a model: the drafter sees the prompt, then the output arriving in steps, then
    the request finishes."""
    session = session_for(suffix, prompt)
    context = list(prompt)
    for i in range(0, len(output), 3):
        session.propose(context, 4)
        context += output[i : i + 3]
        session.observe(context, StepFeedback(draft=Draft(tokens=[]), path=(), target_logits=torch.empty(0)))
    session.finish(context)


def test_global_memory_stays_within_its_token_budget_oldest_evicted_first():
    suffix = drafter(global_tokens=300, tree_depth=8)
    outputs = [[(7 * r + i * i) % 50 for i in range(40 + r % 17)] for r in range(60)]
    for r, output in enumerate(outputs):
        feed(suffix, [r % 5], output)
        assert suffix.global_size <= 300
        assert suffix.global_trie.size <= 8 * 300
    remembered = list(suffix.global_outputs)
    assert remembered == outputs[-len(remembered) :] and sum(map(len, remembered)) <= 300
    fresh = SuffixTrie(8)
    for output in remembered:
        fresh.add(output)
    assert suffix.global_trie.size == fresh.size  # eviction freed every node of the evicted outputs
    suffix.reset()
    assert suffix.global_size == 0 and suffix.global_trie.size == 0


def test_earlier_outputs_are_proposed_in_later_requests():
    suffix = drafter()
    feed(suffix, [1, 2], [10, 11, 12, 13, 14, 15, 16, 17])
    assert session_for(suffix, [3, 4]).propose([3, 4, 10, 11, 12], 5).tokens == [13, 14, 15, 16, 17]
    forgetful = drafter(global_tokens=0)
    feed(forgetful, [1, 2], [10, 11, 12, 13, 14, 15, 16, 17])
    assert session_for(forgetful, [3, 4]).propose([3, 4, 10, 11, 12], 5).tokens == []


@pytest.mark.parametrize("options", [{}, {"max_nodes": 24, "min_prob": 0.02, "spec_factor": 3}, {"tree_depth": 3}])
def test_greedy_output_equals_plain_decoding(tiny_target, options):
    suffix = create_drafter("suffix", tiny_target, **options)  # one drafter across all requests
    for prompt in PROMPTS:
        expected = hf_greedy(tiny_target, prompt, 48)
        for k in (1, 4):
            for _ in range(2):  # the second time the global trie knows the output
                tokens, _ = run(tiny_target, suffix, prompt, max_new_tokens=48, num_draft_tokens=k)
                assert tokens == expected


@pytest.mark.parametrize(
    "options",
    [
        {"max_nodes": 0},
        {"tree_depth": 1},
        {"spec_factor": 0},
        {"spec_factor": "x"},
        {"min_prob": 0},
        {"min_prob": 1.5},
        {"global_tokens": -1},
        {"max_nodes": 2.5},
    ],
)
def test_bad_options_are_user_errors(options):
    with pytest.raises(SpecDecodeError, match="suffix option"):
        drafter(**options)


@pytest.mark.real_model
def test_deep_drafts_and_a_warm_session_stay_lossless_on_the_real_model(smollm2):
    """K = 16 (how the benchmark runs ``suffix``), and a session where the second request drafts from the
    first one's output: token for token what plain decoding gives."""
    from specdecode.generator import SpeculativeGenerator

    plain = SpeculativeGenerator.build(smollm2, "none")
    suffix = SpeculativeGenerator.build(smollm2, "suffix")
    source = "def area(w, h):\n    total = w * h\n    return total\n"
    requests = [
        f"Rename `w` to `width`.\n\n```python\n{source}```",
        f"Rename `w` to `width`. Add type hints.\n\n```python\n{source}```",
    ]
    for prompt in requests:
        expected = plain.generate(prompt, chat=True, max_new_tokens=32, ignore_eos=True).token_ids
        result = suffix.generate(prompt, chat=True, max_new_tokens=32, num_draft_tokens=16, ignore_eos=True)
        assert result.token_ids == expected
    assert result.stats.mean_accepted_tokens > 1.5
