"""Lossless speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

Draft token x_i ~ q_i is kept with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection
the replacement is drawn from the residual norm(max(p_i - q_i, 0)); if all k survive, a bonus
token is drawn from p_{k+1}.  The emitted tokens are then distributed exactly as if sampled from
the target p one by one, whatever q is.  A deterministic drafter is the point mass q = δ(x_i):
the token is kept with probability p_i(x_i) and the residual is p_i with x_i removed.
"""

from __future__ import annotations

import torch

from specdecode.verify.base import Verdict
from specdecode.verify.logits import sample


def verify_speculative_sampling(
    target_probs: torch.Tensor,
    draft_tokens: list[int],
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None,
) -> Verdict:
    """target_probs: [k+1, vocab] processed target distributions; draft_probs: [k, vocab] or None."""
    for i, token in enumerate(draft_tokens):
        p = target_probs[i]
        if draft_probs is None:
            q_token = 1.0
            residual = p.clone()
            residual[token] = 0.0
        else:
            q = draft_probs[i]
            q_token = float(q[token])
            residual = torch.clamp(p - q, min=0.0)
        p_token = float(p[token])
        u = float(torch.rand((), generator=generator))
        if q_token > 0 and u * q_token < p_token:  # u < p/q without dividing by zero
            continue
        total = float(residual.sum())
        if total <= 0.0:
            # p <= q everywhere means p == q: a rejection then has probability 0, so this branch is
            # reached only through rounding; sampling p itself is the exact limit.
            residual = p
        return Verdict(num_accepted=i, next_token=sample(residual, generator))
    return Verdict(num_accepted=len(draft_tokens), next_token=sample(target_probs[len(draft_tokens)], generator))
