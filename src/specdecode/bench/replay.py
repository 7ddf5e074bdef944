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

from specdecode.config import GenerationConfig
from specdecode.draft_length.base import DraftLengthPolicy
from specdecode.drafters.base import Drafter, DraftRequest, DraftSession
from specdecode.engine import Checked, PromptChunk, step
from specdecode.engine import Sequence as DecodeSequence
from specdecode.models.cost import cost_at
from specdecode.types import Draft, StepFeedback, Verdict, children_by_row


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
        return self.one_input_s * cost_at(self.curve, width)


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


class SimulatedClock:
    """The time the replayed steps would have taken."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _TimedSession(DraftSession):
    """A drafting session whose drafts take ``draft_s`` simulated seconds."""

    def __init__(self, inner: DraftSession, clock: SimulatedClock, draft_s: float) -> None:
        self.inner, self.clock, self.draft_s = inner, clock, draft_s
        self.proposes_first = inner.proposes_first

    def propose(self, context: list[int], max_tokens: int) -> Draft:
        self.clock.now += self.draft_s
        return self.inner.propose(context, max_tokens)

    def observe(self, context: list[int], feedback: StepFeedback) -> None:
        self.inner.observe(context, feedback)


class ReplayVerifier:
    """Stands in for the target: accepts what the known greedy output says and takes the cost curve's time."""

    def __init__(self, output_ids: Sequence[int], costs: StepCosts, clock: SimulatedClock) -> None:
        self.output_ids, self.costs, self.clock = list(output_ids), costs, clock
        self.no_logits = torch.empty(0)

    def __call__(
        self, sequences: list[DecodeSequence], drafts: list[Draft], chunks: list[PromptChunk]
    ) -> list[Checked]:
        """``chunks`` is empty: a replayed sequence has no cache to read its prompt into."""
        checked = []
        for seq, draft in zip(sequences, drafts):
            done = len(seq.context) - len(seq.prompt_ids)
            path = accepted_path(draft, self.output_ids[done : len(self.output_ids) - 1])
            verdict = Verdict(tuple(path), self.output_ids[done + len(path)])
            checked.append(Checked(verdict, self.no_logits))
        self.clock.now += self.costs.verify_s(sum(len(draft.tokens) + 1 for draft in drafts))
        return checked


def replay(
    drafter: Drafter, policy: DraftLengthPolicy, prompt_ids: list[int], output_ids: list[int], costs: StepCosts
) -> ReplayResult:
    """Speculative greedy decoding of ``output_ids`` after ``prompt_ids`` through the engine's own
    :func:`~specdecode.engine.step` (same depth requests, confidence trimming and observations), with the
    target replaced by the known output and step times taken from ``costs``."""
    clock = SimulatedClock()
    total = len(output_ids)
    session = drafter.session(DraftRequest(tuple(prompt_ids), stop_rule=policy.should_stop))
    seq = DecodeSequence(
        prompt_ids=list(prompt_ids),
        config=GenerationConfig(max_new_tokens=total, ignore_eos=True),
        stop_ids=frozenset(),
        session=_TimedSession(session, clock, costs.draft_s),
        length_policy=policy,
        generator=torch.Generator(),
        max_context=2**62,
        started=0.0,  # no cache: nothing limits a draft's size
    )
    verifier = ReplayVerifier(output_ids, costs, clock)
    while not seq.done:
        clock.now += costs.overhead_s
        step([seq], verifier, clock)
    stats = seq.stats
    plain = total * (costs.overhead_s + costs.verify_s(1))
    return ReplayResult(total, stats.steps, stats.drafted_tokens, stats.accepted_tokens, clock.now, plain)
