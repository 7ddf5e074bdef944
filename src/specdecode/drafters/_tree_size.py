"""Sizing draft trees by what they are expected to gain against what verifying them costs.

Trained heads (EAGLE, Medusa, Hydra) grow trees from their own probabilities.  A head trained on a CPU
budget is not calibrated (SmolLM2's Medusa heads are far more confident than their acceptance warrants),
and a fixed tree of 16 nodes verified on every step then costs more than it yields: slower than plain
decoding.  So the probabilities are calibrated online against what verification accepted, per
depth, and the number of nodes verified is the one that maximises expected tokens per step over the
target's measured cost of the verification forward — possibly none, when no node pays.
"""

from __future__ import annotations

from collections.abc import Sequence

from specdecode.errors import SpecDecodeError
from specdecode.estimators import ConfidenceBins
from specdecode.models.base import CausalLM
from specdecode.models.cost import VerificationCosts, verification_costs
from specdecode.types import Draft

#: Most nodes an automatically sized tree verifies.
MAX_TREE_NODES = 48
#: A tree grows one more level only from nodes at least this likely: a head call costs a few percent of a
#: target forward, and a path this unlikely rarely repays it.
MIN_EXPAND_PROBABILITY = 0.05


class Calibration:
    """How often a drafted node is accepted given that its parent was, by the draft's confidence in it and
    its depth (a head's deeper guesses are worse calibrated than its first).

    Learned online from every verified tree, shared by a drafter's sessions: per depth, the accepted share
    of the tried nodes by confidence (:class:`ConfidenceBins`, all evidence kept), with the confidence itself
    as a prior worth ``PRIOR`` nodes, so that an unobserved drafter is taken at its word."""

    DEPTHS = 8  # depths beyond share the last table
    PRIOR = 4.0

    def __init__(self) -> None:
        self.depths = [ConfidenceBins(prior_weight=self.PRIOR, discount=1.0) for _ in range(self.DEPTHS)]

    def _table(self, depth: int) -> ConfidenceBins:
        return self.depths[min(max(depth, 1), self.DEPTHS) - 1]

    def __call__(self, confidence: float, depth: int) -> float:
        """The estimated chance that a node ``depth`` deep drafted with ``confidence`` is accepted, given
        that its parent was."""
        return self._table(depth)(confidence)

    def learn(self, draft: Draft, path: tuple[int, ...], confidence: Sequence[float | None] | None = None) -> None:
        """Every node whose parent was accepted (or is the context) was tried: accepted iff on the path.

        ``confidence``: the confidence each node was scored with (default: the draft's); None for a node that
        this calibration did not score (another source's node in a tree drafted from two), which it skips."""
        confidence = draft.confidence if confidence is None else confidence
        if confidence is None:
            return
        reached = {-1, *path}
        depths: list[int] = []
        for node, parent in enumerate(draft.parent_list):
            depths.append(depths[parent] + 1 if parent >= 0 else 1)
            if parent in reached and confidence[node] is not None:
                self._table(depths[node]).add(confidence[node], node in reached)


