"""Typical acceptance (Cai et al., "Medusa", section 2.3.1), LOSSY: the output is no longer the target's own.

A draft token x the target would not itself have chosen is kept when it is *typical* of the target's
distribution p at that row: p(x) > min(``epsilon``, ``delta`` * exp(-H(p))), H the entropy in nats.  Where
p is peaked (H small) the bar is ``epsilon``, a hard floor; where p is flat the bar drops with exp(-H), so
more alternatives pass — the same intuition as FLy's gate, without FLy's window to catch errors.

p is the request's processed distribution (temperature, top-k, top-p), which is what the method was made
for: sampling, where it replaces rejection sampling's min(1, p/q) test and reads no draft probabilities.
At temperature 0 (greedy) it applies to the raw distribution (temperature 1, nothing cut): a draft token is
kept if it is the argmax (as ever) or typical of the model's own distribution, and the target's argmax is
emitted where the path ends.  Chains and trees alike (the walk of :mod:`specdecode.verify.relaxed`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from specdecode.types import Draft, Verdict
from specdecode.verify.base import TargetRows, VerifierMethod, check_fractions
from specdecode.verify.registry import register_verifier
from specdecode.verify.relaxed import entropy, relaxed_walk


@dataclass(frozen=True)
class TypicalOptions:
    """A draft token x is kept when p(x) > min(``epsilon``, ``delta`` * exp(-H(p)))."""

    epsilon: float = 0.09
    delta: float = 0.3

    def __post_init__(self) -> None:
        check_fractions(self, "epsilon", "delta")


def typical_keep(rows: TargetRows, draft: Draft, params: TypicalOptions):
    """The typicality test as a keep rule: the most probable candidate above the bar, or None."""

    def keep(row: int, candidates: list[int]) -> int | None:
        probs = rows.processed_probs(row)
        bar = min(params.epsilon, params.delta * math.exp(-entropy(probs)))
        best, best_p = None, bar
        for child in candidates:
            p = float(probs[draft.tokens[child]])
            if p > best_p:
                best, best_p = child, p
        return best

    return keep


def verify_typical(rows: TargetRows, draft: Draft, params: TypicalOptions) -> Verdict:
    """Typical acceptance over ``rows`` (the target's logits in the verification layout)."""
    return relaxed_walk(rows, draft, typical_keep(rows, draft, params))


@register_verifier("typical", lossless=False)
class Typical(VerifierMethod):
    """Medusa's typical acceptance: keep a token whose target probability beats an entropy-scaled bar (LOSSY)"""

    options = TypicalOptions
    verify = staticmethod(verify_typical)
