"""What a draft model's catching up with the context costs, so that the draft-length policy can tell it apart
from drafting (``Draft.setup_s``): a draft model feeds the prompt, and the tokens it skipped while drafting was
off, in the same forward as its first draft token."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass
class ForwardClock:
    """The seconds of a one-token draft forward, learnt across a drafter's requests: what a forward that also
    catches up with the context (the prompt, tokens skipped while drafting was off) costs beyond drafting."""

    one_token_s: float = 0.0

    def timed(self, forward: Callable[[], T], tokens: int) -> tuple[T, float]:
        """Run ``forward`` (a draft forward of ``tokens`` new tokens) → (its result, the seconds it spent catching up
        with the context beyond one token's forward); a one-token forward teaches the clock instead."""
        tick = time.perf_counter()
        result = forward()
        elapsed = time.perf_counter() - tick
        if tokens > 1:
            return result, self.setup_part(elapsed, tokens)
        self.add(elapsed)
        return result, 0.0

    def add(self, seconds: float) -> None:
        self.one_token_s = seconds if not self.one_token_s else 0.9 * self.one_token_s + 0.1 * seconds

    def setup_part(self, seconds: float, tokens: int) -> float:
        """Of a forward of ``tokens`` that took ``seconds``, the part beyond producing one draft token (before any
        one-token forward was timed: all but that token's share)."""
        if self.one_token_s:
            return max(0.0, seconds - self.one_token_s)
        return seconds * (tokens - 1) / tokens
