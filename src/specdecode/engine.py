"""The speculative decoding loop: propose → verify in one target forward → accept → roll back.

Invariant between steps: the target's KV cache holds ``context[:-1]``; the last context token (the
one the target itself chose last step) is fed together with the draft.  One forward over
``[context[-1], d_1 .. d_k]`` gives k+1 rows of logits: row i predicts what follows d_i (row 0 what
follows the context).  The verifier keeps n <= k draft tokens and supplies one more token of its
own, the cache is cropped to ``context + d_1..d_n`` and the loop continues.  With no draft this is
exactly plain autoregressive decoding, which is why ``--drafter none`` is the baseline.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from specdecode.config import GenerationConfig
from specdecode.drafters.base import Draft, Drafter
from specdecode.models.base import CausalLM
from specdecode.stats import GenerationStats
from specdecode.verify.greedy import verify_greedy
from specdecode.verify.logits import sampling_probs
from specdecode.verify.sampling import verify_speculative_sampling


@dataclass
class DecodeOutcome:
    """Filled in while :func:`speculative_decode` runs; complete once the iterator is exhausted."""

    stats: GenerationStats = field(default_factory=GenerationStats)
    finish_reason: str = "length"  # "length" (max tokens or context full) or "eos"


def make_generator(seed: int | None) -> torch.Generator:
    """A private RNG: seeded runs are reproducible and never disturb torch's global RNG."""
    generator = torch.Generator()
    generator.manual_seed(seed if seed is not None else secrets.randbits(63))
    return generator


def speculative_decode(
    target: CausalLM,
    drafter: Drafter,
    prompt_ids: list[int],
    config: GenerationConfig,
    eos_ids: frozenset[int] = frozenset(),
    outcome: DecodeOutcome | None = None,
) -> Iterator[list[int]]:
    """Yield the tokens accepted at each step (never empty) until EOS, max tokens or a full context."""
    outcome = outcome if outcome is not None else DecodeOutcome()
    stats = outcome.stats
    sampling = config.sampling
    generator = make_generator(sampling.seed)
    stop_ids = frozenset() if config.ignore_eos else eos_ids
    started = time.perf_counter()

    drafter.start(list(prompt_ids), sampling)
    cache = target.new_cache()
    if len(prompt_ids) > 1:
        target.forward(torch.tensor(prompt_ids[:-1], dtype=torch.long), cache, logits_rows=slice(-1, None))
    stats.prefill_s = time.perf_counter() - started

    context = list(prompt_ids)
    while stats.new_tokens < config.max_new_tokens and len(context) < target.max_context:
        # Every draft token costs a cache slot and the target adds one token of its own per step.
        room = min(config.max_new_tokens - stats.new_tokens - 1, target.max_context - len(context))
        budget = min(config.num_draft_tokens, room)

        tick = time.perf_counter()
        draft = drafter.propose(context, budget) if budget > 0 else Draft(tokens=[])
        tokens = draft.tokens[:budget]
        draft_probs = draft.probs[: len(tokens)] if draft.probs is not None else None
        tock = time.perf_counter()
        stats.draft_s += tock - tick

        logits = target.forward(torch.tensor([context[-1], *tokens], dtype=torch.long), cache).logits
        if sampling.greedy:
            verdict = verify_greedy(logits, tokens)
        else:
            target_probs = sampling_probs(logits, sampling)
            verdict = verify_speculative_sampling(target_probs, tokens, draft_probs, generator)
        cache.crop(len(context) + verdict.num_accepted)
        stats.verify_s += time.perf_counter() - tock
        stats.record_step(len(tokens), verdict.num_accepted)

        new_tokens = [*tokens[: verdict.num_accepted], verdict.next_token]
        new_tokens = new_tokens[: config.max_new_tokens - stats.new_tokens]
        eos_at = next((i for i, tok in enumerate(new_tokens) if tok in stop_ids), None)
        if eos_at is not None:
            new_tokens = new_tokens[: eos_at + 1]
        context.extend(new_tokens)
        stats.new_tokens += len(new_tokens)
        tick = time.perf_counter()
        drafter.observe(context, verdict.num_accepted)
        stats.draft_s += time.perf_counter() - tick
        stats.wall_s = time.perf_counter() - started
        yield new_tokens
        if eos_at is not None:
            outcome.finish_reason = "eos"
            return
    stats.wall_s = time.perf_counter() - started
