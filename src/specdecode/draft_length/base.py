"""The draft-length policy interface, and the two policies that need no cost model: a fixed K and
transformers' heuristic schedule."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol

from specdecode.types import StepObservation

if TYPE_CHECKING:
    from specdecode.models.cost import VerificationCosts


class PolicySource(Protocol):
    """What a generator keeps for one draft length and drafter across requests: each request's sequence
    decodes with a :meth:`fork` of it (a stateless policy is its own fork)."""

    def fork(self) -> DraftLengthPolicy:
        """The policy for one more sequence."""


@dataclass(frozen=True)
class DepthOffer:
    """What drafting 0, 1, ... ``cap`` deep would bring one sequence of a batched step, for :func:`plan_batch
    <specdecode.batch_plan.plan_batch>` to weigh against the other sequences' offers."""

    tokens: list[float]  # expected tokens of the step at each depth, the target's own included
    draft_s: list[float]  # seconds of drafting still to spend at each depth (none for a draft already made)
    overhead_s: float  # the rest of the sequence's step, the same at every depth
    #: Expected seconds of the shared forward over this many inputs after a context this long.
    verify_seconds: Callable[[int, int], float]
    context_tokens: int = 0  # this sequence's context

    @property
    def cap(self) -> int:
        return len(self.tokens) - 1


class DraftLengthPolicy(ABC):
    """How deep one sequence drafts."""

    #: Whether a batched step chooses this sequence's depth together with the other sequences whose policies do
    #: (:meth:`depth_offer`, :meth:`take_depth`); otherwise the policy chooses alone (:meth:`depth_alone`) and its
    #: width is fixed before the others are planned.
    plans_with_batch: ClassVar[bool] = False

    def fork(self) -> DraftLengthPolicy:
        """The policy for one more sequence (stateless policies are their own fork)."""
        return self

    @abstractmethod
    def next_length(self, limit: int) -> int:
        """Depth to request from the drafter this step, at most ``limit``."""

    def depth_alone(self, limit: int, proposed: Sequence[float] | None) -> int:
        """Depth for this step when the policy chooses alone; ``proposed``: the confidences of a chain already
        drafted before the plan (None: no such draft)."""
        return self.next_length(limit)

    def depth_offer(self, limit: int, proposed: Sequence[float] | None) -> DepthOffer:
        """What each depth would bring this sequence (asked only where :attr:`plans_with_batch`)."""
        raise NotImplementedError(f"{type(self).__name__} chooses its depth alone")

    def take_depth(self, offer: DepthOffer, depth: int, limit: int, proposed: Sequence[float] | None) -> int:
        """The depth to ask for once the batch's plan gave this sequence ``depth`` of its ``offer``."""
        raise NotImplementedError(f"{type(self).__name__} chooses its depth alone")

    def begin(self, prefill_s: float, context_tokens: int = 0) -> None:  # noqa: B027
        """The target has read this sequence's prompt (``context_tokens`` long), in ``prefill_s`` seconds.  Default:
        nothing to learn."""

    def observe(self, step: StepObservation) -> None:  # noqa: B027
        """Learn from the step just verified.  Default: nothing to learn."""

    def should_stop(self, confidences: Sequence[float]) -> bool:
        """A drafter that knows its confidence per token asks after each one whether to stop drafting."""
        return False

    def keep_length(self, confidences: Sequence[float]) -> int:
        """How many leading tokens of a chain with these confidences are worth verifying."""
        return len(confidences)


@dataclass
class FixedLength(DraftLengthPolicy):
    """``k`` tokens a step (at most what is left).  ``costs``: the target's verification costs, whose curve at a long
    context it has measured when a sequence first gets there, between steps as ``auto`` does (tree drafters size their
    trees with those curves whatever the draft length: ``drafters/_tree_size.py``)."""

    k: int
    costs: VerificationCosts | None = None

    def next_length(self, limit: int) -> int:
        return min(self.k, limit)

    def begin(self, prefill_s: float, context_tokens: int = 0) -> None:
        self._reach(context_tokens)

    def observe(self, step: StepObservation) -> None:
        self._reach(step.context_tokens)

    def _reach(self, context_tokens: int) -> None:
        if self.costs is not None:
            self.costs.prepare(context_tokens)


@dataclass
class HeuristicLength(DraftLengthPolicy):
    """transformers' ``num_assistant_tokens_schedule="heuristic"`` as a baseline."""

    k: int = 5
    maximum: int = 16

    def fork(self) -> HeuristicLength:
        return HeuristicLength(self.k, self.maximum)

    def next_length(self, limit: int) -> int:
        return min(self.k, limit)

    def observe(self, step: StepObservation) -> None:
        if step.depth == 0:
            return
        self.k = min(self.k + 2, self.maximum) if step.accepted == step.depth else max(1, self.k - 1)
