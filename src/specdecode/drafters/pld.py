"""Prompt lookup decoding: copy what followed the latest earlier occurrence of the current suffix.

Input-grounded outputs (summaries, edits, answers quoting a document) repeat long spans of the
prompt; matching the last n tokens against everything seen so far finds them for free.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from specdecode.drafters import register_drafter
from specdecode.drafters.base import Drafter, DraftRequest, DraftSession, StatelessSession
from specdecode.errors import SpecDecodeError
from specdecode.types import Draft

if TYPE_CHECKING:
    from specdecode.models.loading import LoadedModel

#: How far back a match is followed when choosing among occurrences and judging it.
MAX_MATCH = 16
#: Occurrences of the last token beyond which a match is searched with numpy (a list's search, a few hundred
#: nanoseconds an occurrence, beats converting the context to an array for the few a chat's last token has).
MANY_OCCURRENCES = 64


def longest_match(tokens: list[int], shortest: int = 1) -> tuple[int, int]:
    """The earlier occurrence of the context's last tokens that matches furthest back: the position where it ends
    (it is followed by at least one token) and how many tokens it matches (up to ``MAX_MATCH``; the most recent
    among equals), or (-1, 0) where none matches ``shortest`` tokens or more.

    A match that goes on for 8 tokens is a copy in progress; one of a single token is as often a coincidence, so
    the longer one is both the better source and the surer draft.  Each occurrence of the last token is followed
    back once: Python's ``list.index`` finds them, and a context whose last token occurs more than
    ``MANY_OCCURRENCES`` times (a long one) is matched with numpy instead, each way with the same result."""
    last, stop = tokens[-1], len(tokens) - 1
    if tokens.count(last) > MANY_OCCURRENCES:
        return _longest_match_vectorised(np.asarray(tokens, dtype=np.int64), shortest)
    best_end, best_length, end = -1, 0, -1
    while True:
        try:
            end = tokens.index(last, end + 1, stop)
        except ValueError:
            break
        length = 1
        while length < MAX_MATCH and length <= end and tokens[end - length] == tokens[stop - length]:
            length += 1
        if length >= best_length:
            best_end, best_length = end, length
    return (best_end, best_length) if best_length >= shortest else (-1, 0)


def _longest_match_vectorised(tokens: np.ndarray, shortest: int) -> tuple[int, int]:
    """:func:`longest_match` of a numpy context: every occurrence followed back together, a token at a time."""
    stop = len(tokens) - 1
    ends = np.flatnonzero(tokens[:stop] == tokens[stop])
    lengths = np.ones(len(ends), dtype=np.int64)
    alive = np.ones(len(ends), dtype=bool)
    for back in range(1, MAX_MATCH):
        alive &= ends >= back
        if not alive.any():
            break
        alive &= tokens[np.maximum(ends - back, 0)] == tokens[stop - back]
        lengths += alive
    if len(ends) == 0 or lengths.max() < shortest:
        return -1, 0
    best = int(np.flatnonzero(lengths == lengths.max())[-1])
    return int(ends[best]), int(lengths[best])


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
    context: Sequence[int] | np.ndarray, max_tokens: int, ngram_sizes: Sequence[int] = (3, 2, 1)
) -> tuple[list[int], float]:
    """Prompt lookup's draft: what followed the earlier occurrence of the context's last n tokens (n one of
    ``ngram_sizes``) that matches furthest back (:func:`longest_match`), and the confidence in each of its tokens
    ([] and 0.0: no match).  Every occurrence of a longer n-gram is one of each shorter one, so the furthest match
    over the sizes is the one a search of the longest size first, then shorter ones, finds."""
    tokens = context if isinstance(context, list) else np.asarray(context).tolist()
    if max_tokens <= 0 or not tokens or not ngram_sizes:
        return [], 0.0
    end, match_length = longest_match(tokens, min(ngram_sizes))
    if end < 0:
        return [], 0.0
    return tokens[end + 1 : end + 1 + max_tokens], match_confidence(match_length)


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
