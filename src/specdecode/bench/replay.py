"""Replay a draft-length policy against a known greedy output, without running the target.

Greedy decoding is lossless, so every policy produces the plain greedy output.  For a drafter that reads
only the context (``pld``, ``suffix``, ``cacheback``: not the target's logits), which draft tokens the
target accepts then follows from that output alone, and a step's time from the measured verification
cost curve.  This makes comparing policies deterministic and nearly free of CPU, where timing real runs
on a shared machine is slow and noisy (``tools/replay_draft_length.py`` tabulates it for the quick suite).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdecode.config import SamplingParams
from specdecode.draft_length import DraftLengthPolicy, StepObservation
from specdecode.drafters.base import Draft, Drafter, StepFeedback
from specdecode.verify.base import children_by_row


@dataclass(frozen=True)
class StepCosts:
    """Seconds a step takes: a target forward over ``width`` inputs costs ``one_input_s * curve[width - 1]``
    (extrapolated linearly past the curve), drafting ``draft_s`` whenever a draft was asked for, and every
    step ``overhead_s`` more (plain decoding too)."""

    one_input_s: float
    curve: tuple[float, ...]
    draft_s: float = 0.0
    overhead_s: float = 0.0

    def verify_s(self, width: int) -> float:
        curve = self.curve
        if width <= len(curve):
            return self.one_input_s * curve[width - 1]
        slope = (curve[-1] - curve[0]) / (len(curve) - 1) if len(curve) > 1 else 0.0
        return self.one_input_s * (curve[-1] + slope * (width - len(curve)))


@dataclass(frozen=True)
class ReplayResult:
    tokens: int
    steps: int
    drafted: int  # draft tokens verified
    accepted: int
    seconds: float
    plain_seconds: float  # the same tokens decoded one per step

    @property
    def speedup(self) -> float:
        return self.plain_seconds / self.seconds if self.seconds else 1.0


def accepted_path(draft: Draft, expected: Sequence[int]) -> list[int]:
    """Nodes greedy verification keeps when the target's next tokens are ``expected``."""
    children = children_by_row(draft)
    path: list[int] = []
    row = 0
    while len(path) < len(expected):
        match = next((c for c in children[row] if draft.tokens[c] == expected[len(path)]), None)
        if match is None:
            break
        path.append(match)
        row = match + 1
    return path


def replay(
    drafter: Drafter, policy: DraftLengthPolicy, prompt_ids: list[int], output_ids: list[int], costs: StepCosts
) -> ReplayResult:
    """Speculative greedy decoding of ``output_ids`` after ``prompt_ids`` as the engine runs it (same
    depth requests, confidence trimming and observations), with step times taken from ``costs``."""
    drafter.start(list(prompt_ids), SamplingParams())
    drafter.stop_rule = policy.should_stop
    context, done, steps, drafted, accepted, seconds = list(prompt_ids), 0, 0, 0, 0, 0.0
    total = len(output_ids)
    no_logits = torch.empty(0)
    while done < total:
        room = total - done - 1
        max_depth = policy.next_length(room) if room > 0 else 0
        draft = drafter.propose(context, max_depth) if max_depth > 0 else Draft(tokens=[])
        chain = draft.is_chain
        if draft.confidence is not None and chain:
            max_depth = min(max_depth, policy.keep_length(draft.confidence))
        draft = draft.limited(len(draft.tokens), max_depth)
        path = accepted_path(draft, output_ids[done:total - 1])
        nodes = len(draft.tokens)
        draft_s = costs.draft_s if max_depth > 0 else 0.0
        verify_s = costs.verify_s(nodes + 1)
        policy.observe(StepObservation(
            depth=nodes if chain else max(draft.depths(), default=0), nodes=nodes, accepted=len(path),
            draft_s=draft_s, verify_s=verify_s, overhead_s=costs.overhead_s,
            confidence=tuple(draft.confidence) if chain and draft.confidence is not None else None,
        ))
        seconds += costs.overhead_s + draft_s + verify_s
        steps, drafted, accepted = steps + 1, drafted + nodes, accepted + len(path)
        done += len(path) + 1
        context = list(prompt_ids) + list(output_ids[:done])
        drafter.observe(context, StepFeedback(draft=draft, path=tuple(path), target_logits=no_logits))
    plain = total * (costs.overhead_s + costs.verify_s(1))
    return ReplayResult(total, steps, drafted, accepted, seconds, plain)
