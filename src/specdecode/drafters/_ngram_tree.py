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
from dataclasses import dataclass
from typing import TypeVar

from specdecode.errors import SpecDecodeError
from specdecode.types import Draft

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
    with an estimated path probability of at least ``min_prob``.

    A child's path probability never exceeds its parent's, so nodes come out parents first, and
    siblings in order of preference (ties keep ``expand``'s order)."""
    tokens: list[int] = []
    parents: list[int] = []
    score = 0.0
    heap: list[tuple[float, int, int, int, State, int]] = []
    order = itertools.count()

    def push_children(state: State, parent: int, prob: float, depth: int) -> None:
        if depth > max_depth or len(tokens) >= max_nodes:
            return
        for token, p, child in expand(state, min_prob / prob):
            heapq.heappush(heap, (-prob * p, next(order), parent, token, child, depth))

    push_children(root, -1, 1.0, 1)
    while heap and len(tokens) < max_nodes:
        neg_prob, _, parent, token, state, depth = heapq.heappop(heap)
        tokens.append(token)
        parents.append(parent)
        score -= neg_prob
        push_children(state, len(tokens) - 1, -neg_prob, depth + 1)
    return TreeProposal(Draft(tokens=tokens, parents=parents), score)


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
