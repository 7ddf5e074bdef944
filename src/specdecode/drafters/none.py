"""No drafting: plain autoregressive decoding through the same engine — the baseline."""

from __future__ import annotations

from specdecode.drafters import register_drafter
from specdecode.drafters.base import Drafter, DraftRequest, DraftSession, StatelessSession
from specdecode.types import Draft


@register_drafter("none")
class NoDrafter(Drafter):
    drafts = False

    def session(self, request: DraftRequest) -> DraftSession:
        return StatelessSession(lambda context, max_tokens: Draft(tokens=[]))
