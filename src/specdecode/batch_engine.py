"""Continuous batching over :func:`specdecode.engine.step`: requests wait, join the running batch between
steps while there is room, and leave it (their cache slot freed at once) when they finish or are cancelled.
A request that joins has its prompt read in chunks that ride in the running sequences' steps, up to
``prefill_budget`` prompt tokens a step, and decodes from the step after its last chunk.  A prompt that
starts like one read before takes what it shares with that one from the prefix cache (:mod:`specdecode.prefix_cache`).
The server's worker (:mod:`specdecode.server.worker`) and ``generate_batch`` drive it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from specdecode.config import GenerationConfig
from specdecode.draft_length.base import PolicySource
from specdecode.drafters.base import Drafter
from specdecode.engine import (
    MAX_DRAFT_MARGIN,
    PREFILL_CHUNK,
    PromptChunk,
    Sequence,
    TargetVerifier,
    adopt_prompt_prefix,
    finish_sequence,
    start_sequence,
    step,
)
from specdecode.grammar import SequenceGrammar
from specdecode.models.base import CausalLM, KVPool
from specdecode.prefix_cache import PrefixCache, PrefixSource


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
    ``prefill_budget`` prompt tokens allow, fewest tokens left first, and always at least one.  By default the budget
    is one chunk: every running sequence's step then grows by at most one chunk's forward.

    ``prefix_cache_slots``: how many finished prompts' caches are kept for automatic prefix caching (default
    ``max_batch_size``; 0 turns it off).  Each holds a cache slot beside the running sequences' until a newer
    prompt needs the room."""

    def __init__(
        self,
        target: CausalLM,
        drafter: Drafter,
        policy_for: Callable[[GenerationConfig, Drafter], PolicySource],
        eos_ids: frozenset[int],
        max_batch_size: int = 8,
        prefill_chunk: int = PREFILL_CHUNK,
        prefill_budget: int | None = None,
        prefix_cache_slots: int | None = None,
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
        self.prefix_cache = PrefixCache(
            prefill_chunk,
            max_batch_size if prefix_cache_slots is None else prefix_cache_slots,
            rows_alone=target.rows_read_alone(),
        )
        self.waiting: list[BatchRequest] = []
        self.running: dict[int, tuple[object, Sequence]] = {}

    @property
    def slots(self) -> int:
        """Cache slots the pool holds: the batch's and the kept prefixes'."""
        return self.max_batch_size + self.prefix_cache.capacity

    @torch.inference_mode()
    def preallocate(self, length: int) -> None:
        """Allocate the cache for every slot (the batch's and the kept prefixes') up to ``length`` positions now.
        Growing it later copies every slot while the running sequences wait: a request of 900 positions arriving
        at a pool of 512 stalled a step of the batch by 0.8 s (``docs/results/serve-vllm-cpu-cold-smollm2-135m``).
        A one-token forward creates the storage (the pool makes each layer's at its first write)."""
        self.pool.reserve(self.slots, min(length, self.target.max_context))
        cache = self.pool.allocate()
        try:
            self.target.forward(torch.zeros(1, dtype=torch.long), cache, invariant=False)
        finally:
            cache.release()

    def submit(self, request: BatchRequest) -> None:
        self.waiting.append(request)

    def cancel(self, tag: object) -> bool:
        """Drop a waiting or running request; its cache slot is free when this returns."""
        for key, (owner, seq) in list(self.running.items()):
            if owner is tag:
                del self.running[key]
                self._finish(seq)
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
            # Room for the whole request (and a deep last draft) now, rather than regrowing mid-batch, beside the
            # kept prefixes' slots.
            most = len(request.prompt_ids) + request.config.max_new_tokens + MAX_DRAFT_MARGIN
            self.pool.reserve(self.slots, min(most, self.target.max_context))
            drafter = request.drafter or self.drafter
            source, shared = self._cached_prefix(request.prompt_ids)
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
            if source is not None:
                adopt_prompt_prefix(seq, source.cache, shared)
            if seq.done:  # nothing fits after the prompt
                self._finish(seq)
                events.append(BatchEvent(request.tag, [], seq, True))
            else:
                self.running[id(seq)] = (request.tag, seq)
        return events

    def _cached_prefix(self, prompt_ids: list[int]) -> tuple[PrefixSource | None, int]:
        """The running or kept prompt sharing the most tokens with ``prompt_ids``, and how many."""
        if not self.prefix_cache.enabled:
            return None, 0
        running = [self._source(seq) for _, seq in self.running.values() if seq.cache is not None]
        return self.prefix_cache.best(prompt_ids, running)

    def _source(self, seq: Sequence) -> PrefixSource:
        return PrefixSource(seq.prompt_ids, seq.cache, self.prefix_cache.shareable(len(seq.prompt_ids), seq.read))

    def _finish(self, seq: Sequence) -> None:
        """End ``seq``: its cache goes to the prefix cache when that keeps it, else back to the pool."""
        if seq.cache is not None and self.prefix_cache.keep(self._source(seq)):
            seq.cache = None  # the prefix cache owns the slot now
        finish_sequence(seq)

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
                self._finish(seq)
            events.append(BatchEvent(tag, new_tokens, seq, seq.done))
        return events

    def _chunks(self, reading: list[Sequence]) -> list[PromptChunk]:
        """The chunks this step reads: the next one of each sequence being read, within the budget, the prompt with
        the fewest tokens left first (oldest first among equals): a short prompt waits for no long one to be read,
        which keeps the median time to first token low when many arrive at once."""
        chunks, tokens = [], 0
        for seq in sorted(reading, key=lambda seq: len(seq.prompt_ids) - seq.read):
            chunk = seq.next_chunk()
            if chunks and tokens + chunk.size > self.prefill_budget:
                break
            chunks.append(chunk)
            tokens += chunk.size
        return chunks

    def run(self) -> Iterator[BatchEvent]:
        while not self.idle:
            yield from self.step()
