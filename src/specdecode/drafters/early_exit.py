"""Early-exit self-drafting (DEL): the target's first L layers + its own head, with L and the draft length
chosen every step from acceptance measured online.

After Zarch et al. 2024, "DEL: Context-Aware Dynamic Exit Layer for Efficient Self-Speculative
Decoding".  For every candidate exit we keep a discounted count of accepted / examined draft tokens
(an estimate of the per-token acceptance α_L, starting from the exit's agreement with the full model,
measured on a built-in text: :mod:`~specdecode.drafters._calibration`) and pick the exit and
draft length k maximising expected tokens per unit cost,
``(1 + α + … + α^k) / (k · c_L + 1 + v · k)`` where ``c_L`` is a draft token's cost at exit L (see
:class:`~specdecode.drafters._self_draft.CostModel`) and ``v`` the extra cost of verifying a token.
An optimism bonus that shrinks with an exit's evidence keeps unexplored exits in play; k = 0 (plain
decoding) is chosen when no exit pays.  Drafting also stops at the first token whose probability is
below ``threshold``.  Statistics persist across requests (``reset`` forgets them).  Draft logits come
from the target's head restricted to ``draft_vocab`` frequent ids + the prompt's tokens (0: full head).

On SmolLM2-135M a plain exit is nearly useless below ~2/3 of the depth (top-1 agreement with the full
model 4-9% up to layer 18 of 30, 58% at layer 29), so the planner mostly chooses not to draft there;
drafts run on the target's own cache of the context, so not drafting costs nothing.
"""

from __future__ import annotations

import math
from functools import cached_property

from specdecode.config import DEFAULT_DRAFT_VOCAB
from specdecode.drafters import register_drafter
from specdecode.drafters._calibration import self_draft_agreement
from specdecode.drafters._self_draft import CostModel, SelfDraftSession, expected_tokens, require_layer_backend, tail
from specdecode.drafters._vocab import DraftHead, frequent_tokens
from specdecode.drafters.base import Drafter, DraftRequest, DraftSession
from specdecode.errors import SpecDecodeError
from specdecode.estimators import ShareWithPrior
from specdecode.models.loading import LoadedModel
from specdecode.types import Draft, StepFeedback

DEFAULT_EXIT_FRACTIONS = (0.2, 0.3, 0.4, 0.5)


def parse_exits(exits: str | int | None, num_layers: int) -> list[int]:
    """``"4,6,8"`` or one int → sorted exit layers; None → fractions of the depth."""
    if exits is None:
        layers = {min(num_layers - 1, max(1, round(f * num_layers))) for f in DEFAULT_EXIT_FRACTIONS}
        return sorted(layers) if num_layers > 1 else [1]
    try:
        layers = {int(part) for part in str(exits).split(",") if part.strip()}
    except ValueError as exc:
        raise SpecDecodeError(f"early-exit: exits must be comma-separated layer counts, got {exits!r}") from exc
    if not layers or any(not 1 <= layer <= num_layers for layer in layers):
        raise SpecDecodeError(f"early-exit: exit layers must be in 1..{num_layers}, got {exits!r}")
    return sorted(layers)


