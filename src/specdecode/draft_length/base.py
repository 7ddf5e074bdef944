"""The draft-length policy interface, and the two policies that need no cost model: a fixed K and
transformers' heuristic schedule."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from specdecode.types import StepObservation


class DraftLengthPolicy(ABC):
    """How deep one sequence drafts.  What a policy learns across requests lives in the object the generator
    keeps; each sequence decodes with a :meth:`fork` that shares it and adds its own per-sequence state."""

    def fork(self) -> DraftLengthPolicy:
        """The policy for one more sequence (stateless policies are their own fork)."""
        return self

    @abstractmethod
    def next_length(self, limit: int) -> int:
        """Depth to request from the drafter this step, at most ``limit``."""

    def begin(self, prefill_s: float) -> None:  # noqa: B027
        """The target has read this sequence's prompt, in ``prefill_s`` seconds.  Default: nothing to learn."""

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
    k: int

    def next_length(self, limit: int) -> int:
        return min(self.k, limit)


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