class TreeBudget:
    """How many nodes of a tree to verify: a fixed count, or (``"auto"``) as many as pay.

    ``draft_share`` is a step's drafting and bookkeeping in units of a one-token target forward, spent
    whatever is verified; it only weighs how much one more node is worth against the step's cost."""

    def __init__(
        self,
        backend: CausalLM | None,
        tree_nodes: int | str,
        draft_share: float,
        costs: VerificationCosts | None = None,
    ) -> None:
        self.backend = backend
        self.tree_nodes = tree_nodes
        self.draft_share = draft_share
        self._costs = costs  # the backend's, measured when first needed

    @property
    def max_nodes(self) -> int:
        """The most nodes worth drafting."""
        return MAX_TREE_NODES if self.tree_nodes == "auto" else int(self.tree_nodes)

    @property
    def drafts_trees(self) -> bool:
        """False for ``tree_nodes=0``: the drafter drafts a chain."""
        return self.tree_nodes != 0

    def verification_cost(self, width: int, context_tokens: int = 0) -> float:
        """A verification forward over ``width`` inputs after ``context_tokens`` relative to one (measured once per
        target; at long contexts, where the draft-length policy measured them, :class:`VerificationCosts`)."""
        if self._costs is None:
            measured = verification_costs(self.backend) if self.backend is not None else None
            self._costs = measured or VerificationCosts.of((1.0,))
        return self._costs.relative(width, context_tokens)

    def size(self, probabilities: list[float], context_tokens: int = 0) -> int:
        """How many of the nodes (their path probabilities, best first) to verify.

        A node's path probability is the estimate that verification reaches it, so N nodes yield about
        1 + (the sum of the N best) tokens and cost ``draft_share`` plus the verification of N + 1 inputs;
        with ``auto`` the N (0 included) with the most tokens per unit of cost — EAGLE-2's reranking,
        sized by the target's own cost curve after ``context_tokens`` instead of a constant."""
        if self.tree_nodes != "auto":
            return min(int(self.tree_nodes), len(probabilities))
        best, best_rate, gain = 0, 1.0 / (self.draft_share + self.verification_cost(1, context_tokens)), 1.0
        for count, probability in enumerate(probabilities[:MAX_TREE_NODES], start=1):
            gain += probability
            rate = gain / (self.draft_share + self.verification_cost(count + 1, context_tokens))
            if rate > best_rate:
                best, best_rate = count, rate
        return best

    def worth_expanding(
        self, scores: Sequence[float], frontier: Sequence[int], top_k: int, context_tokens: int = 0
    ) -> list[int]:
        """Which ``frontier`` nodes (indices into ``scores``, the path probabilities of the tree so far) to grow
        one level deeper: the ``top_k`` likeliest of those the budget would verify now, none under
        ``MIN_EXPAND_PROBABILITY``.  A child is never likelier than its parent, so the children of a node the budget
        leaves out would be left out too: growing them costs a head call's rows for nothing (EAGLE's trees on
        SmolLM2 grew 16 candidates a level to verify two)."""
        ranked = sorted(scores, reverse=True)
        verified = self.size(ranked, context_tokens)
        if verified == 0:
            return []
        floor = max(ranked[verified - 1], MIN_EXPAND_PROBABILITY)
        candidates = [i for i in frontier if scores[i] >= floor]
        return sorted(candidates, key=lambda i: scores[i], reverse=True)[:top_k]

    def best_nodes(self, parents: Sequence[int], scores: Sequence[float], context_tokens: int = 0) -> list[int]:
        """The nodes worth verifying (:meth:`size`) out of a grown tree (``parents``: indices, -1 for the context;
        a node never scores above its parent), ordered by depth; on equal scores the shallower first, so that
        every parent comes in before its child."""
        depths: list[int] = []
        for parent in parents:
            depths.append(depths[parent] + 1 if parent >= 0 else 1)
        ranked = sorted(range(len(parents)), key=lambda i: (-scores[i], depths[i]))
        best = ranked[: self.size([scores[i] for i in ranked], context_tokens)]
        return sorted(best, key=lambda i: (depths[i], -scores[i]))


def subtree(order: Sequence[int], tokens: Sequence[int], parents: Sequence[int], confidence: Sequence[float]) -> Draft:
    """The draft of the nodes ``order`` of a tree (each after its parent), re-indexed."""
    index_of = {old: new for new, old in enumerate(order)}
    return Draft(
        tokens=[tokens[i] for i in order],
        parents=[index_of[parents[i]] if parents[i] >= 0 else -1 for i in order],
        confidence=[confidence[i] for i in order],
    )


def check_tree_nodes(kind: str, tree_nodes: object) -> int | str:
    """``tree_nodes`` as a drafter option: ``auto`` or a count >= 0 (0: draft a chain)."""
    if tree_nodes != "auto" and (not isinstance(tree_nodes, int) or isinstance(tree_nodes, bool) or tree_nodes < 0):
        raise SpecDecodeError(f"{kind}: tree-nodes must be 'auto' or an integer >= 0 (0: a chain), got {tree_nodes!r}")
    return tree_nodes  # type: ignore[return-value]
