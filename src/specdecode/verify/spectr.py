"""SpecTr's k-sequential selection (Sun et al., "SpecTr: Fast Speculative Decoding via Optimal Transport", NeurIPS
2023, algorithm K-SEQ), lossless: the output follows the target's distribution.

The k children of a node are i.i.d. draws x_1..x_k from the draft distribution q.  They are tried in turn, each kept
with probability min(1, p(x) / (rho q(x))) for one rho in [1, k]; if none is kept, the token is drawn from the
residual.  With beta = sum_x min(q(x), p(x) / rho) (one draft's chance of being kept), a token x is emitted by keeping
a draft with probability min(q(x), p(x) / rho) f(beta), f(beta) = 1 + (1 - beta) + ... + (1 - beta)^(k-1), so the
residual is

    p_res(x) = (p(x) - min(q(x), p(x) / rho) f(beta)) / (1 - beta)^k,

non-negative exactly when f(beta(rho)) <= rho.  Keeping is likelier the smaller rho, so rho is the smallest value
that satisfies it (found by bisection: f(beta(1)) >= 1 and f(beta(k)) <= k).  The acceptance 1 - (1 - beta)^k is then
within a factor 1 - 1/e of the optimal transport's (the paper's theorem), and k = 1 is speculative sampling itself.

Trees verify level by level (:mod:`specdecode.verify.multidraft`), where siblings are i.i.d. draws; anywhere else,
and for point-mass proposals, the node is verified by recursive rejection sampling.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specdecode.types import Draft, Verdict
from specdecode.verify.base import NoOptions, TargetRows, VerifierMethod
from specdecode.verify.multidraft import draw_from_cdf, multidraft_walk, residual_cdf
from specdecode.verify.registry import register_verifier

_BISECTION_STEPS = 60  # rho in [1, k] to within k 2^-60: the last float64 bit


def kept_mass(beta: float, k: int) -> float:
    """f(beta) = 1 + (1 - beta) + ... + (1 - beta)^(k-1): how many times more likely a token is emitted by keeping one
    of k sequential drafts than by keeping a single one."""
    return sum((1.0 - beta) ** i for i in range(k))


def smallest_rho(p: np.ndarray, q: np.ndarray, k: int) -> float:
    """The smallest rho in [1, k] (to float precision, erring high: the residual stays non-negative) with
    f(beta(rho)) <= rho."""

    def feasible(rho: float) -> bool:
        return kept_mass(float(np.minimum(q, p / rho).sum()), k) <= rho

    if feasible(1.0):
        return 1.0
    low, high = 1.0, float(k)
    for _ in range(_BISECTION_STEPS):
        middle = (low + high) / 2
        low, high = (low, middle) if feasible(middle) else (middle, high)
    return high


@dataclass(frozen=True)
class KSequential:
    """K-SEQ for one target distribution p, draft distribution q and k drafts."""

    keep: np.ndarray  # [V] probability of keeping a draft of each token: min(1, p / (rho q))
    kept: np.ndarray  # [V] probability of emitting each token by keeping a draft of it
    residual_cdf: np.ndarray  # [V] what a rejection of all k emits

    @property
    def acceptance(self) -> float:
        """1 - (1 - beta)^k: the probability that one of the k drafts is kept."""
        return float(self.kept.sum())

    @classmethod
    def solve(cls, p: np.ndarray, q: np.ndarray, k: int) -> KSequential:
        rho = smallest_rho(p, q, k)
        per_draft = np.minimum(q, p / rho)  # q(x) times the chance of keeping a draft of x
        beta = float(per_draft.sum())
        keep = np.divide(per_draft, q, out=np.zeros_like(q), where=q > 0)
        kept = per_draft * kept_mass(beta, k)
        return cls(keep, kept, residual_cdf(p, kept))

    def choose(
        self, tokens: np.ndarray, uniforms: np.ndarray, residual_uniforms: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """For N independent verifications at once: tokens [N, k] the drafts, uniforms [N, k] and residual_uniforms
        [N] in [0, 1).  Returns the index of the draft kept (-1: none) and the token emitted, each [N]."""
        kept = uniforms < self.keep[tokens]
        index = np.where(kept.any(axis=1), kept.argmax(axis=1), -1)
        drafted = np.take_along_axis(tokens, np.maximum(index, 0)[:, None], axis=1)[:, 0]
        return index, np.where(index >= 0, drafted, draw_from_cdf(self.residual_cdf, residual_uniforms))


def spectr_level(p: np.ndarray, q: np.ndarray, tokens: np.ndarray, generator: torch.Generator):
    """K-SEQ at one node: the draft kept (or None) and the token emitted."""
    uniforms = torch.rand(len(tokens) + 1, generator=generator, dtype=torch.float64).numpy()
    index, token = KSequential.solve(p, q, len(tokens)).choose(tokens[None], uniforms[None, :-1], uniforms[-1:])
    return (int(index[0]) if index[0] >= 0 else None), int(token[0])


@register_verifier("spectr", lossless=True)
class SpecTr(VerifierMethod):
    """SpecTr's k-sequential selection over k i.i.d. drafts per node (sampling; greedy matching at temperature 0)"""

    @staticmethod
    def verify(rows: TargetRows, draft: Draft, options: NoOptions) -> Verdict:
        return multidraft_walk(rows, draft, spectr_level)
