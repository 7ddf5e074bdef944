"""How far to draft each step.

A fixed K is wrong whenever costs or acceptance vary: on a CPU a verification forward over 8 tokens
costs 2-3x one token, so drafting deep only pays while the drafter is being accepted.  Policies:

* ``FixedLength(k)`` — always k (the classic setting);
* ``HeuristicLength`` — transformers' assisted-generation schedule: +2 after a fully accepted draft,
  -1 otherwise;
* ``CostModelLength`` (``--num-draft-tokens auto``) — picks the depth that maximises expected tokens
  per second, from the verification forward's cost as a function of its width (measured once per
  model), online estimates of per-position acceptance and of the drafter's own cost; drafters that
  report per-token confidences get a SpecDec++-style stop threshold derived from the same costs; and a
  sequence whose drafting has lost more than a small budget against plain decoding stops trying.
"""

from __future__ import annotations

from collections.abc import Sequence

from specdecode.draft_length.base import DraftLengthPolicy, FixedLength, HeuristicLength
from specdecode.draft_length.cost_model import (
    ANSWER_HORIZON,
    LOSS_ALLOWANCE_STEPS,
    LOSS_BUDGET,
    UNTIMED_DEPTH,
    UNTIMED_STEPS,
    CostModelLength,
)
from specdecode.errors import SpecDecodeError
from specdecode.estimators import RunningMean
from specdecode.types import StepObservation

__all__ = [
    "ANSWER_HORIZON",
    "LOSS_ALLOWANCE_STEPS",
    "LOSS_BUDGET",
    "UNTIMED_DEPTH",
    "UNTIMED_STEPS",
    "CostModelLength",
    "DraftLengthPolicy",
    "FixedLength",
    "HeuristicLength",
    "StepObservation",
    "make_policy",
]


def make_policy(
    spec: int | str,
    curve: Sequence[float] | None = None,
    reads_context: bool = False,
    context_cost: float | None = None,
    draft_token_s: float | None = None,
    prior_acceptance: float | None = None,
    draft_token_share: float | None = None,
) -> DraftLengthPolicy:
    """``--num-draft-tokens``: an integer K, ``auto`` (cost model) or ``heuristic`` (transformers').

    ``curve``: measured verification cost per width (1, 2, ...) for ``auto``; a linear guess without it.
    ``reads_context``: the drafter runs a model of its own (``Drafter.reads_context``), so ``auto`` drafts it
    shallow from its very first step until its cost is timed (see ``UNTIMED_DEPTH``); ``context_cost``: its
    reading of a prompt against the target's prefill (``Drafter.reading_cost``), so ``auto`` prices each reading;
    ``draft_token_s``: the seconds of one of its draft tokens (``Drafter.draft_token_seconds``), the price of a draft
    token in that reckoning until the policy has timed its own; ``prior_acceptance``: the share of its tokens expected
    to be accepted before any is verified (``Drafter.acceptance_prior``; None: the policy's default);
    ``draft_token_share``: a draft token's cost in one-token target forwards where known by construction
    (``Drafter.draft_token_share``), its price until timed."""
    if isinstance(spec, int) and not isinstance(spec, bool):
        if spec < 0:
            raise SpecDecodeError(f"num-draft-tokens must be an integer >= 0, 'auto' or 'heuristic', got {spec!r}")
        return FixedLength(spec)
    if spec == "auto":
        shape = {"curve": tuple(curve)} if curve else {}
        reading = RunningMean(context_cost) if context_cost else None
        prior = {"prior_acceptance": prior_acceptance} if prior_acceptance is not None else {}
        return CostModelLength(
            **shape,
            **prior,
            reads_context=reads_context,
            context_cost=reading,
            draft_token_s=draft_token_s,
            draft_token_share=draft_token_share,
        )
    if spec == "heuristic":
        return HeuristicLength()
    raise SpecDecodeError(f"num-draft-tokens must be an integer >= 0, 'auto' or 'heuristic', got {spec!r}")
