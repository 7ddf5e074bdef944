"""Greedy verification: follow the target's argmax down the draft tree while a child matches it."""

from __future__ import annotations

import torch

from specdecode.sampling import argmax_last
from specdecode.types import Draft, Verdict, children_by_row


def verify_greedy(target_logits: torch.Tensor, draft: Draft) -> Verdict:
    """target_logits: [nodes + 1, vocab]; row 0 predicts what follows the context, row i + 1 what
    follows node i.  The result equals plain greedy decoding by construction."""
    choices = argmax_last(target_logits)  # one host transfer for the whole tree
    children = children_by_row(draft)
    path: list[int] = []
    row = 0
    while True:
        chosen = choices[row]
        match = next((c for c in children[row] if draft.tokens[c] == chosen), None)
        if match is None:
            return Verdict(path=tuple(path), next_token=chosen)
        path.append(match)
        row = match + 1
