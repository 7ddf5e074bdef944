"""Whether drafting while the target verifies pays here, learnt online (``draft-model`` with ``parallel=true``).

PEARL's worker (:mod:`specdecode.drafters._lookahead`) runs the draft model beside the target's forward.  On
a CPU the two share the cores and the memory bandwidth, so the worker can make decoding slower than drafting
in turn (``docs/results/pearl-bf16-qwen2.5-coder-1.5b``).  Whether it pays depends on
the machine and on what else runs on it, so a drafter asked to draft in parallel times both ways — steps
with the worker and without, alternating, in tokens per second — keeps the faster, and times both again
now and then.  The worker changes when drafts are made, never which: output is the same
either way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specdecode.drafters.base import flag_option
from specdecode.errors import SpecDecodeError


@dataclass
class StepRate:
    """Tokens per second over the steps of one mode in a trial."""

    seconds: float = 0.0
    tokens: float = 0.0

    def add(self, seconds: float, tokens: int) -> None:
        self.seconds += seconds
        self.tokens += tokens

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class ParallelSwitch:
    """Which mode the next step drafts in, shared by a drafter's sessions.

    A trial alternates the modes step by step for ``2 * trial`` steps, so that both see the same text (how
    much is drafted and accepted changes along a request far more than the mode changes a step's time); the
    faster then runs for ``settle`` steps, and a new trial follows.  The worker's drafts save drafting in the
    step after its own, so the session moves that saving back to the step whose worker made it."""

    trial: int = 8
    settle: int = 64
    parallel: bool = True  # the mode of the next step
    settled: bool = False  # whether the switch is in a settle phase (else a trial)
    left: int = -1  # steps left in the phase
    rates: dict[bool, StepRate] = field(default_factory=lambda: {True: StepRate(), False: StepRate()})

    def __post_init__(self) -> None:
        if self.left < 0:
            self.left = 2 * self.trial

    def record(self, parallel: bool, seconds: float, tokens: int) -> None:
        """One step's time and the tokens it gained, in the mode it ran in."""
        if seconds <= 0 or tokens <= 0:
            return
        self.left -= 1
        if self.settled:
            if self.left <= 0:  # a new trial, from fresh rates
                self.rates = {True: StepRate(), False: StepRate()}
                self.settled, self.left, self.parallel = False, 2 * self.trial, not self.parallel
            return
        self.rates[parallel].add(seconds, tokens)
        if self.left > 0:
            self.parallel = not parallel
        else:
            self.parallel, self.settled, self.left = self.rates[True].rate > self.rates[False].rate, True, self.settle


def parallel_mode(value: bool | str) -> str:
    """The ``parallel`` option: "off"; "true" (the worker is timed against drafting in turn and runs only
    while it is faster, :mod:`specdecode.drafters._parallel_switch`); or "always"."""
    if str(value).strip().lower() == "always":
        return "always"
    try:
        return "true" if flag_option("parallel", value) else "off"
    except SpecDecodeError:
        raise SpecDecodeError(f"parallel must be true, false or always, got {value!r}") from None
