"""Shared by the model-free tree drafters (``suffix``, ``cacheback``).

Both estimate, from counts or recency, how likely each next token is after a path, and both spend a
fixed budget of draft nodes where the estimated probability of the whole path is highest — the
expected number of accepted tokens is the sum of those path probabilities, so best-first growth
maximises it for a given number of nodes.  Both also index the context incrementally, reading only
the tokens appended since the last step.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, TypeVar

from specdecode.drafters._tree_size import Calibration, TreeBudget
from specdecode.errors import SpecDecodeError
from specdecode.types import Draft, StepFeedback

if TYPE_CHECKING:
    from specdecode.models.loading import LoadedModel

State = TypeVar("State")

#: ``expand(state, floor)`` → ``[(token, probability, child_state), ...]``: the distinct next tokens
#: after ``state`` whose conditional probability is at least ``floor``, most likely first.
Expand = Callable[[State, float], Sequence[tuple[int, float, State]]]


@dataclass
class TreeProposal:
    draft: Draft
    score: float  # sum of the nodes' path probabilities: the expected number of accepted tokens


def grow_tree(root: State, expand: Expand, max_nodes: int, max_depth: int, min_prob: float) -> TreeProposal:
    """Best-first token tree below ``root``: up to ``max_nodes`` nodes no deeper than ``max_depth``, each
    with an estimated path probability of at least ``min_prob``; each node's ``confidence`` is its
    estimated probability given its parent.

    A child's path probability never exceeds its parent's, so nodes come out parents first, and
    siblings in order of preference (ties keep ``expand``'s order)."""
    tokens: list[int] = []
    parents: list[int] = []
    chances: list[float] = []
    score = 0.0
    heap: list[tuple[float, int, int, int, State, int, float]] = []
    order = itertools.count()

    def push_children(state: State, parent: int, prob: float, depth: int) -> None:
        if depth > max_depth or len(tokens) >= max_nodes:
            return
        for token, p, child in expand(state, min_prob / prob):
            heapq.heappush(heap, (-prob * p, next(order), parent, token, child, depth, p))

    push_children(root, -1, 1.0, 1)
    while heap and len(tokens) < max_nodes:
        neg_prob, _, parent, token, state, depth, chance = heapq.heappop(heap)
        tokens.append(token)
        parents.append(parent)
        chances.append(chance)
        score -= neg_prob
        push_children(state, len(tokens) - 1, -neg_prob, depth + 1)
    return TreeProposal(Draft(tokens=tokens, parents=parents, confidence=chances), score)


class PayingTrees:
    """Which nodes of a best-first tree to verify on this target: the leading ones that pay for their width.

    A forward's cost per input depends on the target: over fp32 or bf16 weights 17 inputs cost little more than one,
    but torch's int4 kernel works in blocks of 4 rows, so its cost jumps at every fifth input
    (``docs/results/quantize-qwen2.5-coder-1.5b``, ``forward-cost-*.json``).  A 16-node suffix tree whose branches
    are mostly rejected then costs far more than it yields.  So, as for the trained heads: the counts' probabilities
    are calibrated online against what verification accepted (per depth), and the tree is cut to the node count with
    the most expected tokens per unit of the target's measured cost (:class:`TreeBudget`).

    Chains pass through whole, without confidences: their depth is the draft-length policy's choice,
    which learns acceptance per position and does not read count-based chances."""

    def __init__(self, target: LoadedModel | None) -> None:
        """``target``: whose verification cost decides (None: every width costs one forward)."""
        self.budget = TreeBudget(target.backend if target is not None else None, "auto", draft_share=0.0)
        self.calibration = Calibration()
        if target is not None:  # measured now (once per model), not inside a step whose drafting is timed
            self.budget.verification_cost(1)

    def choose(self, draft: Draft, context_tokens: int = 0) -> Draft:
        """The leading nodes of ``draft`` (parents first, best first where the drafter grows it so; a chance per
        node given its parent) worth verifying after ``context_tokens``."""
        if draft.confidence is None:
            return draft
        if draft.is_chain:
            return replace(draft, parents=None, confidence=None)
        depths, reach = draft.depths(), []
        for node, parent in enumerate(draft.parent_list):
            chance = self.calibration(draft.confidence[node], depths[node])
            reach.append(chance * (reach[parent] if parent >= 0 else 1.0))
        kept = draft.limited(self.budget.size(reach, context_tokens), len(draft.tokens))
        return replace(kept, parents=None, confidence=None) if kept.is_chain else kept

    def learn(self, feedback: StepFeedback) -> None:
        """What verification accepted of a tree (chains carry no chances and teach nothing here)."""
        if feedback.asked:
            self.calibration.learn(feedback.draft, feedback.path)


class Transcript:
    """The current request's tokens as far as a drafter has indexed them."""

    def __init__(self, tokens: Sequence[int] = ()) -> None:
        self.tokens = list(tokens)

    def advance(self, context: Sequence[int]) -> list[int] | None:
        """Record and return the tokens appended to ``context`` since the last call, or None if ``context``
        does not continue the transcript (the caller must re-index from scratch)."""
        seen = len(self.tokens)
        if len(context) < seen or (seen and context[seen - 1] != self.tokens[-1]):
            return None
        new = list(context[seen:])
        self.tokens.extend(new)
        return new


def check_int(drafter: str, option: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise SpecDecodeError(f"{drafter} option {option} must be an integer >= {minimum}, got {value!r}")
    return value


def check_fraction(drafter: str, option: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
        raise SpecDecodeError(f"{drafter} option {option} must be a number in (0, 1], got {value!r}")
    return float(value)
