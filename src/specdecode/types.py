"""The data types every layer shares: what a drafter proposes, what verification decides, what a step
revealed and cost.

``drafters/`` and ``verify/`` both import from here and never from each other; the engine moves these
objects between them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprob:
    """An emitted token's log-probability under the target, and the most likely tokens' at its position
    (``top``: (token id, log-probability) pairs, most likely first)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


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
    setup_s: seconds of the propose spent bringing the drafter's own state up to the context (a draft
        model's prefill of the prompt, the tokens it skipped while drafting was off): a cost of drafting
        at all, not of this draft's depth, which the draft-length policy must not read as a per-token cost.
    """

    tokens: list[int]
    probs: torch.Tensor | None = None
    parents: list[int] | None = None
    confidence: list[float] | None = None
    setup_s: float = 0.0

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

    @property
    def depth(self) -> int:
        """How deep the draft goes (0: nothing drafted)."""
        return len(self.tokens) if self.is_chain else max(self.depths(), default=0)

    def limited(self, max_nodes: int, max_depth: int) -> Draft:
        """At most ``max_nodes`` nodes, none deeper than ``max_depth``; earlier nodes win."""
        depths = self.depths()
        return self.keep([i for i in range(len(self.tokens)) if depths[i] <= max_depth][: max(0, max_nodes)])

    def keep(self, kept: list[int]) -> Draft:
        """The draft of the nodes ``kept`` only (in order, each with its parent kept)."""
        if len(kept) == len(self.tokens):
            return self
        confidence = [self.confidence[i] for i in kept] if self.confidence is not None else None
        if self.parents is None:  # a chain: depth order is list order
            probs = self.probs[: len(kept)] if self.probs is not None else None
            return Draft(self.tokens[: len(kept)], probs, confidence=confidence, setup_s=self.setup_s)
        new_index = {old: new for new, old in enumerate(kept)}
        return Draft(
            tokens=[self.tokens[i] for i in kept],
            probs=self.probs[kept] if self.probs is not None else None,
            parents=[new_index.get(self.parents[i], -1) if self.parents[i] >= 0 else -1 for i in kept],
            confidence=confidence,
            setup_s=self.setup_s,
        )

    def row_paths(self) -> list[list[int]]:
        """The draft tokens between the context and each verification row (row 0: none; row i + 1: node i's path)."""
        paths: list[list[int]] = [[]]
        for node, parent in enumerate(self.parent_list):
            paths.append([*paths[parent + 1], self.tokens[node]])
        return paths


def children_by_row(draft: Draft) -> list[list[int]]:
    """``children[r]``: child nodes of logits row r, where row 0 is the last context token and row
    ``i + 1`` is draft node i (the row layout of the verification forward)."""
    children: list[list[int]] = [[] for _ in range(len(draft.tokens) + 1)]
    for node, parent in enumerate(draft.parent_list):
        children[parent + 1].append(node)
    return children


@dataclass(frozen=True)
class Verdict:
    """Outcome of verifying one draft (chain or tree).

    path: indices (into ``Draft.tokens``) of the accepted nodes, root to leaf.  For a chain these are
        the first ``num_accepted`` tokens.
    next_token: the token the target contributes after them — the correction at the first rejected
        position, or the bonus token when the path ends at a leaf.  Each step therefore produces
        ``len(path) + 1`` tokens.
    """

    path: tuple[int, ...]
    next_token: int

    @property
    def num_accepted(self) -> int:
        return len(self.path)


@dataclass
class StepFeedback:
    """What one verification step revealed, for drafters that learn from the target.

    target_logits: [nodes + 1, vocab] raw target logits; row 0 follows the last context token, row
        ``i + 1`` follows draft node i (e.g. Token Recycling reads their top-k).  Empty when no target
        ran (policy replay), or when the forward computed each row's greedy choice only: for a session that does
        not set ``DraftSession.reads_target_logits``.
    target_hidden: [nodes + 1, features] the target's hidden states of the same rows, for a session that
        asked for them (``DraftSession.hidden_layers``); None otherwise.
    asked: whether the session's ``propose`` ran this step and ``draft`` is what it proposed (perhaps cut at its
        end).  False where the draft-length policy chose plain decoding, or where a constraint's grammar cut branches
        out of the draft or replaced it with forced tokens: the draft then says nothing of what the drafter found
        (STAND learns less; calibrations and self-drafters' exits learn nothing).
    """

    draft: Draft
    path: tuple[int, ...]
    target_logits: torch.Tensor
    target_hidden: torch.Tensor | None = None
    asked: bool = True

    @property
    def num_accepted(self) -> int:
        return len(self.path)

    @property
    def accepted_rows(self) -> list[int]:
        """Logit rows along the accepted path: the context row, then each accepted node's row."""
        return [0, *(node + 1 for node in self.path)]


@dataclass(frozen=True)
class StepObservation:
    """What one sequence's step cost and achieved (the draft-length policy and the stats read it)."""

    depth: int  # how deep the draft actually went (0: nothing drafted)
    nodes: int  # draft tokens verified (a tree has more nodes than depth)
    accepted: int
    draft_s: float  # the whole propose, setup_s included
    verify_s: float  # the verification forward this sequence took part in (shared by a batch)
    overhead_s: float = 0.0  # the rest of the step: the drafter's observe, bookkeeping, the consumer
    confidence: tuple[float, ...] | None = None  # a chain drafter's confidence per token, if it gives one
    width: int = 0  # inputs of the whole verification forward (all sequences of a batch, prompt chunks); 0: nodes + 1
    batch: int = 1  # sequences that shared that forward
    setup_s: float = 0.0  # of draft_s, the drafter catching up with the context (Draft.setup_s)
    context_tokens: int = 0  # tokens in the sequence's cache the verification ran after (0: not known)

    @property
    def forward_width(self) -> int:
        return self.width or self.nodes + 1
