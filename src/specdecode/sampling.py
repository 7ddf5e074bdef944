"""Turn logits into the sampling distribution (temperature, then min-p, top-k, top-p) and draw from it.

Shared by drafters (which sample drafts) and verifiers (which sample corrections): both import it
from here, never from each other.  That is also why the keyed Gumbel noise of coupled sampling lives
here: the verifier and a drafter that samples must read the very same noise for a position.

Applied identically to target and draft logits.  The order matches transformers' and vLLM's
(temperature scales before the nucleus is cut, so top-p sees the tempered distribution).
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
import torch

from specdecode.sampling_params import SamplingParams
from specdecode.types import TokenLogprob

#: Noise vectors kept (one per (seed, position, vocabulary size)): a step needs depth + 1 positions per
#: sequence, and a drafter's noise for a position is read again by the verifier in the same step.  At a
#: 152k vocabulary one entry is 0.6 MB.
NOISE_CACHE_SIZE = 64

#: How many of the most likely tokens :func:`_top_p_drop` looks at first, then next, before sorting the
#: whole vocabulary.
NUCLEUS_CANDIDATES = (256, 4096)


#: Temperatures so small (a request may send a float64 subnormal) that logits / temperature overflows float32.
LIMIT_BELOW_TEMPERATURE = 1e-20


def _tempered_top_k(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then min-p and top-k (cut tokens at -inf): the first stages of the processed distribution."""
    logits = logits.float()
    if params.temperature < LIMIT_BELOW_TEMPERATURE:
        # Divided, the largest logits would overflow to inf (or the temperature round to 0 in float32) and softmax
        # give nan: the distribution is taken at its limit instead, the argmax (ties sharing it equally).
        logits = torch.where(logits == logits.amax(dim=-1, keepdim=True), 0.0, float("-inf"))
    else:
        logits = logits / params.temperature
    if params.min_p > 0.0:
        # p(v) < min_p * max p  <=>  logit(v) < max logit + log(min_p): no softmax needed (vLLM's order: after the
        # temperature, before top-k and top-p).
        floor = logits.amax(dim=-1, keepdim=True) + math.log(params.min_p)
        logits = logits.masked_fill(logits < floor, float("-inf"))
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return logits


