"""The batched engine behind the server, stepping outside the event loop.

The event loop never runs a model: handlers submit requests and cancel them through thread-safe calls,
the engine's thread admits them between steps, runs :meth:`BatchEngine.step` and hands each request's
accepted tokens back to the event loop that waits for them (``call_soon_threadsafe``).  A cancelled
request (client gone, stop string found) leaves the batch before the next step and its cache slot is free
at once.  If a step fails (a bug), every request then in the engine gets an error instead of a hang and
the worker goes on with a fresh engine.

Which thread steps the engine matters for speed.  torch's OpenMP runtime (libgomp) keeps one pool of worker threads
per thread that ever ran a parallel region, and while more of its threads exist than the process has CPUs it stops
spin-waiting between parallel regions: every one of the ~500 regions of a forward then pays a futex wake-up.  A
model loaded (and so already run) in the main thread and stepped in a second thread leaves two pools alive, and on a
machine with few cores every forward, and so the server's tokens per second, is then markedly slower than with the
same batches stepped in the main thread.  So :meth:`EngineWorker.drive` steps the engine in the calling thread — the
thread that loaded the model (``specdecode serve`` and ``bench serve`` give it their main thread and run uvicorn
beside it) — and :meth:`EngineWorker.start` keeps the own-thread mode for embedders and tests.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from specdecode.batch_engine import BatchEngine, BatchRequest
from specdecode.config import GenerationConfig
from specdecode.drafters.base import Drafter
from specdecode.generator import SpeculativeGenerator
from specdecode.stats import GenerationStats
from specdecode.types import TokenLogprob

log = logging.getLogger("specdecode.server")


#: Positions of cache allocated for every slot when the engine starts, as vLLM allocates its KV cache up front (a
#: request longer than this grows the cache then, which stalls the batch once).
RESERVED_CONTEXT = 2048

T = TypeVar("T")


def _settle(future: asyncio.Future, result: object, error: Exception | None) -> None:
    """Give ``future`` its outcome unless its caller stopped waiting (the client left)."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class QueueFull(Exception):
    """More requests are waiting than the server accepts (``--max-queue``)."""


@dataclass
class Update:
    """What a request gained in one step (or how it ended)."""

    tokens: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "eos" or "length" when finished
    stats: GenerationStats | None = None  # complete when finished
    error: str | None = None  # set when the engine failed
    logprobs: list[TokenLogprob] = field(default_factory=list)  # the tokens', when the request asked for them


@dataclass(eq=False)
class Submission:
    """One request's way into the worker and back: its updates arrive on ``updates`` in its event loop."""

    prompt_ids: list[int]
    config: GenerationConfig
    drafter: Drafter
    loop: asyncio.AbstractEventLoop
    updates: asyncio.Queue[Update] = field(default_factory=asyncio.Queue)
    arrived: float = field(default_factory=time.perf_counter)
    done: bool = False
    cancel_reason: str = "abort"

    def deliver(self, update: Update) -> None:
        self.loop.call_soon_threadsafe(self.updates.put_nowait, update)


