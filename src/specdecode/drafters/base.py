"""The drafter protocol: propose tokens cheaply, learn from what the target accepted.

Modelled on transformers' ``CandidateGenerator`` (``get_candidates`` / ``update_candidate_strategy``)
and vLLM's one-file-per-proposer layout.  A drafter never sees the verifier: it returns a
:class:`Draft`, and if it sampled its tokens from a distribution it returns that distribution too, so
that lossless speculative sampling can correct for it.  A drafter without probabilities (n-gram
lookup) is treated as a point-mass proposal.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from specdecode.config import SamplingParams

if TYPE_CHECKING:
    from specdecode.models.base import KVCache
    from specdecode.models.loading import LoadedModel


@dataclass
class Draft:
    """Proposed continuation of the context: a chain, or a tree of alternatives.

    tokens: the proposed token ids (may be empty: "no idea, decode one token normally").
    parents: for a tree, ``parents[i]`` is the index of node i's parent in ``tokens`` or -1 when node
        i directly follows the context; parents come before their children, and siblings are listed
        in the order they were drawn.  None means a chain (``parents[i] == i - 1``).
    probs: [len(tokens), vocab]; row i is the distribution token i was drawn from, *given its earlier
        siblings* (sampling with replacement: the parent's draft distribution; without replacement:
        that distribution with earlier siblings removed).  None means every token is a deterministic
        proposal (a point mass).  Lossless sampling needs these to be the true drawing distributions.
    confidence: optional, one number in [0, 1] per node: how likely the drafter thinks the node is right
        given its parent (a draft model's probability of its token, ...).  Only the draft-length policy
        reads it (to stop drafting or trim a chain); verification never does, so it cannot affect output.
    """

    tokens: list[int]
    probs: torch.Tensor | None = None
    parents: list[int] | None = None
    confidence: list[float] | None = None

    def __post_init__(self) -> None:
        if self.probs is not None and self.probs.shape[0] != len(self.tokens):
            raise ValueError(f"draft has {len(self.tokens)} tokens but {self.probs.shape[0]} prob rows")
        if self.parents is not None:
            if len(self.parents) != len(self.tokens):
                raise ValueError("a draft tree needs one parent per token")
            if any(not -1 <= parent < i for i, parent in enumerate(self.parents)):
                raise ValueError("draft tree parents must come before their children")
        if self.confidence is not None and len(self.confidence) != len(self.tokens):
            raise ValueError("a draft's confidence needs one value per token")

    @property
    def parent_list(self) -> list[int]:
        """Parents of every node, chains included."""
        return self.parents if self.parents is not None else list(range(-1, len(self.tokens) - 1))

    @property
    def is_chain(self) -> bool:
        return self.parents is None or self.parents == list(range(-1, len(self.tokens) - 1))

    def depths(self) -> list[int]:
        """Depth of every node; children of the context have depth 1."""
        depth: list[int] = []
        for parent in self.parent_list:
            depth.append(1 if parent < 0 else depth[parent] + 1)
        return depth

    def limited(self, max_nodes: int, max_depth: int) -> Draft:
        """At most ``max_nodes`` nodes, none deeper than ``max_depth``; earlier nodes win."""
        depths = self.depths()
        kept = [i for i in range(len(self.tokens)) if depths[i] <= max_depth][: max(0, max_nodes)]
        if len(kept) == len(self.tokens):
            return self
        confidence = [self.confidence[i] for i in kept] if self.confidence is not None else None
        if self.parents is None:  # a chain: depth order is list order
            probs = self.probs[: len(kept)] if self.probs is not None else None
            return Draft(self.tokens[: len(kept)], probs, confidence=confidence)
        new_index = {old: new for new, old in enumerate(kept)}
        return Draft(
            tokens=[self.tokens[i] for i in kept],
            probs=self.probs[kept] if self.probs is not None else None,
            parents=[new_index.get(self.parents[i], -1) if self.parents[i] >= 0 else -1 for i in kept],
            confidence=confidence,
        )


@dataclass
class StepFeedback:
    """What one verification step revealed, for drafters that learn from the target.

    target_logits: [nodes + 1, vocab] raw target logits; row 0 follows the last context token, row
        ``i + 1`` follows draft node i (e.g. Token Recycling reads their top-k).
    """

    draft: Draft
    path: tuple[int, ...]
    target_logits: torch.Tensor

    @property
    def num_accepted(self) -> int:
        return len(self.path)

    @property
    def accepted_rows(self) -> list[int]:
        """Logit rows along the accepted path: the context row, then each accepted node's row."""
        return [0, *(node + 1 for node in self.path)]


class Drafter(ABC):
    """Base class of every drafter.  Subclasses register themselves with ``@register_drafter``.

    Lifecycle per request: ``start(prompt)``, then per step ``propose`` → (verification) →
    ``observe``.  ``context`` always holds prompt + every token accepted so far, so a drafter may
    keep incremental state but can always resynchronise from it.
    """

    name: ClassVar[str]
    #: True if the drafter can use a draft distribution (sampling mode benefits from ``Draft.probs``).
    provides_probs: ClassVar[bool] = False
    #: True if the drafter cannot be built before something is trained for the target (e.g. an adapter).
    needs_training: ClassVar[bool] = False
    #: Set by the engine for each request: called with the confidences of the tokens drafted so far, it
    #: says whether to stop drafting (a cost-derived threshold).  Drafters that compute a confidence per
    #: token while drafting a chain may consult it; the others ignore it.
    stop_rule: Callable[[Sequence[float]], bool] | None = None
    #: Set by the engine for each request (None outside one): the target's verification cache, which holds
    #: ``context[:-1]`` whenever ``propose`` is called.  A drafter that runs the target itself (the
    #: self-speculative ones) may append to it while drafting if it crops it back to that length before
    #: returning; everyone else ignores it.
    target_cache: KVCache | None = None

    def __init__(self, target: LoadedModel) -> None:
        self.target = target

    def start(self, prompt_ids: list[int], sampling: SamplingParams) -> None:  # noqa: B027
        """A new request begins.  State learned from earlier requests is kept (see ``reset``)."""

    @abstractmethod
    def propose(self, context: list[int], max_tokens: int) -> Draft:
        """Propose up to ``max_tokens`` tokens that follow ``context``."""

    def observe(self, context: list[int], feedback: StepFeedback) -> None:  # noqa: B027
        """Verification is done: ``context`` now ends with the accepted tokens and the target's own."""

    def reset(self) -> None:  # noqa: B027
        """Forget everything learned across requests (drafters that keep history must bound it)."""
