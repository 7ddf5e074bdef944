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

import torch

from specdecode.config import RelaxedParams
from specdecode.types import Draft, Verdict
from specdecode.verify.relaxed import TargetRows, entropy, relaxed_walk


def fly_keep(rows: TargetRows, draft: Draft, params: RelaxedParams):
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


def verify_fly(rows: TargetRows, draft: Draft, params: RelaxedParams) -> Verdict:
    """Entropy gate plus deferred window over ``rows`` (the target's logits in the verification layout)."""
    return relaxed_walk(rows, draft, fly_keep(rows, draft, params), window=params.window)