class EngineWorker:
    """Owns a :class:`BatchEngine` and the loop that steps it (in a thread of its own, or the caller's)."""

    def __init__(
        self,
        generator: SpeculativeGenerator,
        max_batch_size: int,
        max_queue: int,
        prefix_caching: bool = True,
        on_step: Callable[[int, int], None] = lambda running, waiting: None,
        on_finish: Callable[[Submission, GenerationStats, str], None] = lambda submission, stats, reason: None,
    ) -> None:
        self.generator = generator
        self.max_batch_size = max_batch_size
        self.max_queue = max_queue
        self.prefix_caching = prefix_caching
        self.on_step = on_step
        self.on_finish = on_finish
        self.engine = self._new_engine()
        self._changed = threading.Condition()
        self._incoming: list[Submission] = []
        self._cancelled: list[Submission] = []
        self._calls: list[tuple[Callable[[], object], asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._stopping = False
        self._driving = threading.Event()  # set while a loop steps the engine
        self._stopped = threading.Event()  # set when that loop has returned

    def _new_engine(self) -> BatchEngine:
        engine = self.generator.batch_engine(self.max_batch_size, self.prefix_caching)
        engine.preallocate(RESERVED_CONTEXT)
        return engine

    # -- called from the event loop --------------------------------------------------------------------
    def start(self) -> None:
        """Step the engine in a thread of its own (slower than :meth:`drive`: see the module docstring)."""
        self._driving.set()
        threading.Thread(target=self.drive, name="specdecode-engine", daemon=True).start()

    def drive(self, alive: Callable[[], bool] = lambda: True) -> None:
        """Step the engine in the calling thread until :meth:`shutdown`, or until ``alive()`` is false while
        the engine is idle (e.g. the HTTP server's thread died before it could shut down)."""
        self._driving.set()
        try:
            self._run(alive)
        finally:
            self._stopped.set()

    @property
    def running(self) -> int:
        return len(self.engine.running)

    @property
    def waiting(self) -> int:
        return len(self.engine.waiting) + len(self._incoming)

    def submit(self, *submissions: Submission) -> None:
        """Queue the submissions (a request's choices): all of them, or none when the queue has no room for all."""
        with self._changed:
            if self._stopping:
                raise QueueFull("the server is shutting down")
            free = self.max_batch_size - len(self.engine.running)
            if self.waiting + len(submissions) > self.max_queue + max(free, 0):
                raise QueueFull(f"{self.waiting} requests are already waiting (--max-queue {self.max_queue})")
            self._incoming.extend(submissions)
            self._changed.notify()

    def reset_prefix_cache(self) -> bool:
        """Forget every kept prompt (what a benchmark does between runs, as vLLM's ``/reset_prefix_cache``);
        False, nothing done, while requests are in the engine."""
        with self._changed:  # the engine's thread takes this lock before it touches an idle engine
            if self._incoming or not self.engine.idle:
                return False
            self.engine.prefix_cache.clear()
            return True

    def call(self, work: Callable[[], T]) -> asyncio.Future[T]:
        """Run ``work`` in the engine's thread between two steps (a forward of the target outside the batch, such as
        a prompt's log-probabilities: the model runs in that thread only); its result, or its exception, comes back
        on the returned future of the calling event loop."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        with self._changed:
            self._calls.append((work, loop, future))
            self._changed.notify()
        return future

    def cancel(self, submission: Submission, reason: str = "abort") -> None:
        """Drop a request that is still in the engine (no-op once it finished); it ends with ``reason``
        ("abort": the client left; "stop": a stop string ended it)."""
        with self._changed:
            if not submission.done:
                submission.cancel_reason = reason
                self._cancelled.append(submission)
                self._changed.notify()

    def shutdown(self, drain_s: float) -> None:
        """Stop taking requests, let the running ones finish for up to ``drain_s`` seconds, cancel the rest."""
        with self._changed:
            self._stopping = True
            self._changed.notify()
        deadline = time.monotonic() + drain_s
        while time.monotonic() < deadline and (self.running or self.waiting):
            time.sleep(0.05)
        with self._changed:
            self._cancelled.extend(self._incoming)
            self._cancelled.extend(tag for tag, _ in self.engine.running.values())
            self._cancelled.extend(request.tag for request in self.engine.waiting)
            self._changed.notify()
        if self._driving.is_set():
            self._stopped.wait(timeout=10)

    # -- the engine's thread ---------------------------------------------------------------------------
    def _run(self, alive: Callable[[], bool]) -> None:
        while True:
            with self._changed:
                while not (self._incoming or self._cancelled or self._calls or not self.engine.idle or self._stopping):
                    if not alive():
                        return
                    self._changed.wait(timeout=0.5)
                if self._stopping and self.engine.idle and not (self._incoming or self._cancelled or self._calls):
                    return
                incoming, self._incoming = self._incoming, []
                cancelled, self._cancelled = self._cancelled, []
                calls, self._calls = self._calls, []
            for work, loop, future in calls:
                result, error = None, None
                try:
                    result = work()
                except Exception as exc:  # the caller's to report
                    error = exc
                loop.call_soon_threadsafe(_settle, future, result, error)
            for submission in cancelled:
                sequence = next((seq for tag, seq in self.engine.running.values() if tag is submission), None)
                stats = sequence.stats if sequence is not None else None
                reason = submission.cancel_reason
                self.engine.cancel(submission)
                self._end(submission, Update([], finished=True, finish_reason=reason, stats=stats), stats)
            for submission in incoming:
                if not submission.done:
                    request = BatchRequest(submission.prompt_ids, submission.config, submission, submission.drafter)
                    self.engine.submit(request)
            if self.engine.idle:
                continue
            try:
                events = self.engine.step()
            except Exception:  # a bug: fail what is in flight, keep serving
                log.exception("engine step failed; failing the requests in flight")
                self._fail_all("internal error while decoding")
                continue
            for event in events:
                submission: Submission = event.tag
                if submission.done:
                    continue
                recorded = event.sequence.outcome.logprobs
                logprobs = recorded[len(recorded) - len(event.new_tokens) :] if recorded else []
                if event.finished and event.sequence.outcome.error is not None:  # this request alone failed
                    self._end(submission, Update([], finished=True, error="internal error while decoding"), None)
                elif event.finished:
                    stats = event.sequence.stats
                    reason = event.sequence.outcome.finish_reason
                    self._end(submission, Update(event.new_tokens, True, reason, stats, logprobs=logprobs), stats)
                else:
                    submission.deliver(Update(event.new_tokens, logprobs=logprobs))
            self.on_step(len(self.engine.running), self.waiting)

    def _end(self, submission: Submission, update: Update, stats: GenerationStats | None) -> None:
        if submission.done:
            return
        submission.done = True
        submission.deliver(update)
        if stats is not None:
            self.on_finish(submission, stats, update.finish_reason or "abort")

    def _fail_all(self, message: str) -> None:
        tags = [tag for tag, _ in self.engine.running.values()] + [r.tag for r in self.engine.waiting]
        for submission in tags:
            self._end(submission, Update([], finished=True, error=message), stats=None)
        self.engine = self._new_engine()
