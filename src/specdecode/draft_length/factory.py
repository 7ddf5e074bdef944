"""The one place a :data:`~specdecode.config.DraftLength` becomes a policy (:func:`make_policy`), from
what is known of the drafter and the target (:class:`DrafterCosts`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from specdecode.config import AUTO, Auto, DraftLength, Fixed, Heuristic
from specdecode.draft_length.base import FixedLength, HeuristicLength, PolicySource
from specdecode.draft_length.cost_model import CostModel
from specdecode.estimators import RunningMean
from specdecode.models.cost import VerificationCosts, verification_costs

if TYPE_CHECKING:
    from specdecode.models.base import CausalLM


class DeclaresCosts(Protocol):
    """What ``auto`` asks a drafter before it drafts (each :class:`~specdecode.drafters.base.Drafter` answers)."""

    drafts: bool
    reads_context: bool

    def reading_cost(self) -> float | None: ...

    def draft_token_seconds(self) -> float | None: ...

    def acceptance_prior(self) -> float | None: ...

    def draft_token_share(self) -> float | None: ...


@dataclass(frozen=True)
class DrafterCosts:
    """What ``auto`` prices drafting with before it has timed anything (only ``auto`` reads them but ``curve``).

    ``curve``: measured verification cost per width (1, 2, ...), by context where measured on the target
    (:class:`~specdecode.models.cost.VerificationCosts`); a linear guess without it.  A fixed draft length keeps it
    to measure the curves of long contexts as ``auto`` does (:class:`~specdecode.draft_length.base.FixedLength`).
    ``reads_context``: the drafter runs a model of its own (``Drafter.reads_context``), so ``auto`` drafts it
    shallow from its very first step until its cost is timed (see ``UNTIMED_DEPTH``); ``context_cost``: its
    reading of a prompt against the target's prefill (``Drafter.reading_cost``), so ``auto`` prices each reading;
    ``draft_token_s``: the seconds of one of its draft tokens (``Drafter.draft_token_seconds``), the price of a draft
    token in that reckoning until the policy has timed its own; ``prior_acceptance``: the share of its tokens
    expected to be accepted before any is verified (``Drafter.acceptance_prior``; None: the policy's default);
    ``draft_token_share``: a draft token's cost in one-token target forwards where known by construction
    (``Drafter.draft_token_share``), its price until timed."""

    curve: VerificationCosts | Sequence[float] | None = None
    reads_context: bool = False
    context_cost: float | None = None
    draft_token_s: float | None = None
    prior_acceptance: float | None = None
    draft_token_share: float | None = None

    @classmethod
    def measure(cls, drafter: DeclaresCosts, target: CausalLM) -> DrafterCosts:
        """Ask ``drafter`` and ``target`` (each measures once and keeps the result: a loaded model's cost curve
        survives ``reset_drafter``); a drafter that never drafts needs no cost curve."""
        return cls(
            curve=verification_costs(target) if drafter.drafts else None,
            reads_context=drafter.reads_context,
            context_cost=drafter.reading_cost(),
            draft_token_s=drafter.draft_token_seconds(),
            prior_acceptance=drafter.acceptance_prior(),
            draft_token_share=drafter.draft_token_share(),
        )


def make_policy(length: DraftLength, costs: DrafterCosts = DrafterCosts()) -> PolicySource:
    """The policy requests drafting ``length`` decode with (each sequence with a fork of it)."""
    measured = costs.curve if isinstance(costs.curve, VerificationCosts) else None
    match length:
        case Fixed(k):
            return FixedLength(k, measured)  # a bare curve is a guess for auto's pricing only
        case Heuristic():
            return HeuristicLength()
        case Auto():
            curve = measured
            if curve is None and costs.curve:  # a bare curve: the same costs at every context
                curve = VerificationCosts.of(costs.curve)
            return CostModel(
                **({"curve": curve} if curve is not None else {}),
                **({"prior_acceptance": costs.prior_acceptance} if costs.prior_acceptance is not None else {}),
                reads_context=costs.reads_context,
                context_cost=RunningMean(costs.context_cost) if costs.context_cost else None,
                draft_token_s=costs.draft_token_s,
                draft_token_share=costs.draft_token_share,
            )
    raise TypeError(f"not a draft length: {length!r}")


def measured_policy(length: DraftLength, drafter: DeclaresCosts, target: CausalLM) -> PolicySource:
    """:func:`make_policy` for requests that ``drafter`` drafts for on ``target``, measured where ``length`` needs."""
    if length == AUTO:
        return make_policy(length, DrafterCosts.measure(drafter, target))
    if isinstance(length, Fixed) and length.k > 0 and drafter.drafts:  # for the trees sized by cost
        return make_policy(length, DrafterCosts(curve=verification_costs(target)))
    return make_policy(length)
