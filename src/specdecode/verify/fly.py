"""FLy-style loose verification (Li et al., "Training-Free Loosely Speculative Decoding: Accepting
Semantically Correct Drafts Beyond Exact Match"), LOSSY: the output is no longer the target's own.

Two tiers decide whether a mismatch between the draft and the target is an alternative or an error:

* an entropy gate: only where the target's distribution is flat — its entropy over log(vocabulary), the
  normalised entropy in [0, 1], at least ``entropy`` — may a mismatch be an alternative (a nearly
  deterministic row, a keyword or a closing bracket, is never relaxed).  The draft token must also be a
  plausible choice there: among the target's ``top_k`` and with probability at least ``min_prob``.
  The gate reads the raw distribution (temperature 1, nothing cut), the model's own uncertainty, whatever
  the request's sampling settings;
* a deferred window: the kept mismatch is provisional.  If it was an error the target shows it by
  disagreeing with what follows, so the next ``window`` draft tokens must match the target exactly; if one
  does not (or the draft ends first) the step rolls back to the mismatch and emits the target's own token.

With ``window`` = 0 the gate alone decides.  Works with every drafter, chains and trees (see
:mod:`specdecode.verify.relaxed` for the walk).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from specdecode.types import Draft, Verdict
from specdecode.verify.base import TargetRows, VerifierMethod, check_fractions, check_integers
from specdecode.verify.registry import register_verifier
from specdecode.verify.relaxed import entropy, relaxed_walk


@dataclass(frozen=True)
class FlyOptions:
    """At a row where the draft token differs from the target's choice, the mismatch is kept provisionally when
    the target's distribution there is flat (entropy over log(vocabulary) >= ``entropy``) and the draft token is
    among the target's ``top_k`` most likely with probability >= ``min_prob``; it stands only if the next
    ``window`` draft tokens then match the target exactly, else the step rolls back to the mismatch."""

    entropy: float = 0.1
    top_k: int = 5
    min_prob: float = 0.05
    window: int = 3

    def __post_init__(self) -> None:
        check_fractions(self, "entropy", "min_prob")
        check_integers(self, top_k=1, window=0)


def fly_keep(rows: TargetRows, draft: Draft, params: FlyOptions):
    """The gate as a keep rule: the most probable candidate that passes it, or None."""

    def keep(row: int, candidates: list[int]) -> int | None:
        probs = rows.raw_probs(row)
        if entropy(probs) < params.entropy * math.log(probs.shape[-1]):
            return None
        best, best_p = None, params.min_prob
        for child in candidates:
            p = float(probs[draft.tokens[child]])
            rank = int(torch.count_nonzero(probs > p))  # tokens strictly more likely than the draft's
            if p >= best_p and rank < params.top_k:
                best, best_p = child, p
        return best

    return keep


def verify_fly(rows: TargetRows, draft: Draft, params: FlyOptions) -> Verdict:
    """Entropy gate plus deferred window over ``rows`` (the target's logits in the verification layout)."""
    return relaxed_walk(rows, draft, fly_keep(rows, draft, params), window=params.window)


@register_verifier("fly", lossless=False)
class Fly(VerifierMethod):
    """FLy: a mismatch where the target is unsure is kept if the next draft tokens then match (LOSSY)"""

    options = FlyOptions
    verify = staticmethod(verify_fly)
