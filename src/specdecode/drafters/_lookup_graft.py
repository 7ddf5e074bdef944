"""Prompt lookup grafted onto a trained head's draft tree: retrieval and a model's guesses in one verification.

After SAM-Decoding (Hu et al., 2024), which drafts from a suffix automaton of the prompt and output where it
matches and from a model (EAGLE) where it does not.  A head trained on a CPU budget guesses open chat about
as well as it can but copies poorly, and copying is where speculation pays most: for ``qwen2.5-coder-1.5b``
prompt lookup beat the EAGLE head on HumanEval, and the head won on CHAMP, where lookup gained nothing
(``docs/results/eagle-362k-rows-qwen2.5-coder-1.5b``).  Tree verification checks both in one forward: the lookup's
continuation joins the tree as one more branch (merged with the nodes it agrees with), every node scored by
its own source's calibrated estimate, and the budget verifies whichever nodes pay.  A lookup likely enough to
be right is drafted alone, as SAM-Decoding does with a long match.  The lookup costs a scan of the context,
and output cannot change: the target verifies every node.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from specdecode.drafters._tree_size import Calibration
from specdecode.drafters.base import flag_option
from specdecode.drafters.pld import prompt_lookup
from specdecode.types import Draft, StepFeedback

#: A lookup whose first token is at least this likely to be accepted (calibrated) is drafted alone, without the
#: head: its alternatives would be tried only in the remaining cases and are accepted well under half the time
#: (EAGLE's first guess about 40%), so they would add under 0.1 tokens a step, while the head's catching up,
#: first call and tree cost ~10% of a step (SmolLM2's quick suite), worth about 0.25 of the ~2.5 tokens a step.
COPY_ALONE = 0.75


class TreeNode(Protocol):
    """A node of a drafter's growing tree: its token, its parent's index (-1: the context), its path score."""

    token: int
    parent: int
    score: float


N = TypeVar("N", bound=TreeNode)


@dataclass(frozen=True)
class Copy:
    """Prompt lookup's continuation and its confidence in each token (no tokens: no match)."""

    tokens: list[int] = field(default_factory=list)
    confidence: float = 0.0


class LookupBranch:
    """A tree drafter's lookup branch, shared by its sessions: on or off (the drafter's ``lookup`` option), and
    the calibration of the lookup's confidence per depth, learned from verification like the head's."""

    def __init__(self, kind: str, enabled: bool | str) -> None:
        self.enabled = flag_option(f"{kind}: lookup", enabled)
        self.calibration = Calibration()

    def copy(self, context: list[int], max_tokens: int) -> Copy:
        return Copy(*prompt_lookup(context, max_tokens)) if self.enabled else Copy()

    def alone(self, copy: Copy) -> bool:
        """Whether to draft ``copy`` without the head (``COPY_ALONE``)."""
        return bool(copy.tokens) and self.calibration(copy.confidence, 1) >= COPY_ALONE

    def graft(self, copy: Copy, tokens: list[int], parents: list[int], scores: list[float]) -> dict[int, float]:
        return graft_lookup(copy.tokens, copy.confidence, tokens, parents, scores, self.calibration)

    def graft_nodes(self, copy: Copy, nodes: list[N], new_node: Callable[[int, int, float], N]) -> dict[int, float]:
        """:meth:`graft` onto a tree of node objects, in place: shared nodes get their new scores, and each new
        node is ``new_node(token, parent, score)`` (a node only the lookup drafted), appended in order, so a
        ``new_node`` may read its parent in ``nodes`` even when the lookup added that parent too."""
        tokens, parents, scores = [n.token for n in nodes], [n.parent for n in nodes], [n.score for n in nodes]
        grafted = self.graft(copy, tokens, parents, scores)
        for node, score in zip(nodes, scores):
            node.score = score
        for index in range(len(nodes), len(tokens)):
            nodes.append(new_node(tokens[index], parents[index], scores[index]))
        return grafted


@dataclass
class NodeSources:
    """Of a session's last greedy draft: each node's confidence as the head scored it and as the lookup did (None:
    not that source's node), so that each source's calibration learns from its own nodes only."""

    head: list[float | None] = field(default_factory=list)
    lookup: list[float | None] = field(default_factory=list)

    @classmethod
    def of_copy(cls, copy: Copy) -> NodeSources:
        return cls([None] * len(copy.tokens), [copy.confidence] * len(copy.tokens))

    @classmethod
    def of_tree(
        cls, order: list[int], head: list[float | None], grafted: dict[int, float]
    ) -> tuple[NodeSources, list[float]]:
        """The sources of the draft of nodes ``order`` (``head[i]``: the head's confidence in node i, None when only
        the lookup drafted it), and every node's confidence for the draft (the head's where it has one)."""
        confidence = [grafted[i] if conf is None else conf for i, conf in enumerate(head)]
        return cls([head[i] for i in order], [grafted.get(i) for i in order]), confidence

    def learn(self, feedback: StepFeedback, head: Calibration, lookup: Calibration) -> None:
        nodes = len(feedback.draft.tokens)  # the engine may have cut the draft's last nodes
        if self.head and feedback.asked:
            head.learn(feedback.draft, feedback.path, self.head[:nodes])
            lookup.learn(feedback.draft, feedback.path, self.lookup[:nodes])


def copy_draft(copy: Copy) -> Draft:
    """A copy drafted alone.  Its confidence stays with the lookup's calibration, off the draft: the draft-length
    policy would trim the chain at what the head's tokens cost it, and a copy costs next to nothing per token."""
    return Draft(list(copy.tokens))


def graft_lookup(
    continuation: list[int],
    confidence: float,
    tokens: list[int],
    parents: list[int],
    scores: list[float],
    calibration: Calibration,
) -> dict[int, float]:
    """Add prompt lookup's ``continuation`` (drafted with ``confidence``) to a tree given as lists (``parents``:
    indices, -1 for the context; ``scores``: estimated chance that verification reaches each node, never above
    the parent's), in place: a node the tree already has keeps the better of its two scores, a new one is
    appended.  The lookup's nodes are scored by ``calibration`` of its confidence per depth.

    Returns the lookup's nodes, each with the confidence it was drafted with, for ``calibration`` to learn."""
    child = {(parent, token): node for node, (parent, token) in enumerate(zip(parents, tokens))}
    grafted: dict[int, float] = {}
    parent, score = -1, 1.0
    for depth, token in enumerate(continuation, start=1):
        score *= calibration(confidence, depth)
        node = child.get((parent, token))
        if node is None:
            node = len(tokens)
            tokens.append(token)
            parents.append(parent)
            scores.append(score)
        else:
            scores[node] = score = max(scores[node], score)
        grafted[node] = confidence
        parent = node
    return grafted
