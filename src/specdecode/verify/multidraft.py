"""The walk the multi-draft verifiers share (``spectr``, ``optimal-md``): at each node of the draft tree, a rule that
sees all of the node's children at once picks one to keep, or none and the target's own token.

Such a rule assumes what multi-draft speculative sampling assumes: the children of a node are k i.i.d. draws from one
draft distribution q (``Draft.probs`` gives every sibling the same row).  A chain is the case k = 1.  At a node
where that does not hold — a drafter that gives no probabilities (point-mass proposals: lookups, tree heads' top-k),
or siblings drawn without replacement (their rows differ) — the walk verifies that node by recursive rejection
sampling (:func:`specdecode.verify.rejection.rejection_level`), which is exact there too; for distinct point-mass
proposals it is already the best any verifier can do (it keeps token x with probability p(x)).

A rule reads only the children's tokens, never what was drafted below them, so the kept child's subtree is still a
draw from the drafter given the kept token, and the next level is verified the same way: the output follows the
target's distribution at every depth.  At temperature 0 the walk is greedy matching.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from specdecode.sampling import sampling_probs
from specdecode.types import Draft, Verdict, children_by_row
from specdecode.verify.base import TargetRows
from specdecode.verify.greedy import verify_greedy
from specdecode.verify.rejection import rejection_level

#: ``rule(p, q, tokens, generator)``: the index into ``tokens`` (k i.i.d. draws from q) of the draft kept, or None,
#: and the token emitted; p and q are float64 distributions over the vocabulary.
LevelRule = Callable[[np.ndarray, np.ndarray, np.ndarray, torch.Generator], tuple[int | None, int]]


def draw_from_cdf(cdf: np.ndarray, uniforms: np.ndarray) -> np.ndarray:
    """Inverse-CDF draws, one per uniform in [0, 1): a token of zero probability is never drawn."""
    return np.minimum(np.searchsorted(cdf, uniforms * cdf[-1], side="right"), len(cdf) - 1)


def residual_cdf(p: np.ndarray, kept: np.ndarray) -> np.ndarray:
    """The CDF of norm(max(p - kept, 0)), what a rejection emits when ``kept`` [V] is the probability of emitting each
    token by keeping a draft of it.  Zero mass means every draw is kept, so the residual is reached only through
    rounding; p itself is the exact limit."""
    residual = np.maximum(p - kept, 0.0)
    return np.cumsum(residual if residual.sum() > 0.0 else p)


def iid_siblings(children: list[int], draft_probs: torch.Tensor | None) -> bool:
    """Whether the nodes ``children`` were drawn i.i.d. from one distribution (the same ``Draft.probs`` row)."""
    if draft_probs is None or not children:
        return False
    first = draft_probs[children[0]]
    return all(torch.equal(first, draft_probs[child]) for child in children[1:])


def multidraft_walk(rows: TargetRows, draft: Draft, rule: LevelRule) -> Verdict:
    """Walk the draft tree with ``rule`` at every node whose children are i.i.d. draws, recursive rejection sampling
    at every other node, and greedy matching at temperature 0."""
    if rows.sampling.greedy:
        return verify_greedy(rows.greedy_choices(), draft)
    target_probs = sampling_probs(rows.processed_logits, rows.sampling).cpu()
    draft_probs = draft.probs.cpu() if draft.probs is not None else None
    children = children_by_row(draft)
    path: list[int] = []
    row = 0
    while True:
        candidates = children[row]
        if iid_siblings(candidates, draft_probs):
            p = target_probs[row].double().numpy()
            q = draft_probs[candidates[0]].double().numpy()
            tokens = np.array([draft.tokens[child] for child in candidates])
            index, token = rule(p / p.sum(), q / q.sum(), tokens, rows.generator)
            kept = candidates[index] if index is not None else None
        else:
            kept, token = rejection_level(target_probs[row], candidates, draft, draft_probs, rows.generator)
        if kept is None:
            return Verdict(path=tuple(path), next_token=token)
        path.append(kept)
        row = kept + 1
