"""What a draft model's catching up with the context costs, so that the draft-length policy can tell it apart
from drafting (``Draft.setup_s``): a draft model feeds the prompt, and the tokens it skipped while drafting was
off, in the same forward as its first draft token."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ForwardClock:
    """The seconds of a one-token draft forward, learnt across a drafter's requests: what a forward that also
    catches up with the context (the prompt, tokens skipped while drafting was off) costs beyond drafting."""

    one_token_s: float = 0.0

    def add(self, seconds: float) -> None:
        self.one_token_s = seconds if not self.one_token_s else 0.9 * self.one_token_s + 0.1 * seconds

    def setup_part(self, seconds: float, tokens: int) -> float:
        """Of a forward of ``tokens`` that took ``seconds``, the part beyond producing one draft token (before any
        one-token forward was timed: all but that token's share)."""
        if self.one_token_s:
            return max(0.0, seconds - self.one_token_s)
        return seconds * (tokens - 1) / tokens
