"""Greedy verification: keep draft tokens while they equal the target's argmax."""

from __future__ import annotations

import torch

from specdecode.verify.base import Verdict


def verify_greedy(target_logits: torch.Tensor, draft_tokens: list[int]) -> Verdict:
    """target_logits: [k+1, vocab]; row i is the target's prediction after draft token i-1
    (row 0 after the context).  Output equals plain greedy decoding by construction."""
    choices = target_logits.argmax(dim=-1).tolist()
    accepted = 0
    for drafted, chosen in zip(draft_tokens, choices):
        if drafted != chosen:
            break
        accepted += 1
    return Verdict(num_accepted=accepted, next_token=choices[accepted])
