"""The clock a request reads: wall time, less the time a benchmark held the request aside.

The benchmark can decode several requests in turns, a step at a time (lockstep, :mod:`specdecode.bench.lockstep`),
so that a burst of load from other processes falls on all of them alike.  A request's own clock must then
not run while the others take their turns: the engine prices a step's overhead from the gap since the
previous step, the adaptive draft length learns from those prices, and the stats report a request's wall
time.  :func:`now` is :func:`time.perf_counter` minus the time held aside in the current context; outside a
lockstep nothing is ever held, so it is plain wall time.  Durations inside one step (a forward, a draft)
never span a hold, so they may read either clock.
"""

from __future__ import annotations

import time
from contextvars import ContextVar

_held_s: ContextVar[float] = ContextVar("specdecode_held_s", default=0.0)


def now() -> float:
    """Seconds on this context's clock (wall time while never held)."""
    return time.perf_counter() - _held_s.get()


def hold(seconds: float) -> None:
    """Stop this context's clock for ``seconds`` of wall time that belonged to other work: call it inside
    the context (``contextvars.Context.run``) before resuming the request."""
    _held_s.set(_held_s.get() + seconds)
