"""Automatic prefix caching: a prompt that starts like one read before takes that prompt's keys and values
instead of reading them again (vLLM's and SGLang's automatic prefix caching, for the batched engine).

Lossless by construction.  A prompt is read in chunks at fixed offsets (``prefill_chunk`` tokens from its
start, :meth:`specdecode.engine.Sequence.next_chunk`), and a chunk's keys and values depend only on its own
tokens and the cache before it.  So only whole chunks are shared: a new prompt adopts the longest run of
whole chunks it has in common with a prompt read before (a running sequence's or a finished one's), and
reads the rest from that chunk boundary on, as it would have without the cache.  Every chunk then holds
bitwise what reading it would have put there, and the output is the output without the cache.  The last,
partial chunk of a prompt, and every token decoded after it (verification rows, another computation), are
never shared.

A finished sequence's slot stays in the cache (up to ``capacity`` of them, least recently used first out);
a prompt that adopts a prefix gets a copy of it in its own slot, so that one prefix serves every request
that starts with it, at once.  Drafting sessions that read the prompt's hidden states (EAGLE-style heads)
read the whole prompt: their features come from the chunks' forwards.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from specdecode.models.base import KVCache


@dataclass(frozen=True)
class PrefixSource:
    """A prompt whose first ``length`` tokens' keys and values are in ``cache`` (whole chunks only)."""

    prompt_ids: Sequence[int]
    cache: KVCache
    length: int


def whole_chunks(prompt_length: int, read: int, chunk: int) -> int:
    """How many of a prompt's tokens lie in whole chunks that are in the cache: ``read`` tokens read so far,
    the last token never read as part of the prompt (it is fed with the first draft)."""
    return chunk * (min(read, prompt_length - 1) // chunk)


def shared_length(prompt_ids: Sequence[int], source: PrefixSource, chunk: int) -> int:
    """Tokens of ``prompt_ids`` in whole chunks equal to ``source``'s, that this prompt would read as whole
    chunks too."""
    limit = min(source.length, whole_chunks(len(prompt_ids), len(prompt_ids), chunk))
    length = 0
    while length + chunk <= limit and prompt_ids[length : length + chunk] == source.prompt_ids[length : length + chunk]:
        length += chunk
    return length


class PrefixCache:
    """The finished prompts kept for reuse, and the lookup over them and the running ones."""

    def __init__(self, chunk: int, capacity: int) -> None:
        if not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"prefix cache capacity must be a non-negative integer, got {capacity!r}")
        self.chunk = chunk
        self.capacity = capacity
        self._kept: OrderedDict[int, PrefixSource] = OrderedDict()  # by id(cache), least recently used first

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def __len__(self) -> int:
        return len(self._kept)

    def best(self, prompt_ids: Sequence[int], running: Iterable[PrefixSource]) -> tuple[PrefixSource | None, int]:
        """The source sharing the most whole chunks with ``prompt_ids`` and how many tokens that is (0: none)."""
        found, longest = None, 0
        for source in (*running, *reversed(self._kept.values())):
            length = shared_length(prompt_ids, source, self.chunk)
            if length > longest:
                found, longest = source, length
        if found is not None and id(found.cache) in self._kept:
            self._kept.move_to_end(id(found.cache))
        return found, longest

    def keep(self, source: PrefixSource) -> bool:
        """Keep a finished prompt's cache for reuse; False (the caller releases it) when it holds no whole chunk
        or the cache is off.  A kept prompt whose chunks the new one holds too is dropped."""
        if not self.enabled or source.length < self.chunk:
            return False
        for key, old in list(self._kept.items()):
            if old.length <= source.length and shared_length(source.prompt_ids, old, self.chunk) >= old.length:
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
