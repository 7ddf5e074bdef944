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
from specdecode.draft_length import DraftLengthPolicy, StepObservation, make_policy
from specdecode.drafters.base import Draft, Drafter, StepFeedback
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
    draft_length: DraftLengthPolicy | None = None,
) -> Iterator[list[int]]:
    """Yield the tokens accepted at each step (never empty) until EOS, max tokens or a full context.

    ``draft_length`` decides the depth of each draft (default: from ``config.num_draft_tokens``); pass
    one policy object across requests to let an adaptive policy keep what it learned."""
    outcome = outcome if outcome is not None else DecodeOutcome()
    draft_length = draft_length if draft_length is not None else make_policy(config.num_draft_tokens)
    stats = outcome.stats
    sampling = config.sampling
    generator = make_generator(sampling.seed)
    stop_ids = frozenset() if config.ignore_eos else eos_ids
    started = time.perf_counter()

    drafter.start(list(prompt_ids), sampling)
    drafter.stop_rule = draft_length.should_stop
    cache = target.new_cache()
    drafter.target_cache = cache
    try:
        if len(prompt_ids) > 1:
            target.forward(torch.tensor(prompt_ids[:-1], dtype=torch.long), cache, logits_rows=slice(-1, None))
        stats.prefill_s = stats.forward_s = time.perf_counter() - started

        context = list(prompt_ids)
        step_end = time.perf_counter()
        while stats.new_tokens < config.max_new_tokens and len(context) < target.max_context:
            # A step adds at most depth + 1 tokens, and every draft node needs a cache slot.
            room = config.max_new_tokens - stats.new_tokens - 1
            max_depth = draft_length.next_length(room) if room > 0 else 0
            max_nodes = target.max_context - len(context)

            tick = time.perf_counter()
            draft = drafter.propose(context, max_depth) if max_depth > 0 else Draft(tokens=[])
            chain = draft.is_chain
            if draft.confidence is not None and chain:
                max_depth = min(max_depth, draft_length.keep_length(draft.confidence))
            draft = draft.limited(max_nodes, max_depth)
            tock = time.perf_counter()
            stats.draft_s += tock - tick

            tokens, positions, tree_mask = _verification_inputs(context, draft, chain)
            forward_start = time.perf_counter()
            logits = target.forward(tokens, cache, positions=positions, tree_mask=tree_mask).logits
            stats.forward_s += time.perf_counter() - forward_start
            if sampling.greedy:
                verdict = verify_greedy(logits, draft)
            else:
                verdict = verify_speculative_sampling(sampling_probs(logits, sampling), draft, generator)
            # Keep the last context token's entry and the accepted nodes' entries (rows 1 + node).
            cache.keep(len(context) - 1, [0, *(1 + node for node in verdict.path)])
            verify_s = time.perf_counter() - tock
            stats.verify_s += verify_s
            nodes = len(draft.tokens)
            step = StepObservation(
                depth=nodes if chain else max(draft.depths(), default=0), nodes=nodes, accepted=verdict.num_accepted,
                draft_s=tock - tick, verify_s=verify_s, overhead_s=tick - step_end,
                confidence=tuple(draft.confidence) if chain and draft.confidence is not None else None,
            )
            stats.record_step(step)
            draft_length.observe(step)

            accepted = [draft.tokens[node] for node in verdict.path]
            new_tokens = [*accepted, verdict.next_token]
            new_tokens = new_tokens[: config.max_new_tokens - stats.new_tokens]
            eos_at = next((i for i, tok in enumerate(new_tokens) if tok in stop_ids), None)
            if eos_at is not None:
                new_tokens = new_tokens[: eos_at + 1]
            context.extend(new_tokens)
            stats.new_tokens += len(new_tokens)
            step_end = time.perf_counter()
            drafter.observe(context, StepFeedback(draft=draft, path=verdict.path, target_logits=logits))
            stats.draft_s += time.perf_counter() - step_end
            stats.wall_s = time.perf_counter() - started
            yield new_tokens
            if eos_at is not None:
                outcome.finish_reason = "eos"
                return
    finally:
        drafter.target_cache = None  # a finished (or abandoned) request's cache is never drafted on
    stats.wall_s = time.perf_counter() - started


def _verification_inputs(
    context: list[int], draft: Draft, chain: bool
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Tokens, positions and tree mask of one target forward over the last context token and the draft.

    A chain needs nothing but the tokens (positions follow the cache, the causal mask does the rest).  A
    tree also gets depth-based positions and a mask that lets each node see only the context, itself and
    its ancestors."""
    tokens = torch.tensor([context[-1], *draft.tokens], dtype=torch.long)
    if chain:
        return tokens, None, None
    base = len(context) - 1
    positions = torch.tensor([base, *(base + d for d in draft.depths())], dtype=torch.long)
    return tokens, positions, ancestor_mask(draft)


def ancestor_mask(draft: Draft) -> torch.Tensor:
    """[nodes + 1, nodes + 1] bool; entry (i, j): row i may attend to row j (row 0 = last context token)."""
    n = len(draft.tokens)
    mask = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    mask[:, 0] = True  # everyone sees the last context token (and, via the cache, the rest)
    for node, parent in enumerate(draft.parent_list):
        row = node + 1
        mask[row] = mask[parent + 1]
        mask[row, row] = True
    return mask
