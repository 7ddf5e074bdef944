"""Prompt lookup grafted onto a trained head's draft tree: retrieval and a model's guesses in one verification.

After SAM-Decoding (Hu et al., 2024), which drafts from a suffix automaton of the prompt and output where it
matches and from a model (EAGLE) where it does not.  A head trained on a CPU budget guesses open chat about
as well as it can but copies poorly, and copying is where speculation pays most: on the 4 tasks of
``qwen2.5-coder-1.5b`` prompt lookup ran at 2.42x plain on HumanEval where the EAGLE head ran at 1.71x, and the
head at 1.59x on CHAMP where lookup ran at 1.00x.  Tree verification checks both in one forward: the lookup's
continuation joins the tree as one more branch (merged with the nodes it agrees with), every node scored by
its own source's calibrated estimate, and the budget verifies whichever nodes pay.  The lookup costs a
scan of the context, and output cannot change: the target verifies every node.
"""

from __future__ import annotations

from specdecode.drafters._tree_size import Calibration


def graft_lookup(
    continuation: list[int],
    confidence: float,
    tokens: list[int],
    parents: list[int],
    scores: list[float],
    calibration: Calibration,
) -> dict[int, float]:
    """Add prompt lookup's ``continuation`` (:func:`~specdecode.drafters.pld.prompt_lookup`, drafted with
    ``confidence``) to a tree given as lists (``parents``: indices, -1 for the context; ``scores``: estimated chance
    that verification reaches each node, never above the parent's), in place: a node the tree already has keeps
    the better of its two scores, a new one is appended.  The lookup's nodes are scored by ``calibration`` of
    its confidence per depth.

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
