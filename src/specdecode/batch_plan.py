"""How deep each sequence of a batched step drafts: one verification forward is shared, so the depths are
chosen together (:func:`plan_batch`); each sequence's own policy (:mod:`specdecode.draft_length`) says what
its drafts are expected to gain."""

from __future__ import annotations

from collections.abc import Sequence

from specdecode.draft_length import CostModelLength, DraftLengthPolicy

#: How much longer than a plain step (no drafts) a batched step may take, as a fraction.  Serving smollm2-135m
#: (bf16) at concurrency 8 with prompt lookup rated by its match length: 0.08 gave 1.65-1.68x plain's tokens/s
#: with a p95 inter-token latency 1.03-1.09x plain's over three runs, 0.05 1.53-1.63x at 1.03-1.08x; with the
#: earlier n-gram rating 0.15 gave 1.66-1.78x at 1.07-1.15x.  One 2-core machine: see the README's serving
#: section.
STEP_COST_SLACK = 0.08


def plan_batch(
    policies: list[DraftLengthPolicy],
    limits: list[int],
    proposed: Sequence[Sequence[float] | None] | None = None,
) -> list[int]:
    """Each sequence's draft depth for one batched step (``limits``: at most this deep).

    Sequences under ``auto`` share one verification forward whose width is the sum of their drafts, so
    their depths are chosen together to maximise the batch's expected tokens per second: starting from no
    drafts, the depth increase with the best gain in that rate is taken while there is one.  As the batch
    grows the forward's width gets dearer, so each sequence drafts less (vLLM shrinks its draft length with
    the batch for the same reason).  Other policies choose alone.

    ``proposed[i]``, when given, holds the confidences of a chain sequence i has already drafted (a drafter
    whose proposals cost next to nothing drafts before the plan): its expected tokens then come from that
    draft's own calibrated confidences rather than from the sequence's average acceptance, its drafting
    costs nothing more, and it is never planned deeper than the draft.  Prompt lookup's long matches are
    accepted far more often than its short ones: the plan spends the width on them."""
    known = list(proposed) if proposed is not None else [None] * len(policies)
    auto = [i for i, p in enumerate(policies) if isinstance(p, CostModelLength)]
    depths = [0 if i in auto else p.next_length(limit) for i, (p, limit) in enumerate(zip(policies, limits))]
    if len(auto) <= 1:
        for i in auto:
            policy: CostModelLength = policies[i]  # type: ignore[assignment]
            confidences = known[i]
            depths[i] = (
                policy.next_length(limits[i]) if confidences is None else policy.depth_for_draft(confidences, limits[i])
            )
        return depths
    models: list[CostModelLength] = [policies[i] for i in auto]  # type: ignore[misc]
    drafted = [known[i] for i in auto]
    caps = [m.draft_cap(limits[i], d) for m, i, d in zip(models, auto, drafted)]
    reference = models[0]  # forks share the scale and cost curve
    fixed = sum(depths[i] + 1 for i in range(len(policies)) if i not in auto)
    tokens_at = [
        [m.expected_tokens(k) for k in range(cap + 1)] if d is None else m.expected_tokens_of(d, cap)
        for m, cap, d in zip(models, caps, drafted)
    ]
    draft_at = [
        [m.draft_cost(k) if k and d is None else 0.0 for k in range(cap + 1)]
        for m, cap, d in zip(models, caps, drafted)
    ]
    chosen = [0] * len(models)
    width = fixed + len(models)
    tokens = sum(t[0] for t in tokens_at)
    other = sum(m.overhead.value for m in models)  # overheads, plus the drafts chosen so far
    verify = reference.verify_seconds(width)
    # Every sequence waits for the whole step: keep it within STEP_COST_SLACK of a plain step, so that a
    # sequence whose draft is rejected does not wait much longer for its one token than without drafting.
    longest = verify * (1.0 + STEP_COST_SLACK)
    while True:
        rate, best = tokens / (other + verify), None
        for j, cap in enumerate(caps):
            now = chosen[j]
            for k in range(now + 1, cap + 1):
                if reference.verify_seconds(width + k - now) > longest:
                    break
                trial = (tokens - tokens_at[j][now] + tokens_at[j][k]) / (
                    other - draft_at[j][now] + draft_at[j][k] + reference.verify_seconds(width + k - now)
                )
                if trial > rate:
                    rate, best = trial, (j, k)
        if best is None:
            break
        j, k = best
        now = chosen[j]
        tokens += tokens_at[j][k] - tokens_at[j][now]
        other += draft_at[j][k] - draft_at[j][now]
        width += k - now
        verify = reference.verify_seconds(width)
        chosen[j] = k
    for j, (i, m) in enumerate(zip(auto, models)):
        if drafted[j] is None:
            depths[i] = m.settle(chosen[j], min(m.deepest, limits[i]))
        else:
            depths[i] = m.settle(chosen[j], caps[j], proposed=True)
    return depths
