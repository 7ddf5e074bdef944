"""Optimal multi-draft verification (Hu et al., "Towards Optimal Multi-draft Speculative Decoding", ICLR 2025),
lossless: the output follows the target's distribution, and one of the k drafts is kept as often as any lossless
verifier can keep one.

The k children of a node are i.i.d. draws from q; the target's token Y must follow p.  The best a verifier can do is
the optimal transport between the k drafts and Y that maximises P(Y is one of the drafts).  Its value is a minimum
cut of that transport's flow network,

    alpha* = min over token sets H of  p(H) + 1 - q(H)^k,

and the paper shows the minimising H is a set of the tokens with the smallest p(x) / q(x): sorting by that ratio
gives alpha* in O(V log V) (:func:`optimal_acceptance`).

Reaching it needs the transport plan itself.  Which draft to keep depends only on the multiset of the drafted tokens,
so the plan is a linear programme over the multisets: flow f(m, y) >= 0 from each multiset m to each token y in it,
at most P(m) out of a multiset and at most p(y) into a token, total flow maximal (scipy's HiGHS solves it).  Given
the drafts' multiset m, token y is kept with probability f(m, y) / P(m); otherwise the token is drawn from the
residual norm(max(p - r, 0)), r(y) the total flow into y, which makes the output exactly p.

There are C(n + k, k) multisets of n tokens and k drafts, so the programme is solved over the n tokens most worth
keeping (largest min(p(x), 1 - (1 - q(x))^k)) with n as large as ``max_multisets`` allows; a draft of any other token
counts as a blank, never kept.  That stays lossless, and is the exact optimum whenever the drafts' support fits (the
toy models, top-k sampling); otherwise it is the optimum over the kept tokens, which can fall well below alpha* when
the draft spreads its mass over many tokens, and the node is then verified by SpecTr's K-SEQ
(:mod:`specdecode.verify.spectr`) whenever K-SEQ keeps a draft more often (both are lossless, and which runs is a
function of p, q and k alone).  The programme is solved at every node verified, milliseconds each: a verifier for
measuring what the optimum gives more than for serving.

Trees verify level by level (:mod:`specdecode.verify.multidraft`), where siblings are i.i.d. draws; anywhere else,
and for point-mass proposals, the node is verified by recursive rejection sampling.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from itertools import combinations_with_replacement
from typing import TYPE_CHECKING

import numpy as np
import torch

from specdecode.errors import SpecDecodeError
from specdecode.types import Draft, Verdict
from specdecode.verify.base import TargetRows, VerifierMethod, check_integers
from specdecode.verify.multidraft import draw_from_cdf, multidraft_walk, residual_cdf
from specdecode.verify.registry import register_verifier
from specdecode.verify.spectr import KSequential, spectr_level

if TYPE_CHECKING:
    from specdecode.models.base import CausalLM


def optimal_acceptance(p: np.ndarray, q: np.ndarray, k: int) -> float:
    """alpha*: the highest probability with which a lossless verifier keeps one of k i.i.d. drafts from q when the
    target's distribution is p (the minimum over the prefixes H of the tokens sorted by p / q of p(H) + 1 - q(H)^k).
    """
    drafted = np.flatnonzero(q > 0)
    order = drafted[np.argsort(p[drafted] / q[drafted], kind="stable")]
    p_prefix = np.concatenate([[0.0], np.cumsum(p[order])])
    q_prefix = np.concatenate([[0.0], np.cumsum(q[order])])
    return float(np.min(p_prefix + 1.0 - np.minimum(q_prefix, 1.0) ** k))


def kept_tokens(p: np.ndarray, q: np.ndarray, k: int, max_multisets: int) -> np.ndarray:
    """The tokens the programme may keep: all that both distributions reach, or the most worth keeping of them as
    many as leave at most ``max_multisets`` multisets (with the blank)."""
    both = np.flatnonzero((p > 0) & (q > 0))
    n = len(both)
    while n > 0 and math.comb(n + k, k) > max_multisets:
        n -= 1
    worth = np.minimum(p[both], 1.0 - (1.0 - q[both]) ** k)
    return both[np.argsort(-worth, kind="stable")[:n]]


@dataclass(frozen=True)
class TransportPlan:
    """The optimal transport for one target distribution p, draft distribution q and k drafts."""

    classes: np.ndarray  # [V] each token's index among the kept tokens; the blank (their count) for any other
    radix: int  # the kept tokens and the blank
    codes: np.ndarray  # [M] each multiset of classes (sorted) as a number in base ``radix``, ascending
    keep: np.ndarray  # [M, k] probability of keeping the draft at each sorted position (its first copy only)
    kept: np.ndarray  # [V] probability of emitting each token by keeping a draft of it: the flow into it
    residual_cdf: np.ndarray  # [V] what a rejection emits
    complete: bool  # every token both distributions reach may be kept: the plan is the optimum

    @property
    def acceptance(self) -> float:
        """The probability that a draft is kept."""
        return float(self.kept.sum())

    @classmethod
    def solve(cls, p: np.ndarray, q: np.ndarray, k: int, max_multisets: int) -> TransportPlan:
        from scipy.optimize import linprog
        from scipy.sparse import coo_array

        kept = kept_tokens(p, q, k, max_multisets)
        blank = len(kept)
        classes = np.full(len(p), blank)
        classes[kept] = np.arange(blank)
        weight = np.append(q[kept], max(0.0, 1.0 - float(q[kept].sum())))
        multisets = np.array(list(combinations_with_replacement(range(blank + 1), k)))
        chance = np.array([multiset_probability(m, weight) for m in multisets])
        # One variable per (multiset, position of the first copy of a kept class in it).
        first = np.ones_like(multisets, dtype=bool)
        first[:, 1:] = multisets[:, 1:] != multisets[:, :-1]
        rows, positions = np.nonzero(first & (multisets != blank))
        flows = len(rows)
        constraints = coo_array(
            (
                np.ones(2 * flows),
                (np.concatenate([rows, len(multisets) + multisets[rows, positions]]), np.tile(np.arange(flows), 2)),
            ),
            shape=(len(multisets) + blank, flows),
        )
        bounds = np.concatenate([chance, p[kept]])
        flow = np.zeros(0)
        if flows:  # none when p and q share no token
            solved = linprog(-np.ones(flows), A_ub=constraints.tocsr(), b_ub=bounds, bounds=(0, None), method="highs")
            if solved.status != 0:
                raise SpecDecodeError(f"optimal-md: the transport programme failed: {solved.message}")
            flow = solved.x
        keep = np.zeros(multisets.shape)
        keep[rows, positions] = np.divide(flow, chance[rows], out=np.zeros(flows), where=chance[rows] > 0)
        # HiGHS's tolerance may leave a multiset's keeping probabilities a hair over 1 in all.
        keep = np.clip(keep, 0.0, 1.0) / np.maximum(keep.sum(axis=1, keepdims=True), 1.0)
        into = np.zeros(len(p))
        np.add.at(into, kept[multisets[rows, positions]], keep[rows, positions] * chance[rows])
        codes = multisets @ (blank + 1) ** np.arange(k - 1, -1, -1)
        complete = blank == int(np.count_nonzero((p > 0) & (q > 0)))
        return cls(classes, blank + 1, codes, keep, into, residual_cdf(p, into), complete)

    def choose(self, tokens: np.ndarray, uniforms: np.ndarray, residual_uniforms: np.ndarray) -> tuple:
        """For N independent verifications at once: tokens [N, k] the drafts, uniforms and residual_uniforms [N] in
        [0, 1).  Returns the index of the draft kept (-1: none) and the token emitted, each [N]."""
        classes = self.classes[tokens]
        order = np.argsort(classes, axis=1, kind="stable")
        multiset = np.take_along_axis(classes, order, axis=1)
        row = np.searchsorted(self.codes, multiset @ self.radix ** np.arange(tokens.shape[1] - 1, -1, -1))
        cumulative = np.cumsum(self.keep[row], axis=1)
        position = (uniforms[:, None] < cumulative).argmax(axis=1)
        index = np.where(uniforms < cumulative[:, -1], order[np.arange(len(tokens)), position], -1)
        drafted = np.take_along_axis(tokens, np.maximum(index, 0)[:, None], axis=1)[:, 0]
        return index, np.where(index >= 0, drafted, draw_from_cdf(self.residual_cdf, residual_uniforms))


def multiset_probability(multiset: np.ndarray, weight: np.ndarray) -> float:
    """P(k i.i.d. draws from ``weight`` form ``multiset``): the multinomial coefficient times the product."""
    arrangements = math.factorial(len(multiset))
    for count in Counter(multiset.tolist()).values():
        arrangements //= math.factorial(count)
    return arrangements * float(np.prod(weight[multiset]))


@dataclass(frozen=True)
class OptimalOptions:
    """The transport programme is solved over at most ``max_multisets`` multisets of drafted tokens."""

    max_multisets: int = 2000

    def __post_init__(self) -> None:
        check_integers(self, max_multisets=1)


@register_verifier("optimal-md", lossless=True)
class OptimalMultiDraft(VerifierMethod):
    """the optimal transport over k i.i.d. drafts per node, solved as a linear programme (sampling; needs scipy)"""

    options = OptimalOptions

    @classmethod
    def prepare(cls, target: CausalLM, options: OptimalOptions) -> None:
        try:
            import scipy.optimize  # noqa: F401
        except ImportError:
            raise SpecDecodeError(
                "verifier 'optimal-md' solves a linear programme with scipy: pip install 'specdecode[multidraft]'"
            ) from None

    @staticmethod
    def verify(rows: TargetRows, draft: Draft, options: OptimalOptions) -> Verdict:
        def level(p: np.ndarray, q: np.ndarray, tokens: np.ndarray, generator: torch.Generator):
            plan = TransportPlan.solve(p, q, len(tokens), options.max_multisets)
            if not plan.complete and KSequential.solve(p, q, len(tokens)).acceptance > plan.acceptance:
                return spectr_level(p, q, tokens, generator)
            uniforms = torch.rand(2, generator=generator, dtype=torch.float64).numpy()
            index, token = plan.choose(tokens[None], uniforms[:1], uniforms[1:])
            return (int(index[0]) if index[0] >= 0 else None), int(token[0])

        return multidraft_walk(rows, draft, level)
