"""Continuous batching over :func:`specdecode.engine.step`: requests wait, join the running batch between
steps while there is room, and leave it (their cache slot freed at once) when they finish or are cancelled.
A request that joins has its prompt read in chunks that ride in the running sequences' steps, up to
``prefill_budget`` prompt tokens a step, and decodes from the step after its last chunk.
The server's worker (:mod:`specdecode.server.worker`) and ``generate_batch`` drive it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from specdecode.config import GenerationConfig
from specdecode.draft_length.base import PolicySource
from specdecode.drafters.base import Drafter
from specdecode.engine import (
    MAX_DRAFT_MARGIN,
    PREFILL_CHUNK,
    PromptChunk,
    Sequence,
    TargetVerifier,
    finish_sequence,
    start_sequence,
    step,
)
from specdecode.grammar import SequenceGrammar
from specdecode.models.base import CausalLM, KVPool


@dataclass
class BatchRequest:
    """A request submitted to the :class:`BatchEngine`."""

    prompt_ids: list[int]
    config: GenerationConfig
    tag: object = None  # the caller's handle, returned with every event
    drafter: Drafter | None = None  # this request's drafter (default: the engine's)


@dataclass
class BatchEvent:
    tag: object
    new_tokens: list[int]
    sequence: Sequence
    finished: bool


class BatchEngine:
    """Continuous batching: up to ``max_batch_size`` sequences decode together, one :func:`step` per
    iteration; waiting requests join between steps as others finish, and a finished or cancelled
    sequence gives its cache slot back at once.

    A joined sequence counts as running while its prompt is read: each step carries the next chunk
    (``prefill_chunk`` tokens, at the offsets solo decoding reads too) of as many of the sequences being read as
    ``prefill_budget`` prompt tokens allow, in order of arrival, and always at least one.  By default the budget
    is one chunk: every running sequence's step then grows by at most one chunk's forward."""

    def __init__(
        self,
        target: CausalLM,
        drafter: Drafter,
        policy_for: Callable[[GenerationConfig, Drafter], PolicySource],
        eos_ids: frozenset[int],
        max_batch_size: int = 8,
        prefill_chunk: int = PREFILL_CHUNK,
        prefill_budget: int | None = None,
        grammar_for: Callable[[GenerationConfig], SequenceGrammar] | None = None,
    ) -> None:
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"batch size must be a positive integer, got {max_batch_size!r}")
        budget = prefill_chunk if prefill_budget is None else prefill_budget
        for name, value in (("prefill chunk", prefill_chunk), ("prefill budget", budget)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.prefill_chunk = prefill_chunk
        self.prefill_budget = budget
        self.target = target
        self.drafter = drafter
        self.policy_for = policy_for
        self.grammar_for = grammar_for  # a constrained request's matcher (SpeculativeGenerator.grammar_for)
        self.eos_ids = eos_ids
        self.max_batch_size = max_batch_size
        self.pool: KVPool = target.new_pool()
        self.verifier = TargetVerifier(target)
        self.waiting: list[BatchRequest] = []
        self.running: dict[int, tuple[object, Sequence]] = {}

    def submit(self, request: BatchRequest) -> None:
        self.waiting.append(request)

    def cancel(self, tag: object) -> bool:
        """Drop a waiting or running request; its cache slot is free when this returns."""
        for key, (owner, seq) in list(self.running.items()):
            if owner is tag:
                del self.running[key]
                finish_sequence(seq)
                return True
        before = len(self.waiting)
        self.waiting = [r for r in self.waiting if r.tag is not tag]
        return len(self.waiting) < before

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def _admit(self) -> list[BatchEvent]:
        events = []
        while self.waiting and len(self.running) < self.max_batch_size:
            request = self.waiting.pop(0)
            # Room for the whole request (and a deep last draft) now, rather than regrowing mid-batch.
            most = len(request.prompt_ids) + request.config.max_new_tokens + MAX_DRAFT_MARGIN
            self.pool.reserve(self.max_batch_size, min(most, self.target.max_context))
            drafter = request.drafter or self.drafter
            seq = start_sequence(
                self.target,
                drafter,
                request.prompt_ids,
                request.config,
                self.eos_ids,
                self.policy_for(request.config, drafter),
                self.pool.allocate(),
                prefill_chunk=self.prefill_chunk,
                grammar=self._grammar(request.config),
            )
            if seq.done:  # nothing fits after the prompt
                finish_sequence(seq)
                events.append(BatchEvent(request.tag, [], seq, True))
            else:
                self.running[id(seq)] = (request.tag, seq)
        return events

    def _grammar(self, config: GenerationConfig) -> SequenceGrammar | None:
        if config.constraint is None:
            return None
        if self.grammar_for is None:
            raise ValueError("a constrained request needs an engine built with grammar_for")
        return self.grammar_for(config)

    def step(self) -> list[BatchEvent]:
        """Admit waiting requests, run one step over the running ones (reading the next chunks of the prompts
        being read in the same forward); the tokens each decoding sequence gained."""
        events = self._admit()
        if not self.running:
            return events
        decoding = [(tag, seq) for tag, seq in self.running.values() if not seq.reading]
        chunks = self._chunks([seq for _, seq in self.running.values() if seq.reading])
        gained = step([seq for _, seq in decoding], self.verifier, chunks=chunks)
        for (tag, seq), new_tokens in zip(decoding, gained):
            if seq.done:
                del self.running[id(seq)]
                finish_sequence(seq)
            events.append(BatchEvent(tag, new_tokens, seq, seq.done))
        return events

    def _chunks(self, reading: list[Sequence]) -> list[PromptChunk]:
        """The chunks this step reads: the next one of each sequence being read, oldest first, within the budget."""
        chunks, tokens = [], 0
        for seq in reading:
            chunk = seq.next_chunk()
            if chunks and tokens + chunk.size > self.prefill_budget:
                break
            chunks.append(chunk)
            tokens += chunk.size
        return chunks

    def run(self) -> Iterator[BatchEvent]:
        while not self.idle:
            yield from self.step()
