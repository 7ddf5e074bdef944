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


def lookup_continuation(context: list[int] | np.ndarray, ngram: int, max_tokens: int) -> tuple[list[int], int]:
    """Tokens that followed the most recent earlier occurrence of the last ``ngram`` tokens, and how many
    earlier occurrences there are (0: no match)."""
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
    begin = int(starts[-1]) + ngram
    return tokens[begin : begin + max_tokens].tolist(), len(starts)


def match_confidence(ngram: int, occurrences: int) -> float:
    """How likely each copied token is to be accepted, by the kind of match (the engine calibrates these
    online; they only order the kinds and start the calibration where it was measured).  Over the quick
    prompts on ``smollm2-135m`` (offline replay, 8 sequences), tokens copied after a unique earlier
    occurrence of the last 3 tokens were accepted at 81%, after one of several at 56%, after 2 tokens at
    about 23%, after 1 token at 16%."""
    if ngram >= 3:
        return 0.85 if occurrences == 1 else 0.55
    return 0.25 if ngram == 2 else 0.15


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
        tokens = np.asarray(context, dtype=np.int64)
        for ngram in self.ngram_sizes:
            continuation, occurrences = lookup_continuation(tokens, ngram, max_tokens)
            if continuation:
                confidence = match_confidence(ngram, occurrences)
                return Draft(tokens=continuation, confidence=[confidence] * len(continuation))
        return Draft(tokens=[])
