"""How deep each sequence of a batched step drafts: one verification forward is shared, so the depths are
chosen together (:func:`plan_batch`); each sequence's own policy (:mod:`specdecode.draft_length`) says what
its drafts are expected to gain."""

from __future__ import annotations

from collections.abc import Sequence

from specdecode.draft_length.base import DraftLengthPolicy

#: How much longer than a plain step (no drafts) a batched step may take, as a fraction: a sequence whose draft is
#: rejected waits up to this much longer for its one token, and a larger value lets the plan draft deeper.  The
#: serving workload's tokens per second at concurrency 8 against values from 0.08 to 2 (fp32 panel products, whose
#: cost grows little to ~16 rows), and the served run's inter-token latencies at this value, are in
#: docs/results/serve-vllm-cpu-slack-smollm2-135m/; smaller values on bf16 (0.08, 0.15) in
#: docs/results/serve-slack-repeats-bf16-smollm2-135m/.
STEP_COST_SLACK = 1.0


def plan_batch(
    policies: list[DraftLengthPolicy],
    limits: list[int],
    proposed: Sequence[Sequence[float] | None] | None = None,
) -> list[int]:
    """Each sequence's draft depth for one batched step (``limits``: at most this deep).

    Sequences whose policies plan with the batch (``auto``) share one verification forward whose width is the
    sum of their drafts, so their depths are chosen together to maximise the batch's expected tokens per second:
    starting from no drafts, the depth increase with the best gain in that rate is taken while there is one.  As
    the batch grows the forward's width gets dearer, so each sequence drafts less (vLLM shrinks its draft length
    with the batch for the same reason).  Other policies choose alone.

    ``proposed[i]``, when given, holds the confidences of a chain sequence i has already drafted (a drafter
    whose proposals cost next to nothing drafts before the plan): its expected tokens then come from that
    draft's own calibrated confidences rather than from the sequence's average acceptance, its drafting
    costs nothing more, and it is never planned deeper than the draft.  Prompt lookup's long matches are
    accepted far more often than its short ones: the plan spends the width on them."""
    known = list(proposed) if proposed is not None else [None] * len(policies)
    joint = [i for i, policy in enumerate(policies) if policy.plans_with_batch]
    if len(joint) <= 1:
        return [policy.depth_alone(limit, draft) for policy, limit, draft in zip(policies, limits, known)]
    depths = [
        0 if i in joint else policy.depth_alone(limit, draft)
        for i, (policy, limit, draft) in enumerate(zip(policies, limits, known))
    ]
    offers = [policies[i].depth_offer(limits[i], known[i]) for i in joint]
    # The sequences of one drafter share the cost curves and their scale; a forward's extra rows attend over their
    # own sequences' contexts, so the batch's is priced at their mean.
    context = sum(offer.context_tokens for offer in offers) // len(offers)
    priced: dict[int, float] = {}  # the search below asks for the same few widths many times

    def verify_seconds(width: int) -> float:
        if width not in priced:
            priced[width] = offers[0].verify_seconds(width, context)
        return priced[width]

    fixed = sum(depths[i] + 1 for i in range(len(policies)) if i not in joint)
    chosen = [0] * len(offers)
    width = fixed + len(offers)
    tokens = sum(offer.tokens[0] for offer in offers)
    other = sum(offer.overhead_s for offer in offers)  # overheads, plus the drafts chosen so far
    verify = verify_seconds(width)
    # Every sequence waits for the whole step: keep it within STEP_COST_SLACK of a plain step, so that a
    # sequence whose draft is rejected does not wait much longer for its one token than without drafting.
    longest = verify * (1.0 + STEP_COST_SLACK)
    while True:
        rate, best = tokens / (other + verify), None
        for j, offer in enumerate(offers):
            now = chosen[j]
            for k in range(now + 1, offer.cap + 1):
                if verify_seconds(width + k - now) > longest:
                    break
                trial = (tokens - offer.tokens[now] + offer.tokens[k]) / (
                    other - offer.draft_s[now] + offer.draft_s[k] + verify_seconds(width + k - now)
                )
                if trial > rate:
                    rate, best = trial, (j, k)
        if best is None:
            break
        j, k = best
        now, offer = chosen[j], offers[j]
        tokens += offer.tokens[k] - offer.tokens[now]
        other += offer.draft_s[k] - offer.draft_s[now]
        width += k - now
        verify = verify_seconds(width)
        chosen[j] = k
    for j, i in enumerate(joint):
        depths[i] = policies[i].take_depth(offers[j], chosen[j], limits[i], known[i])
    return depths