def _top_p_drop(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The tokens outside the nucleus: a token is dropped when the mass *before* it (most likely first)
    already reaches ``top_p``, so the kept set is the smallest prefix reaching it; the top token stays.

    Sorting a 152k vocabulary costs ~9 ms a row on a CPU, as much as a tenth of a 1.5B target's forward,
    and verification reads depth + 1 rows a step.  A nucleus is rarely more than a few hundred tokens, so
    the largest :data:`NUCLEUS_CANDIDATES` come first (``topk``: ~0.3 ms a row); only rows whose
    candidates do not reach ``top_p`` try the next size, the whole sort last.  The kept set is the one a
    full sort gives: once the candidates' mass reaches ``top_p`` every later token would be dropped.  Timings:
    ``docs/results/avx2/top_p_timing.txt``."""
    vocab = probs.shape[-1]
    for size in NUCLEUS_CANDIDATES:
        if size < vocab:
            candidates, order = torch.topk(probs, size, dim=-1)
            mass = torch.cumsum(candidates, dim=-1)
            if bool((mass[..., -1] >= top_p).all()):
                return _drop_outside_nucleus(candidates, mass, order, top_p, probs.shape)
    candidates, order = torch.sort(probs, dim=-1, descending=True)
    return _drop_outside_nucleus(candidates, torch.cumsum(candidates, dim=-1), order, top_p, probs.shape)


def _drop_outside_nucleus(
    sorted_probs: torch.Tensor, mass: torch.Tensor, order: torch.Tensor, top_p: float, shape: torch.Size
) -> torch.Tensor:
    """The drop mask over the whole vocabulary from the most likely tokens in order (indices ``order``,
    cumulative ``mass``): tokens not among them are dropped too."""
    keep_sorted = mass - sorted_probs < top_p
    keep_sorted[..., 0] = True
    keep = torch.zeros(shape, dtype=torch.bool, device=sorted_probs.device).scatter(-1, order, keep_sorted)
    return ~keep


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[..., vocab] logits → [..., vocab] float32 probabilities.  Greedy gives a one-hot argmax."""
    if params.greedy:
        logits = logits.float()
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    probs = torch.softmax(_tempered_top_k(logits, params), dim=-1)
    if params.top_p < 1.0:
        probs = probs.masked_fill(_top_p_drop(probs, params.top_p), 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sampling_log_weights(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[..., vocab] logits → the log-probabilities of :func:`sampling_probs` up to a constant per row:
    tempered logits, -inf outside top-k and the nucleus (the same support).  Gumbel-max needs nothing
    more — the argmax is blind to the constant — and skipping the normalisation saves a pass over the
    vocabulary.  Not for greedy parameters (temperature 0)."""
    weights = _tempered_top_k(logits, params)
    if params.top_p < 1.0:
        weights = weights.masked_fill(_top_p_drop(torch.softmax(weights, dim=-1), params.top_p), float("-inf"))
    return weights


@lru_cache(maxsize=NOISE_CACHE_SIZE)
def _noise(seed: int, position: int, vocab: int) -> torch.Tensor:
    # Philox is counter-based: the key (seed, position) alone fixes the stream, so the noise of a
    # position does not depend on which positions were drawn before or how (stateless).  G = -log E with
    # E ~ Exp(1) is Gumbel(0, 1); numpy's ziggurat exponentials are the cheapest route (about 1 ms for
    # 152k draws), computed in float64 so no draw is rounded to an infinite or a tied value.
    rng = np.random.Generator(np.random.Philox(key=(position << 64) | (seed % 2**64)))
    return torch.from_numpy(-np.log(rng.standard_exponential(vocab)).astype(np.float32))


def gumbel_noise(seed: int, position: int, vocab: int) -> torch.Tensor:
    """[vocab] float32 Gumbel(0, 1) noise keyed by (seed, absolute position) alone: whoever asks — the
    verifier, a drafter, plain decoding — gets the same vector, which is what makes coupled sampling's
    output independent of the drafter.  Entry v is the same for every ``vocab`` > v (a draft model with
    a padded head reads the target's noise).  Cached; treat the result as read-only."""
    if position < 0:
        raise ValueError(f"a position is >= 0, got {position}")
    return _noise(int(seed), int(position), int(vocab))


def argmax_last(values: torch.Tensor) -> int | list[int]:
    """``values.argmax(-1)`` as Python ints (an int for a vector, a list for a matrix); ties go to the first
    index, as with torch.  On the CPU numpy finds it several times faster than torch's argmax for a few rows
    over a large vocabulary; the verifier takes one per step, a greedy or coupled drafter one per draft token."""
    if values.device.type == "cpu" and values.dtype in (torch.float32, torch.float64):
        return values.detach().numpy().argmax(-1).tolist()
    return values.argmax(-1).tolist()


def coupled_sample(logits: torch.Tensor, params: SamplingParams, seed: int, position: int) -> int:
    """The Gumbel-max sample of the processed distribution of ``logits`` ([vocab]) at absolute position
    ``position``: argmax_v(log p(v) + G_{seed,position}(v)), a draw from p, and a deterministic
    function of (p, seed, position).  Greedy parameters give the plain argmax."""
    if params.greedy:
        return argmax_last(logits)
    return coupled_argmax(sampling_log_weights(logits, params), seed, position)


def coupled_argmax(log_weights: torch.Tensor, seed: int, position: int) -> int:
    """argmax_v(log_weights(v) + G_{seed,position}(v)) for [vocab] log-weights already processed (any
    constant offset): for callers that also need the weights (a drafter's confidence)."""
    noise = gumbel_noise(seed, position, log_weights.shape[-1]).to(log_weights.device)
    return argmax_last(log_weights + noise)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Draw one token id from a [vocab] distribution."""
    return int(torch.multinomial(probs, 1, generator=generator).item())


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """Each row's log-probability of its token (``logits``: [len(tokens), vocab]), with the row's ``top`` most likely
    tokens' (most likely first)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1).cpu()
    chosen = logprobs[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()
    best: list[tuple[tuple[int, float], ...]] = [()] * len(tokens)
    if top:
        values, ids = torch.topk(logprobs, min(top, logprobs.shape[-1]), dim=-1)
        best = [tuple(zip(i.tolist(), v.tolist())) for i, v in zip(ids, values)]
    return [TokenLogprob(*entry) for entry in zip(tokens, chosen, best)]
