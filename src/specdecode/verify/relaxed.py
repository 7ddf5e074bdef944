"""The walk the relaxed (lossy) verifiers share: exact matching, plus a rule that may keep a mismatch.

Both relaxed verifiers extend the exact rule and never shrink it: at every row the target first makes its
own choice exactly as the exact verifier would (the argmax when greedy, the Gumbel-max sample when seeded and
coupled, a draw from the processed distribution otherwise), and a child equal to it is always kept.  Only
where no child matches does the verifier's ``keep`` rule get a say; a kept mismatch is what makes the output
differ from the target's own.  With ``window`` > 0 (FLy) a kept mismatch is provisional: the next ``window``
draft tokens must then match exactly, else the path is cut back to the mismatch and the target's own choice
there is emitted — exactly what the exact verifier would have produced at that point.  A draft that ends
inside the window cannot vouch for the mismatch, so it is rolled back too (never trusted on no evidence).

Trees are walked like :func:`specdecode.verify.greedy.verify_greedy`: one child per row, the exact match
first, else the child ``keep`` picks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specdecode.types import Draft, Verdict, children_by_row
from specdecode.verify.base import TargetRows

#: ``keep(row, candidates)``: which of the candidate child nodes (none equal to the target's choice) to keep
#: at logits row ``row``, or None.
KeepRule = Callable[[int, list[int]], "int | None"]


def entropy(probs: torch.Tensor) -> float:
    """Shannon entropy in nats (0 log 0 = 0)."""
    return float(torch.special.entr(probs).sum())


def relaxed_walk(rows: TargetRows, draft: Draft, keep: KeepRule, window: int = 0) -> Verdict:
    """Walk the draft tree: exact matches always, a mismatch when ``keep`` allows (outside a pending window);
    a mismatch kept with ``window`` > 0 stands only once ``window`` exact matches follow it."""
    children = children_by_row(draft)
    path: list[int] = []
    row, position = 0, rows.first_position
    pending: tuple[int, int] | None = None  # (path length before the provisional node, the target's token there)
    left = 0  # exact matches the pending window still needs
    while True:
        chosen = rows.choice(row, position)
        match = next((c for c in children[row] if draft.tokens[c] == chosen), None)
        if match is None and pending is None and children[row]:
            match = keep(row, children[row])
            if match is not None and window > 0:
                pending, left = (len(path), chosen), window
                path.append(match)
                row, position = match + 1, position + 1
                continue
        if match is None:
            if pending is not None:  # the target disagreed (or the draft ended) inside the window: roll back
                return Verdict(path=tuple(path[: pending[0]]), next_token=pending[1])
            return Verdict(path=tuple(path), next_token=chosen)
        path.append(match)
        if pending is not None:
            left -= 1
            if left == 0:
                pending = None
        row, position = match + 1, position + 1
