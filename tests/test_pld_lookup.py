"""Prompt lookup's match: the earlier occurrence of the context's last tokens that matches furthest back (the most
recent among equals), checked against a search written out the slow way, through the list search and the
numpy one alike."""

from __future__ import annotations

import random

import numpy as np
import pytest

from specdecode.drafters import pld
from specdecode.drafters.pld import MAX_MATCH, match_confidence, prompt_lookup


def reference_lookup(context: list[int], max_tokens: int, ngram_sizes) -> tuple[list[int], float]:
    """For each n-gram size in order: every earlier occurrence of the last n tokens followed by a token, its match
    followed back up to MAX_MATCH tokens; the furthest, the latest among equals."""
    for ngram in ngram_sizes:
        if max_tokens <= 0 or len(context) <= ngram:
            continue
        best = None
        for end in range(ngram - 1, len(context) - 1):
            length = 0
            while length < MAX_MATCH and length <= end and context[end - length] == context[-1 - length]:
                length += 1
            if length >= ngram and (best is None or length >= best[1]):
                best = (end, length)
        if best is not None:
            return context[best[0] + 1 : best[0] + 1 + max_tokens], match_confidence(best[1])
    return [], 0.0


def contexts(seed: int, count: int):
    draw = random.Random(seed)
    for _ in range(count):
        vocab = draw.choice((2, 3, 5, 20))
        context = [draw.randrange(vocab) for _ in range(draw.randrange(1, 60))]
        if draw.random() < 0.3 and len(context) > 4:  # a copy in progress
            start = draw.randrange(len(context) - 2)
            context += context[start : start + draw.randrange(1, 30)]
        yield context, draw.randrange(0, 8), draw.choice(((3, 2, 1), (1,), (2,), (3, 2), (4, 3, 2, 1)))


@pytest.mark.parametrize("vectorised", [False, True])
def test_the_lookup_is_the_furthest_latest_match(monkeypatch, vectorised):
    if vectorised:
        monkeypatch.setattr(pld, "MANY_OCCURRENCES", 0)
    for context, max_tokens, sizes in contexts(seed=int(vectorised), count=3000):
        expected = reference_lookup(context, max_tokens, sizes)
        assert prompt_lookup(context, max_tokens, sizes) == expected, (context, max_tokens, sizes)
        assert prompt_lookup(np.array(context), max_tokens, sizes) == expected


def test_a_match_beyond_max_match_counts_as_max_match_and_the_latest_wins():
    block = list(range(40))
    context = [*block, 99, *block, 98, *block[:30]]  # two occurrences match 30 tokens back: both count MAX_MATCH
    assert prompt_lookup(context, 3) == ([30, 31, 32], match_confidence(MAX_MATCH))
    context = [5, 6, 7, 1, 5, 6, 7, 2, 5, 6, 7]
    assert prompt_lookup(context, 1) == ([2], match_confidence(3))
