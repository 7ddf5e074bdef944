"""OmniDraft's cross-vocabulary n-gram cache: which runs of drafter tokens spell exactly one target token.

A token-level intersection can never draft a target token that merges several drafter tokens (Qwen's
one token `` ```python `` is three of SmolLM2's).  The cache learns those merges online from what the
target actually verified: once the drafter's tokenisation of the accepted text is known, every target
token whose bytes start and end on drafter token boundaries and cover 2..``max_n`` drafter tokens is an
entry ``(d_1, ..., d_n) → t``.  Drafting then converts the drafter's tokens left to right, the longest
cached run first, a single shared token through the intersection, and stops at the first token it
cannot convert.  Learnt from the target's own tokens, it also follows a target whose tokenisation is
not what its tokenizer would produce today.  Bounded: least recently used entries go first.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from specdecode.drafters._vocab_map import TokenTable


def _ends(table: TokenTable, tokens: Sequence[int]) -> list[int]:
    """Byte offset of the end of every token."""
    ends, offset = [], 0
    for token in tokens:
        offset += len(table.piece(token))
        ends.append(offset)
    return ends


@dataclass
class MergeCache:
    """Drafter token runs (2..``max_n`` long) → the one target token they spell; at most ``max_entries``."""

    max_n: int = 4
    max_entries: int = 65_536
    entries: OrderedDict[tuple[int, ...], int] = field(default_factory=OrderedDict)
    #: How many cached runs each drafter token appears in: a drafted token in none, and not shared either,
    #: ends what can be converted, so drafting further would be wasted.
    members: Counter[int] = field(default_factory=Counter)

    def learn(self, target: TokenTable, target_tokens: Sequence[int], draft: TokenTable, draft_tokens: Sequence[int]):
        """Record the merges in a stretch of text both tokenisations spell exactly (the same bytes)."""
        if target.text(target_tokens) != draft.text(draft_tokens):
            return
        starts = {0: 0, **{end: i + 1 for i, end in enumerate(_ends(draft, draft_tokens))}}
        begin = 0
        for token, end in zip(target_tokens, _ends(target, target_tokens), strict=True):
            if begin in starts and end in starts and 2 <= starts[end] - starts[begin] <= self.max_n:
                self._put(tuple(draft_tokens[starts[begin] : starts[end]]), token)
            begin = end

    def _put(self, run: tuple[int, ...], token: int) -> None:
        if run not in self.entries:
            self.members.update(run)
        self.entries[run] = token
        self.entries.move_to_end(run)
        while len(self.entries) > self.max_entries:
            self.members.subtract(self.entries.popitem(last=False)[0])

    def convert(self, drafted: Sequence[int], single: dict[int, int]) -> list[int]:
        """Target tokens for the drafter's tokens, left to right: the longest cached run, else the one
        shared token (``single``: drafter id → target id); up to the first token neither covers."""
        out: list[int] = []
        i = 0
        while i < len(drafted):
            for n in range(min(self.max_n, len(drafted) - i), 1, -1):
                token = self.entries.get(tuple(drafted[i : i + n]))
                if token is not None:
                    self.entries.move_to_end(tuple(drafted[i : i + n]))
                    out.append(token)
                    i += n
                    break
            else:
                if drafted[i] not in single:
                    break
                out.append(single[drafted[i]])
                i += 1
        return out

    def clear(self) -> None:
        self.entries.clear()
        self.members.clear()
