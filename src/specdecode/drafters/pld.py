"""Prompt lookup decoding: copy what followed the latest earlier occurrence of the current suffix.

Input-grounded outputs (summaries, edits, answers quoting a document) repeat long spans of the
prompt; matching the last n tokens against everything seen so far finds them for free.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from specdecode.drafters import register_drafter
from specdecode.drafters.base import Drafter, DraftRequest, DraftSession, StatelessSession
from specdecode.errors import SpecDecodeError
from specdecode.types import Draft

if TYPE_CHECKING:
    from specdecode.models.loading import LoadedModel

#: How far back a match is followed when choosing among occurrences and judging it.
MAX_MATCH = 16


def lookup_continuation(context: list[int] | np.ndarray, ngram: int, max_tokens: int) -> tuple[list[int], int]:
    """Tokens that followed the earlier occurrence of the last ``ngram`` tokens whose match extends furthest
    back (up to ``MAX_MATCH`` tokens; the most recent among equals), and how long that match is (0: none).

    A match that goes on for 8 tokens before the n-gram is a copy in progress; one of exactly the n-gram
    is as often a coincidence, so the longer one is both the better source and the surer draft."""
    tokens = np.asarray(context, dtype=np.int64)
    if max_tokens <= 0 or len(tokens) <= ngram:
        return [], 0
    pattern = tokens[-ngram:]
    # Windows over tokens[:-1] start at most at len-1-ngram, so the suffix never matches itself and
    # every match is followed by at least one token.
    windows = sliding_window_view(tokens[:-1], ngram)
    starts = np.flatnonzero((windows == pattern).all(axis=1))
    if len(starts) == 0:
        return [], 0
    lengths = np.full(len(starts), ngram)
    alive = np.ones(len(starts), dtype=bool)
    for back in range(1, MAX_MATCH - ngram + 1):
        before = starts - back
        alive &= before >= 0
        # Every occurrence starts before the suffix does: while one can still go back, so can the suffix.
        if not alive.any():
            break
        alive &= tokens[np.maximum(before, 0)] == tokens[len(tokens) - ngram - back]
        lengths += alive
    best = int(np.flatnonzero(lengths == lengths.max())[-1])
    begin = int(starts[best]) + ngram
    return tokens[begin : begin + max_tokens].tolist(), int(lengths[best])


def match_confidence(match_length: int) -> float:
    """How likely each copied token is to be accepted, by how long the match is (the engine calibrates these
    online; they only tell the kinds apart and start the calibration near where it was measured).  Over the
    quick prompts on ``smollm2-135m`` (offline replay, 8 sequences), the first copied token was accepted
    after 92-100% of matches of 6 tokens or more, 50-60% of matches of 3-4, about 40% of 2 and rarely after
    1; over whole drafts, tokens after 1- and 2-token matches were accepted at 16% and 23%.  See
    ``docs/results/quick-pld-match-length``."""
    if match_length >= 8:
        return 0.95
    if match_length >= 5:
        return 0.85
    if match_length >= 3:
        return 0.55
    return 0.3 if match_length == 2 else 0.15


def prompt_lookup(
    context: list[int] | np.ndarray, max_tokens: int, ngram_sizes: Sequence[int] = (3, 2, 1)
) -> tuple[list[int], float]:
    """Prompt lookup's draft: the continuation of the longest n-gram (``ngram_sizes``, tried in order) that
    occurred before, and the confidence in each of its tokens ([] and 0.0: no match)."""
    tokens = np.asarray(context, dtype=np.int64)
    for ngram in ngram_sizes:
        continuation, match_length = lookup_continuation(tokens, ngram, max_tokens)
        if continuation:
            return continuation, match_confidence(match_length)
    return [], 0.0


@register_drafter("pld")
class PromptLookupDrafter(Drafter):
    """Prompt lookup: copies what followed the last n tokens earlier in prompt + output (min_ngram..max_ngram).

    Tries n-gram sizes from ``max_ngram`` down to ``min_ngram``; longer matches are more reliable."""

    def __init__(self, target: LoadedModel, min_ngram: int = 1, max_ngram: int = 3) -> None:
        super().__init__(target)
        if not (isinstance(min_ngram, int) and isinstance(max_ngram, int) and 1 <= min_ngram <= max_ngram):
            raise SpecDecodeError(
                f"pld n-gram sizes must satisfy 1 <= min <= max, got min={min_ngram!r}, max={max_ngram!r}"
            )
        self.ngram_sizes = range(max_ngram, min_ngram - 1, -1)

    def session(self, request: DraftRequest) -> DraftSession:
        return StatelessSession(self.propose, proposes_first=True)

    def propose(self, context: list[int], max_tokens: int) -> Draft:
        continuation, confidence = prompt_lookup(context, max_tokens, self.ngram_sizes)
        return Draft(tokens=continuation, confidence=[confidence] * len(continuation))
