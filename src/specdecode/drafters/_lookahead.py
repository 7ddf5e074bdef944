"""Drafting while the target verifies (PEARL's post-verify, on one machine with threads).

After Liu et al., "Parallel Speculative Decoding with Adaptive Draft Length" (PEARL, 2024): instead of
waiting while the target verifies d_1..d_k, the draft model goes on, as if all of them will be accepted —
it feeds d_k and drafts a_0, a_1, ... on a worker thread until the verification is over.  If the target
did accept every d_i and its own next token is a_0, then a_1, a_2, ... are exactly what the draft model
would draft next (greedy or seed-coupled drafting is a function of the context), so the next step starts
with them for free; otherwise they are dropped and the draft model's cache is cut back as after any
rejection.  Drafts are therefore the same tokens as without the worker, only sooner: the output cannot
change, and only the time can.

Torch runs its kernels outside the GIL, so the draft model's forward truly overlaps the target's; on a
CPU both then share the cores and the memory bandwidth, which is what decides whether it pays.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

#: Feeds one token to the draft model and returns (its next token, the draft model's probability of it).
DraftOne = Callable[[int, int], tuple[int, float]]


@dataclass
class Lookahead:
    """The worker of one drafting session; at most one run at a time."""

    draft_one: DraftOne  # (token to feed, absolute position of the token it predicts) -> (token, confidence)
    base: list[int] = field(default_factory=list)  # the context the run assumes before a_0: old context + draft
    tokens: list[int] = field(default_factory=list)  # a_0, a_1, ...
    fed: list[int] = field(default_factory=list)  # what the worker fed the draft model: d_k, a_0, a_1, ...
    confidence: list[float] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _error: BaseException | None = None

    def start(self, context: list[int], draft: list[int], limit: int) -> None:
        """Draft up to ``limit`` tokens past ``context + draft`` (whose last token is fed first) until
        :meth:`stop`.  The caller's cache must hold ``context + draft[:-1]``."""
        self.base, self.tokens, self.fed, self.confidence, self._error = [*context, *draft], [], [], [], None
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, args=(draft[-1], limit), daemon=True)
        self._thread.start()

    def _run(self, token: int, limit: int) -> None:
        try:
            while len(self.tokens) < limit and not self._stop.is_set():
                fed = token
                token, confidence = self.draft_one(fed, len(self.base) + len(self.tokens))
                self.fed.append(fed)
                self.tokens.append(token)
                self.confidence.append(confidence)
        except BaseException as error:  # handed to the caller's thread by join()
            self._error = error

    def stop(self) -> None:
        """Ask the worker to stop after the token it is drafting (verification is over)."""
        self._stop.set()

    def join(self) -> list[int]:
        """Wait for the worker to end; the tokens it fed to the draft model (its cache grew by them)."""
        if self._thread is None:
            return []
        self._stop.set()
        self._thread.join()
        self._thread = None
        if self._error is not None:
            raise self._error
        return self.fed

    def continuation(self, context: list[int]) -> tuple[list[int], list[float]]:
        """After :meth:`join`: the drafted tokens that follow ``context`` (empty unless the target accepted
        the whole draft and then chose a_0 itself)."""
        followed = len(context) == len(self.base) + 1 and context[-1] == self.tokens[0] if self.tokens else False
        if len(self.tokens) > 1 and followed and context[:-1] == self.base:
            return self.tokens[1:], self.confidence[1:]
        return [], []
