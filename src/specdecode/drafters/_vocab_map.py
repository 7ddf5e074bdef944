"""Two vocabularies side by side: every token's exact bytes, the one-to-one map between the tokens two
tokenizers share, and a drafter-token copy of a growing target context.

Why bytes and not ``decode``: a tokenizer's ``decode`` of one id drops SentencePiece's leading space,
turns a byte-level piece that is half a UTF-8 character into U+FFFD and cleans up spaces around
punctuation — so equal-looking strings would map tokens that are not equal.  The stored pieces are
unambiguous once the tokenizer's own piece encoding is undone: GPT-2 byte-level BPE writes byte b as
a printable character (``Ġ`` is the space), SentencePiece writes the space as ``▁`` and raw bytes as
``<0xAB>``, WordPiece marks a word's continuation with ``##``.  Which one a tokenizer uses is read from
its decoder (the ``tokenizers`` description of the inverse of its pieces).

Special tokens (``<|im_end|>``, ...) are kept apart: their "bytes" are their text, and they only ever map
to a special token with the same text, never to ordinary text that happens to spell it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import torch

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@lru_cache(maxsize=1)
def _byte_level_table() -> dict[str, int]:
    """GPT-2's printable stand-in character of every byte, inverted (character → byte)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


def decoder_kinds(tokenizer: Any) -> frozenset[str]:
    """The decoder step types of a ``tokenizers``-backed tokenizer (``ByteLevel``, ``Metaspace``,
    ``WordPiece``, ...); a ``Replace`` of ``▁`` counts as ``Metaspace``.  Empty for other tokenizers."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if decoder is None:
        return frozenset()
    kinds, stack = set(), [json.loads(decoder.__getstate__())]
    while stack:
        step = stack.pop()
        kinds.add(step.get("type", ""))
        stack.extend(step.get("decoders") or [])
        if step.get("type") == "Replace" and (step.get("pattern") or {}).get("String") == "▁":
            kinds.add("Metaspace")
    return frozenset(kinds)


def _guess_kinds(pieces: Sequence[str | None]) -> frozenset[str]:
    """For a tokenizer without a ``tokenizers`` decoder (a slow one): its piece encoding from its pieces."""
    text = "".join(piece or "" for piece in pieces)
    if "▁" in text:
        return frozenset({"Metaspace", "ByteFallback"})
    return frozenset({"ByteLevel"}) if "Ġ" in text else frozenset()


def piece_bytes(piece: str, kinds: frozenset[str]) -> tuple[bytes, bool]:
    """The bytes a stored piece stands for, and whether it is a SentencePiece byte-fallback piece."""
    if "ByteLevel" in kinds:
        table = _byte_level_table()
        return b"".join(bytes([table[c]]) if c in table else c.encode() for c in piece), False
    if "ByteFallback" in kinds and (found := _BYTE_FALLBACK.match(piece)):
        return bytes([int(found.group(1), 16)]), True
    if "Metaspace" in kinds:
        return piece.replace("▁", " ").encode(), False
    if "WordPiece" in kinds:  # words are joined by a space, ``##`` continues the previous one
        return (piece[2:] if piece.startswith("##") else " " + piece).encode(), False
    return piece.encode(), False


@dataclass(frozen=True)
class TokenTable:
    """One tokenizer's tokens as bytes.

    pieces[i]: the bytes token i stands for (a special token's text; b"" for ids without a piece).
    special: ids of special tokens, which only map to special tokens.
    fallback: SentencePiece byte-fallback ids (``<0x20>``): a regular piece with the same bytes is preferred.
    prefix: the ids the tokenizer puts before any text on its own (a BOS), which carry no text.
    encode: text → ids, nothing added.
    """

    pieces: list[bytes]
    special: frozenset[int]
    fallback: frozenset[int]
    prefix: tuple[int, ...]
    encode: Callable[[str], list[int]]

    @classmethod
    def of(cls, tokenizer: Any) -> TokenTable:
        added = {i: t for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}
        special = {i for i, t in added.items() if getattr(t, "special", True)} | set(tokenizer.all_special_ids)
        stored = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        kinds = decoder_kinds(tokenizer) or _guess_kinds(stored)
        pieces: list[bytes] = []
        fallback = set()
        for i, piece in enumerate(stored):
            if i in added:
                pieces.append(added[i].content.encode())
                continue
            data, is_fallback = piece_bytes(piece or "", kinds)
            pieces.append(data)
            if is_fallback:
                fallback.add(i)
        return cls(
            pieces=pieces,
            special=frozenset(special),
            fallback=frozenset(fallback),
            prefix=tuple(tokenizer.encode("", add_special_tokens=True)),
            encode=lambda text: tokenizer.encode(text, add_special_tokens=False),
        )

    def piece(self, token: int) -> bytes:
        return self.pieces[token] if 0 <= token < len(self.pieces) else b""

    def text(self, tokens: Sequence[int]) -> bytes:
        try:
            return b"".join(map(self.pieces.__getitem__, tokens))
        except IndexError:  # a model's head may be wider than its tokenizer: those ids spell nothing
            return b"".join(map(self.piece, tokens))

    def keys(self, size: int) -> dict[tuple[bool, bytes], int]:
        """(special?, bytes) → id for ids below ``size`` (a model's logits may be narrower or wider than
        its tokenizer); the first id wins, a byte-fallback id only where no regular piece has its bytes."""
        found: dict[tuple[bool, bytes], int] = {}
        ids = range(min(size, len(self.pieces)))
        for i in [*(i for i in ids if i not in self.fallback), *(i for i in ids if i in self.fallback)]:
            if self.pieces[i] and i not in self.prefix:
                found.setdefault((i in self.special, self.pieces[i]), i)
        return found


@dataclass(frozen=True)
class VocabMap:
    """The tokens two vocabularies share, paired one to one: ``draft_ids[k]`` ↔ ``target_ids[k]``.
    ``index_of_target[t]``: k for target id t, -1 outside the intersection."""

    draft_ids: torch.Tensor
    target_ids: torch.Tensor
    index_of_target: torch.Tensor

    @property
    def size(self) -> int:
        return int(self.draft_ids.numel())


def build_vocab_map(draft: TokenTable, draft_size: int, target: TokenTable, target_size: int) -> VocabMap:
    """Pair every drafter token with the target token of identical bytes (and specialness)."""
    target_keys = target.keys(target_size)
    pairs = sorted((d, target_keys[key]) for key, d in draft.keys(draft_size).items() if key in target_keys)
    draft_ids = torch.tensor([d for d, _ in pairs], dtype=torch.long)
    target_ids = torch.tensor([t for _, t in pairs], dtype=torch.long)
    index = torch.full((target_size,), -1, dtype=torch.long)
    index[target_ids] = torch.arange(len(pairs))
    return VocabMap(draft_ids, target_ids, index)


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two token lists share (how much of a cache stays valid)."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def complete_utf8(data: bytes) -> str | None:
    """``data`` as text, or None when it ends inside a UTF-8 character (the rest is still to come).
    Invalid bytes elsewhere (a model may emit any byte sequence) become U+FFFD."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.reason == "unexpected end of data":
            return None
        return data.decode("utf-8", errors="replace")


@dataclass
class ContextTranslator:
    """The drafter's tokens for a target context that grows step by step.

    The context's text (the target pieces' bytes) is tokenised by the drafter's tokenizer.  Doing that
    for the whole context every step would cost O(length) per step, so the text is split at an *anchor*:
    a byte offset where a target token boundary and a drafter token boundary coincide, at least
    ``margin`` target tokens before the end.  The drafter tokens before the anchor are frozen; only the
    text after it is tokenised again each step — the last few tokens must stay open because appended
    text can change how they are tokenised (``hel`` + ``lo`` → ``hello``).  The anchor only moves when
    the drafter's pieces reproduce the text exactly (a tokenizer that normalises text, e.g. adds a
    leading space, keeps tokenising everything: slower, but still right).

    The drafter thus always sees its own tokenisation of what the target accepted — whatever it drafted
    itself — and its KV cache keeps the longest prefix the new tokens share with what it has cached.
    """

    source: TokenTable
    dest: TokenTable
    margin: int = 8
    #: The last call's tail: the target tokens after the anchor and the drafter's tokens for their text.
    last: tuple[list[int], list[int]] = ([], [])
    _frozen_source: list[int] = field(default_factory=list)
    _frozen_dest: list[int] = field(default_factory=list)

    def translate(self, context: Sequence[int]) -> list[int] | None:
        """The drafter's ids for ``context`` (target ids), or None while its text ends inside a UTF-8
        character (a byte-level target may emit half a character per token)."""
        context = list(context)
        if context[: len(self.source.prefix)] == list(self.source.prefix):
            context = context[len(self.source.prefix) :]
        anchor = len(self._frozen_source)
        if context[:anchor] != self._frozen_source:
            self._frozen_source, self._frozen_dest, anchor = [], [], 0
        tail = context[anchor:]
        text = complete_utf8(self.source.text(tail))
        if text is None:
            return None
        ids = self.dest.encode(text)
        self.last = (tail, ids)
        translated = [*self.dest.prefix, *self._frozen_dest, *ids]
        self._advance(tail, ids)
        return translated

    def _advance(self, tail: list[int], ids: list[int]) -> None:
        """Move the anchor to the last boundary both tokenisations share ``margin`` target tokens before
        the end (if the drafter's pieces spell the text exactly)."""
        text = self.source.text(tail)
        if len(tail) <= self.margin or self.dest.text(ids) != text:
            return
        source_ends, offset = {}, 0
        for j, token in enumerate(tail[: len(tail) - self.margin], start=1):
            offset += len(self.source.piece(token))
            if offset == len(text) or text[offset] & 0xC0 != 0x80:  # not inside a UTF-8 character
                source_ends[offset] = j
        best, offset = (0, 0), 0
        for i, token in enumerate(ids, start=1):
            offset += len(self.dest.piece(token))
            if offset in source_ends:
                best = (source_ends[offset], i)
        j, i = best
        if i:
            self._frozen_source.extend(tail[:j])
            self._frozen_dest.extend(ids[:i])
