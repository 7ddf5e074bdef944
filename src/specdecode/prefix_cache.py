"""Automatic prefix caching: a prompt that starts like one read before takes that prompt's keys and values
instead of reading them again (vLLM's and SGLang's automatic prefix caching, for the batched engine).

Lossless by construction.  A prompt is read in chunks at fixed offsets (``prefill_chunk`` tokens from its
start, :meth:`specdecode.engine.Sequence.next_chunk`), and a chunk's keys and values depend only on its own
tokens and the cache before it.  So whole chunks can be shared: a new prompt adopts the longest run of whole
chunks it has in common with a prompt read before (a running sequence's or a finished one's), and reads the
rest from that chunk boundary on, as it would have without the cache.  Every chunk then holds bitwise what
reading it would have put there, and the output is the output without the cache.

Where the backend computes each row of a chunk on its own (:meth:`~specdecode.models.base.CausalLM.rows_read_alone`:
the CPU fast path's written-out layers and chunk attention), a prompt token's keys and values are the same bits in
any chunk of enough tokens, so a prefix of any length is shared: the prompts' common tokens, when the chunk they end
in is such a chunk in both prompts and the rest of it, read as a chunk of its own up to the next fixed offset, is one
too (or empty).  Prompts that differ after a shared system prompt of a few dozen tokens then read only what differs.

The last token of a prompt, and every token decoded after it (verification rows, another computation), are
never shared.  A finished sequence's slot stays in the cache (up to ``capacity`` of them, least recently used
first out); a prompt that adopts a prefix gets a copy of it in its own slot, so that one prefix serves every
request that starts with it, at once.  Drafting sessions that read the prompt's hidden states (EAGLE-style
heads) read the whole prompt: their features come from the chunks' forwards.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from specdecode.models.base import KVCache


@dataclass(frozen=True)
class PrefixSource:
    """A prompt whose first ``length`` tokens' keys and values are in ``cache``, free to share."""

    prompt_ids: Sequence[int]
    cache: KVCache
    length: int


def whole_chunks(prompt_length: int, read: int, chunk: int) -> int:
    """How many of a prompt's tokens lie in whole chunks that are in the cache: ``read`` tokens read so far,
    the last token never read as part of the prompt (it is fed with the first draft)."""
    return chunk * (min(read, prompt_length - 1) // chunk)


def shared_length(prompt_ids: Sequence[int], source: PrefixSource, chunk: int, rows_alone: int | None = None) -> int:
    """Tokens of ``prompt_ids`` whose keys and values ``source``'s cache holds bitwise as reading this prompt would
    compute them: the whole chunks the two prompts have in common, which this prompt reads as whole chunks too; or,
    where the backend computes chunks of at least ``rows_alone`` tokens row by row, every common token, when the chunk
    they end in has that many tokens in both prompts and so has the rest of it (or nothing is left of it)."""
    limit = min(source.length, len(prompt_ids) - 1)
    length = 0
    while length + chunk <= limit and prompt_ids[length : length + chunk] == source.prompt_ids[length : length + chunk]:
        length += chunk
    while length < limit and prompt_ids[length] == source.prompt_ids[length]:
        length += 1
    start = length - length % chunk
    if rows_alone is None or start == length:
        return start
    here = min(start + chunk, len(prompt_ids) - 1)  # where the chunk ends in this prompt
    there = min(start + chunk, len(source.prompt_ids) - 1)  # and in the source's
    rest = here - length  # read as a chunk of its own
    alone = min(here - start, there - start) >= rows_alone and (rest == 0 or rest >= rows_alone)
    return length if alone else start


class PrefixCache:
    """The finished prompts kept for reuse, and the lookup over them and the running ones."""

    def __init__(self, chunk: int, capacity: int, rows_alone: int | None = None) -> None:
        if not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"prefix cache capacity must be a non-negative integer, got {capacity!r}")
        self.chunk = chunk
        self.capacity = capacity
        self.rows_alone = rows_alone  # the backend's CausalLM.rows_read_alone()
        self._kept: OrderedDict[int, PrefixSource] = OrderedDict()  # by id(cache), least recently used first

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def shareable(self, prompt_length: int, read: int) -> int:
        """How many tokens of a prompt of ``prompt_length`` tokens, ``read`` of them read so far, another prompt may
        take: its whole chunks, or every token read where chunks are computed row by row (never the last token, which
        is fed with the first draft)."""
        if self.rows_alone is None:
            return whole_chunks(prompt_length, read, self.chunk)
        return min(read, prompt_length - 1)

    def __len__(self) -> int:
        return len(self._kept)

    def best(self, prompt_ids: Sequence[int], running: Iterable[PrefixSource]) -> tuple[PrefixSource | None, int]:
        """The source sharing the most tokens with ``prompt_ids`` and how many that is (0: none)."""
        found, longest = None, 0
        for source in (*running, *reversed(self._kept.values())):
            length = shared_length(prompt_ids, source, self.chunk, self.rows_alone)
            if length > longest:
                found, longest = source, length
        if found is not None and id(found.cache) in self._kept:
            self._kept.move_to_end(id(found.cache))
        return found, longest

    def keep(self, source: PrefixSource) -> bool:
        """Keep a finished prompt's cache for reuse; False (the caller releases it) when it holds nothing to share
        (no whole chunk, where only those are shared) or the cache is off.  A kept prompt whose shared tokens the new
        one holds too is dropped."""
        if not self.enabled or source.length < (self.chunk if self.rows_alone is None else 1):
            return False
        for key, old in list(self._kept.items()):
            if old.length > source.length:
                continue
            if shared_length(source.prompt_ids, old, self.chunk, self.rows_alone) >= old.length:
                del self._kept[key]
                old.cache.release()
        self._kept[id(source.cache)] = source
        while len(self._kept) > self.capacity:
            self.evict()
        return True

    def evict(self) -> bool:
        """Release the least recently used kept prompt's cache; False when none is kept."""
        if not self._kept:
            return False
        _, old = self._kept.popitem(last=False)
        old.cache.release()
        return True

    def clear(self) -> None:
        while self.evict():
            pass
