"""Prompt lookup decoding: copy what followed the latest earlier occurrence of the current suffix.

Input-grounded outputs (summaries, edits, answers quoting a document) repeat long spans of the
prompt; matching the last n tokens against everything seen so far finds them for free.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from specdecode.drafters import register_drafter
from specdecode.drafters.base import Drafter, DraftRequest, DraftSession, StatelessSession
from specdecode.errors import SpecDecodeError
from specdecode.models.loading import LoadedModel
from specdecode.types import Draft


def lookup_continuation(context: list[int] | np.ndarray, ngram: int, max_tokens: int) -> list[int]:
    """Tokens that followed the most recent earlier occurrence of the last ``ngram`` tokens."""
    tokens = np.asarray(context, dtype=np.int64)
    if max_tokens <= 0 or len(tokens) <= ngram:
        return []
    pattern = tokens[-ngram:]
    # Windows over tokens[:-1] start at most at len-1-ngram, so the suffix never matches itself and
    # every match is followed by at least one token.
    windows = sliding_window_view(tokens[:-1], ngram)
    starts = np.flatnonzero((windows == pattern).all(axis=1))
    if len(starts) == 0:
        return []
    begin = int(starts[-1]) + ngram
    return tokens[begin : begin + max_tokens].tolist()


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
        return StatelessSession(self.propose)

    def propose(self, context: list[int], max_tokens: int) -> Draft:
        tokens = np.asarray(context, dtype=np.int64)
        for ngram in self.ngram_sizes:
            continuation = lookup_continuation(tokens, ngram, max_tokens)
            if continuation:
                return Draft(tokens=continuation)
        return Draft(tokens=[])