@register_drafter("early-exit")
class EarlyExitDrafter(Drafter):
    """Early exit (DEL): the target's first L layers draft; L and the draft length adapt per step."""

    provides_probs = True

    def __init__(
        self,
        target: LoadedModel,
        exits: str | int | None = None,
        threshold: float = 0.4,
        verify_token_cost: float = 0.15,
        explore: float = 0.3,
        discount: float = 0.98,
        prior_weight: float = 2.0,
        draft_vocab: int = DEFAULT_DRAFT_VOCAB,
    ) -> None:
        super().__init__(target)
        backend = require_layer_backend(target.backend, "early-exit")
        if not 0.0 <= threshold < 1.0:
            raise SpecDecodeError(f"early-exit: threshold must be in [0, 1), got {threshold!r}")
        self.exits = parse_exits(exits, backend.num_layers)
        self.skips = {layer: tail(layer, backend.num_layers) for layer in self.exits}
        self.threshold = threshold
        self.explore = explore
        self.discount = discount
        self.prior_weight = prior_weight
        self.costs = CostModel.of(backend, verify_token_cost)
        self.backend = backend
        self.head = DraftHead(backend, draft_vocab, frequent_tokens(target, draft_vocab))
        # Per exit layer, discounted evidence of its per-token acceptance; its prior is its share of the depth.
        self.stats: dict[int, ShareWithPrior] = {}
        self.steps = 0
        self.reset()

    def reset(self) -> None:
        self.stats = {layer: ShareWithPrior() for layer in self.exits}
        self.steps = 0

    @cached_property
    def exit_agreement(self) -> dict[int, float] | None:
        """Each exit's agreement with the full model on a built-in text, teacher-forced (once): the prior of its
        acceptance.  None where no text can be made: each exit's share of the depth stands in (on SmolLM2-135M
        that guessed 0.2-0.5 for exits that agree 0.01-0.06)."""
        shares = {e: self_draft_agreement(self.target, self.backend, self.head, self.skips[e]) for e in self.exits}
        return None if None in shares.values() else shares

    def prepare(self) -> bool:
        """Its exits' agreement, which its plan needs for any draft length."""
        self.exit_agreement  # noqa: B018 (measured once, cached)
        return True

    def exit_prior(self, layer: int) -> float:
        measured = self.exit_agreement
        return measured[layer] if measured is not None else layer / self.costs.num_layers

    @cached_property
    def measured_acceptance(self) -> float | None:
        """The best exit's measured agreement (what the planner starts from)."""
        measured = self.exit_agreement
        return max(measured.values()) if measured is not None else None

    def draft_token_share(self) -> float:
        """A token from the exit the planner would draft from now (its head and the layers below)."""
        return self.costs.draft_token(self.plan(1)[0])

    def session(self, request: DraftRequest) -> DraftSession:
        return EarlyExitSession(self, SelfDraftSession(self.backend, self.head, request))

    def plan(self, max_tokens: int) -> tuple[int, int]:
        """(exit layer, draft length) with the best optimistic expected tokens per cost; length 0 = no draft."""
        best, best_rate = (self.exits[0], 0), 1.0  # plain decoding: one token per unit cost
        for layer, stats in self.stats.items():
            bonus = self.explore * math.sqrt(math.log(self.steps + 2) / (stats.trials + 1))
            alpha = min(0.99, stats.estimate(self.exit_prior(layer), self.prior_weight) + bonus)
            per_token = self.costs.draft_token(layer)
            for k in range(1, max_tokens + 1):
                rate = expected_tokens(alpha, k) / self.costs.step(k, per_token)
                if rate > best_rate:
                    best, best_rate = (layer, k), rate
        return best

    def record(self, layer: int, feedback: StepFeedback) -> None:
        drafted = len(feedback.draft.tokens)
        if drafted:
            accepted = feedback.num_accepted
            self.stats[layer].add(accepted, min(drafted, accepted + 1), self.discount)


class EarlyExitSession(DraftSession):
    def __init__(self, drafter: EarlyExitDrafter, state: SelfDraftSession) -> None:
        self.drafter = drafter
        self.state = state
        self.used: int | None = None  # the exit of this step's draft

    def propose(self, context: list[int], max_tokens: int) -> Draft:
        drafter = self.drafter
        drafter.steps += 1
        layer, k = drafter.plan(max_tokens)
        self.used = layer if k else None
        if not k:
            return Draft(tokens=[])
        return self.state.draft(context, k, self.state.skipping(drafter.skips[layer]), drafter.threshold)

    def observe(self, context: list[int], feedback: StepFeedback) -> None:
        if self.used is not None and feedback.asked:
            self.drafter.record(self.used, feedback)

    def finish(self, context: list[int]) -> None:
        self.state.finish()
