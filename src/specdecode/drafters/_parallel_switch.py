"""Whether drafting while the target verifies pays here, learnt online (``draft-model`` with ``parallel=true``).

PEARL's worker (:mod:`specdecode.drafters._lookahead`) runs the draft model beside the target's forward.  On
a CPU the two share the cores and the memory bandwidth: with ``qwen2.5-coder-1.5b`` (bf16, int4 0.5B draft)
on 2 cores the worker made decoding 1.41x plain against 1.89x drafting in turn.  Whether it pays depends on
the machine and on what else runs on it, so a drafter asked to draft in parallel times both ways — the
steps it takes with the worker and those without, in tokens per second — keeps the faster, and tries the
other again now and then.  The worker changes when drafts are made, never which: output is the same
either way.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepRate:
    """Tokens per second over recent steps of one mode (decayed sums, so a slow machine phase fades)."""

    decay: float = 0.9
    seconds: float = 0.0
    tokens: float = 0.0
    steps: int = 0

    def add(self, seconds: float, tokens: int) -> None:
        self.seconds = self.seconds * self.decay + seconds
        self.tokens = self.tokens * self.decay + tokens
        self.steps += 1

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class ParallelSwitch:
    """Which mode the next step drafts in, shared by a drafter's sessions.

    Phases: ``trial`` steps with the worker, ``trial`` without, then ``settle`` steps in the faster mode,
    ``trial`` in the other, and so on; each phase ends with a comparison of the two rates."""

    trial: int = 8
    settle: int = 64
    parallel: bool = True  # the mode of the current phase
    settled: bool = False  # whether the current phase is a settle phase (else a trial)
    left: int = -1
    rates: dict[bool, StepRate] = field(default_factory=lambda: {True: StepRate(), False: StepRate()})

    def __post_init__(self) -> None:
        if self.left < 0:
            self.left = self.trial

    def record(self, parallel: bool, seconds: float, tokens: int) -> None:
        """One step's time and the tokens it gained, in the mode it ran in."""
        if seconds <= 0 or tokens <= 0:
            return
        self.rates[parallel].add(seconds, tokens)
        self.left -= 1
        if self.left > 0:
            return
        if not self.rates[not self.parallel].steps:  # the other mode is still unmeasured
            self.parallel, self.settled, self.left = not self.parallel, False, self.trial
            return
        if self.settled:  # try the other mode again (its rate may be old)
            self.parallel, self.settled, self.left = not self.parallel, False, self.trial
        else:
            faster = self.rates[True].rate > self.rates[False].rate
            self.parallel, self.settled, self.left = faster, True, self.settle
