"""No drafting: plain autoregressive decoding through the same engine — the baseline."""

from __future__ import annotations

from specdecode.drafters import register_drafter
from specdecode.drafters.base import Draft, Drafter


@register_drafter("none")
class NoDrafter(Drafter):
    def propose(self, context: list[int], max_tokens: int) -> Draft:
        return Draft(tokens=[])
