"""Lossless speculative sampling for chains and trees.

Chain (Leviathan et al. 2023; Chen et al. 2023): draft token x ~ q is kept with probability
min(1, p(x) / q(x)); at the first rejection the replacement is drawn from the residual
norm(max(p - q, 0)); if every token survives, a bonus token is drawn from the next p.

Tree (multi-draft, as in SpecInfer / SpecTr and Recursive Speculative Decoding): at a node, its
children are tried in the order they were drawn.  Child j, drawn from q_j given its earlier siblings,
is kept with probability min(1, p_j(x_j) / q_j(x_j)); on rejection the target distribution becomes
the residual p_{j+1} = norm(max(p_j - q_j, 0)) and the next sibling is tried; if all are rejected the
token is drawn from the last residual.  For i.i.d. siblings q_j = q; for siblings drawn without
replacement q_j is q with earlier siblings removed; for deterministic proposals q_j is the point
mass on x_j (the residual is then p_j with x_j removed).  In every case the emitted token follows p
exactly, and a chain is simply a tree with one child per node.
"""

from __future__ import annotations

import torch

from specdecode.sampling import sample
from specdecode.types import Draft, Verdict, children_by_row


def _residual(p: torch.Tensor, q: torch.Tensor | None, token: int) -> torch.Tensor:
    if q is None:
        residual = p.clone()
        residual[token] = 0.0
    else:
        residual = torch.clamp(p - q, min=0.0)
    total = float(residual.sum())
    # Zero mass means p <= q everywhere, i.e. p == q: rejection then has probability 0 and is reached
    # only through rounding; p itself is the exact limit.
    return residual / total if total > 0.0 else p


def rejection_level(
    p: torch.Tensor, candidates: list[int], draft: Draft, draft_probs: torch.Tensor | None, generator
) -> tuple[int | None, int]:
    """Recursive rejection sampling at one node whose target distribution is ``p``: the first of the child nodes
    ``candidates`` kept and its token, or None and the token drawn from the last residual (the bonus token when
    there are no candidates)."""
    for child in candidates:
        token = draft.tokens[child]
        q = draft_probs[child] if draft_probs is not None else None
        q_token = float(q[token]) if q is not None else 1.0
        u = float(torch.rand((), generator=generator))
        if q_token > 0 and u * q_token < float(p[token]):  # u < p/q without dividing by zero
            return child, token
        p = _residual(p, q, token)
    return None, sample(p, generator)


def verify_speculative_sampling(target_probs: torch.Tensor, draft: Draft, generator: torch.Generator | None) -> Verdict:
    """target_probs: [nodes + 1, vocab] processed target distributions in the verification row layout.

    The walk reads single probabilities node by node, so both distributions are brought to the CPU once
    first (on a GPU each read would otherwise be a device sync); ``generator`` is a CPU generator."""
    target_probs = target_probs.cpu()
    draft_probs = draft.probs.cpu() if draft.probs is not None else None
    children = children_by_row(draft)
    path: list[int] = []
    row = 0
    while True:
        accepted, token = rejection_level(target_probs[row], children[row], draft, draft_probs, generator)
        if accepted is None:
            return Verdict(path=tuple(path), next_token=token)
        path.append(accepted)
        row = accepted + 1
