"""The drafter protocol: propose tokens cheaply, learn from what the target accepted.

Modelled on transformers' ``CandidateGenerator`` (``get_candidates`` / ``update_candidate_strategy``)
and vLLM's one-file-per-proposer layout.  A drafter never sees the verifier: it returns a
:class:`Draft`, and if it sampled its tokens from a distribution it returns that distribution too, so
that lossless speculative sampling can correct for it.  A drafter without probabilities (n-gram
lookup) is treated as a point-mass proposal.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from specdecode.config import SamplingParams

if TYPE_CHECKING:
    from specdecode.models.loading import LoadedModel


@dataclass
class Draft:
    """Proposed continuation of the context.

    tokens: the proposed token ids, in order (may be empty: "no idea, decode one token normally").
    probs: [len(tokens), vocab] distribution each token was sampled from, or None if the proposal
        is deterministic (a point mass on each token).
    """

    tokens: list[int]
    probs: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.probs is not None and self.probs.shape[0] != len(self.tokens):
            raise ValueError(f"draft has {len(self.tokens)} tokens but {self.probs.shape[0]} prob rows")


class Drafter(ABC):
    """Base class of every drafter.  Subclasses register themselves with ``@register_drafter``.

    Lifecycle per request: ``start(prompt)``, then per step ``propose`` → (verification) →
    ``observe``.  ``context`` always holds prompt + every token accepted so far, so a drafter may
    keep incremental state but can always resynchronise from it.
    """

    name: ClassVar[str]
    #: True if the drafter can use a draft distribution (sampling mode benefits from ``Draft.probs``).
    provides_probs: ClassVar[bool] = False

    def __init__(self, target: LoadedModel) -> None:
        self.target = target

    def start(self, prompt_ids: list[int], sampling: SamplingParams) -> None:  # noqa: B027
        """A new request begins.  Default: nothing to reset."""

    @abstractmethod
    def propose(self, context: list[int], max_tokens: int) -> Draft:
        """Propose up to ``max_tokens`` tokens that follow ``context``."""

    def observe(self, context: list[int], num_accepted: int) -> None:  # noqa: B027
        """Verification kept ``num_accepted`` of the proposed tokens; ``context`` is now extended."""
