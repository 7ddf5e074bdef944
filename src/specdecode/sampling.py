"""Turn logits into the sampling distribution (temperature, then top-k, then top-p) and draw from it.

Shared by drafters (which sample drafts) and verifiers (which sample corrections): both import it
from here, never from each other.

Applied identically to target and draft logits.  The order matches transformers' and vLLM's
(temperature scales before the nucleus is cut, so top-p sees the tempered distribution).
"""

from __future__ import annotations

import torch

from specdecode.config import SamplingParams


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[..., vocab] logits → [..., vocab] float32 probabilities.  Greedy gives a one-hot argmax."""
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p: a token is dropped when the mass
        # *before* it already reaches top_p.  The most likely token is always kept.
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop_sorted = mass_before >= params.top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Draw one token id from a [vocab] distribution."""
    return int(torch.multinomial(probs, 1, generator=generator).item())
