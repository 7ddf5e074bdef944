"""Our methods decode one prompt in turns, a step at a time (lockstep), each timed over its own turns only.

Why: on a shared host the time of one request varies from run to run by more than the differences measured
(other tenants' load on the cores and the memory bus comes and goes within seconds), so a method timed after
plain decoding, request by request, may read well above or below it while both do the very same work.  Taking
turns — a few hundredths of a second each — puts every method's steps next to plain decoding's steps, so a
burst of load falls on all of them alike (two plain decodings timed so agree far more closely:
``docs/results/quick-every-lockstep-epyc-r5``).  The turn goes to whichever request has the fewest tokens so
far, so a method that yields five tokens a step takes a step while plain decoding takes five, and both
requests span the same stretch of time.

A method's time is the sum of its turns: everything its request does — prefill, drafting, verification,
detokenising — happens inside its turns, and nothing of it runs between them (a drafter whose worker drafts
ahead between steps, ``Drafter.works_between_steps``, is therefore timed request by request instead).  Each
request reads its own clock (:mod:`specdecode.clock`), held while the others take their turns, so the engine's
per-step prices and the adaptive draft length see what they would see running alone.
"""

from __future__ import annotations

import contextvars
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from specdecode import clock
from specdecode.bench.contestants import Measurement
from specdecode.generator import GenerationResult, StreamEvent


@dataclass
class _Turns:
    """One contestant's request in progress: its events, its context (its clock) and its time so far."""

    events: Iterator[StreamEvent]
    left_at: float  # wall time at the end of its last turn (or when it joined)
    context: contextvars.Context = field(default_factory=contextvars.copy_context)
    spent_s: float = 0.0
    tokens: int = 0  # generated so far
    result: GenerationResult | None = None

    def take(self) -> bool:
        """One turn: pull the next event.  False once the request is over."""
        begun = time.perf_counter()
        event = self.context.run(_resume, self.events, begun - self.left_at)
        self.left_at = time.perf_counter()
        self.spent_s += self.left_at - begun
        if event is not None:
            self.tokens += len(event.token_ids)
            self.result = event.result
        return event is not None and self.result is None


def _resume(events: Iterator[StreamEvent], held_s: float) -> StreamEvent | None:
    clock.hold(held_s)
    return next(events, None)


def run_lockstep(
    streams: dict[str, Iterator[StreamEvent]], ties: random.Random | None = None
) -> dict[str, Measurement]:
    """Pull the streams' events in turns until every request is over → each one's tokens, the seconds of its
    own turns and its stats.  The turn goes to the request with the fewest tokens so far, so all of them
    advance through their tokens together and span the same stretch of time, however many tokens a step of
    each yields.  Among equals ``ties`` draws who goes first (None: the given order), so that no request
    always steps right after the same neighbour: a fixed order can bias the A/A control
    (``docs/results/quick-every-lockstep-epyc-r5``), a drawn one makes any such effect noise rather than bias."""
    joined = time.perf_counter()
    turns = {name: _Turns(events, joined) for name, events in streams.items()}
    live = list(turns.values())
    draw = ties.random if ties is not None else (lambda: 0.0)
    while live:
        behind = min(live, key=lambda request: (request.tokens, draw()))
        if not behind.take():
            live.remove(behind)
    measured = {}
    for name, request in turns.items():
        if request.result is None:
            raise AssertionError("a stream ends with its result")
        measured[name] = Measurement(request.result.token_ids, request.spent_s, request.result.stats)
    return measured
