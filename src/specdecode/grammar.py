"""The grammar engine behind structured outputs (llguidance): a request's :class:`~specdecode.constraints.Constraint`
compiled once for a tokenizer, and each sequence's matcher.

A constraint is one more step of the per-row processing (:mod:`specdecode.logits_processing`): the mask at a verified
row is the grammar's after the sequence's accepted tokens *and* that row's draft path, so the row is the masked
distribution plain constrained decoding reads at that position.  The sequence's matcher itself only ever advances over
accepted tokens; a row's path is consumed by a copy of it and rolled back (llguidance's ``deep_copy`` and
``rollback``), so a rejected draft leaves no trace in it.

A mask admits exactly the tokens the matcher then accepts (:func:`_admitted`), and nothing at a dead end, where the
grammar admits no token the vocabulary has: the output ends there (:meth:`SequenceGrammar.advance`).  llguidance's own
mask departs from that in two places: at a dead end it admits the end-of-sequence token, which it then takes as a stop;
and it reads bytes the grammar forces (a JSON schema's ``{"``) as written by some token, so a vocabulary that cannot
write one of them (a word-level one without ``{``) gets the mask after those bytes, whose tokens the matcher refuses.
"""

from __future__ import annotations

import functools
import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode

from specdecode.constraints import Constraint
from specdecode.errors import SpecDecodeError
from specdecode.types import Draft

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_UNICODE_TO_BYTE = {char: byte for byte, char in bytes_to_unicode().items()}


def token_bytes(tokenizer, vocab: int) -> list[bytes]:
    """Every token id's bytes below ``vocab``: byte-level BPE pieces mapped back through GPT-2's byte alphabet,
    SentencePiece byte pieces (``<0x0A>``) as their byte and ``▁`` as a space; special and added tokens as their text.

    llguidance's own reading of a Hugging Face tokenizer looks at the decoder's type only, and takes a decoder that
    chains ``ByteFallback`` before ``ByteLevel`` (as tokenizers converted from GGUF have) for a SentencePiece one."""
    decoder = json.dumps(json.loads(tokenizer.backend_tokenizer.to_str()).get("decoder"))
    byte_level = '"ByteLevel"' in decoder
    special = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
    pieces = tokenizer.convert_ids_to_tokens(list(range(vocab)))
    result = []
    for token, piece in enumerate(pieces):
        if piece is None:
            result.append(b"")
        elif token in special:
            result.append(piece.encode())
        elif byte_level and all(char in _UNICODE_TO_BYTE for char in piece):
            result.append(bytes(_UNICODE_TO_BYTE[char] for char in piece))
        elif match := _BYTE_PIECE.fullmatch(piece):
            result.append(bytes([int(match.group(1), 16)]))
        else:
            result.append(piece.replace("\u2581", " ").encode())
    return result


class GrammarFailure(RuntimeError):
    """The grammar engine refused a token its own mask admitted: a bug, which ends that sequence alone."""


class _TokenizerView:
    """What llguidance's ``TokenizerWrapper`` reads of a tokenizer: its tokens' bytes, its specials, its encoder."""

    def __init__(self, tokenizer, vocab: int) -> None:
        known = min(vocab, len(tokenizer))
        self.tokens = token_bytes(tokenizer, known) + [b""] * (vocab - known)  # a model's padding rows: no bytes
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = [token for token in tokenizer.all_special_ids if token < vocab]
        self._tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        """``text``'s tokens as the tokenizer writes them, or none where they do not spell it (an unknown-token id
        for a character the vocabulary lacks): llguidance then tokenizes it greedily from the tokens' bytes."""
        tokens = self._tokenizer.encode(text, add_special_tokens=False)
        return tokens if b"".join(self.tokens[token] for token in tokens) == text.encode() else []


class GrammarCompiler:
    """Constraints compiled for one tokenizer and a model's vocabulary (its logits' width), each distinct constraint
    once: a sequence's matcher is a copy of the compiled one (:meth:`start`).

    eos_ids: the tokens the grammar lets end the output once it is complete (the model's end-of-sequence tokens).
    forced_drafts: the sequences draft the grammar's forced tokens (``bench structured`` measures without)."""

    #: Distinct constraints kept compiled; the least recently used one is dropped beyond.
    CACHE_SIZE = 256

    def __init__(self, tokenizer, vocab: int, eos_ids: frozenset[int]) -> None:
        import llguidance

        self.vocab = vocab
        self.forced_drafts = True
        view = _TokenizerView(tokenizer, vocab)
        ends = sorted(token for token in eos_ids if token < vocab) or None
        self.tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(view), n_vocab=vocab, eos_token=ends)
        self.rules = _MaskRules(
            ends=torch.tensor([token for token in self.tokenizer.eos_tokens if token < vocab], dtype=torch.long),
            writes_every_byte=set(range(256)) <= {token[0] for token in view.tokens if len(token) == 1},
        )
        self._compiled: OrderedDict[Constraint, object] = OrderedDict()
        self._lock = threading.Lock()

    def start(self, constraint: Constraint) -> SequenceGrammar:
        """A fresh matcher of ``constraint`` for one sequence."""
        matcher = self.compile(constraint).deep_copy()
        return SequenceGrammar(matcher, self.vocab, self.forced_drafts, self.rules, self.tokenizer)

    def check(self, constraint: Constraint) -> None:
        """Compile ``constraint`` (:meth:`compile`) and refuse it where this vocabulary cannot begin any output it
        allows: known before decoding, unlike a dead end reached after the model's own choices."""
        grammar = self.start(constraint)
        if grammar.admitted().any() or grammar.matcher.is_accepting() or grammar.matcher.is_stopped():
            return
        forced = grammar.matcher.compute_ff_bytes().decode(errors="replace")
        begins = f" (it begins with {forced!r})" if forced else ""
        raise SpecDecodeError(
            f"no token of this model's vocabulary can begin the output the {constraint.kind} allows{begins}"
        )

    def compile(self, constraint: Constraint):
        """``constraint``'s compiled matcher, at its start (an ``llguidance.LLMatcher``; copy it to use it).  What
        only this tokenizer can tell is wrong with it is a :class:`SpecDecodeError`."""
        import llguidance

        with self._lock:
            compiled = self._compiled.pop(constraint, None)
            if compiled is None:
                compiled = llguidance.LLMatcher(self.tokenizer, constraint.engine_grammar, log_level=0)
                if compiled.is_error():
                    raise SpecDecodeError(f"invalid {constraint.kind}: {compiled.get_error().strip().splitlines()[0]}")
            self._compiled[constraint] = compiled
            while len(self._compiled) > self.CACHE_SIZE:
                self._compiled.popitem(last=False)
        return compiled


@dataclass(frozen=True)
class _MaskRules:
    """What a mask needs to know of the vocabulary besides llguidance's mask (:func:`_admitted`)."""

    ends: torch.Tensor  # the end-of-sequence tokens llguidance admits at a dead end
    writes_every_byte: bool  # every byte is some token's whole text: llguidance's mask after forced bytes holds


class SequenceGrammar:
    """One sequence's grammar state: a matcher advanced over its accepted tokens only (:meth:`advance`), the mask of
    each verified row (:meth:`row_masks`, on copies of it), and what the grammar says of a draft before it is verified
    (:meth:`valid_nodes`, :meth:`forced`, :meth:`forced_after`)."""

    def __init__(self, matcher, vocab: int, forced_drafts: bool, rules: _MaskRules, tokenizer) -> None:
        self.matcher = matcher
        self.tokenizer = tokenizer  # the llguidance tokenizer the matcher was compiled for
        self.vocab = vocab
        self.forced_drafts = forced_drafts
        self.rules = rules
        self.mask_s = 0.0  # seconds spent on masks, draft checks and forced tokens
        self._here: torch.Tensor | None = None  # the mask where the matcher stands, once computed

    @property
    def complete(self) -> bool:
        """The grammar admits nothing more (it is complete, or at a dead end): the output ends here."""
        admitted = self.admitted()  # first: llguidance finds a completion only as it computes the mask
        return self.matcher.is_stopped() or not bool(admitted.any())

    def admitted(self) -> torch.Tensor:
        """[vocab] bool: the tokens the grammar admits where the matcher stands (none at a dead end)."""
        if self._here is None:
            tick = time.perf_counter()
            words = (self.vocab + 31) // 32
            bitmask = torch.empty((1, words), dtype=torch.int32)
            self.matcher.unsafe_compute_mask_ptr(bitmask.data_ptr(), 4 * words)
            self._here = _admitted(self.matcher, _unpack(bitmask, self.vocab)[0], self.rules)
            self.mask_s += time.perf_counter() - tick
        return self._here

    def advance(self, tokens: list[int]) -> int:
        """Consume accepted ``tokens`` up to the grammar's completion or a dead end; how many it took (the rest are
        not output).  Each token is checked against the mask where it was chosen, the one its row was verified with:
        a token it refuses, or one the matcher refuses although the mask admits it, is a :class:`GrammarFailure`."""
        for taken, token in enumerate(tokens):
            if self.complete:
                return taken
            if not self.admitted()[token]:
                raise GrammarFailure(f"a token the grammar's mask refuses was chosen: {token}")
            self._here = None
            if not self.matcher.consume_token(token):
                raise GrammarFailure(f"the grammar refuses a token its mask admits: {self.matcher.get_error()}")
        return len(tokens)

    def forced(self) -> list[int]:
        """The tokens the grammar admits as the only continuation here (keys, quotes, brackets, the rest of a choice),
        as the tokenizer writes that text; llguidance holds back a last token that a longer one might extend.  Empty
        when this sequence does not draft them."""
        if not self.forced_drafts:
            return []
        tick = time.perf_counter()
        tokens = self.matcher.compute_ff_tokens()
        self.mask_s += time.perf_counter() - tick
        return tokens

    def forced_after(self, path: list[int]) -> list[int]:
        """What to draft after ``path`` (tokens the grammar admits here): the tokens it then forces, and the forced
        bytes llguidance holds back (the `` "`` that opens a string) as the tokenizer writes them, as far as the grammar
        admits them.  Those last are a guess: the target may write the same bytes with a longer token (`` "M``), which
        verification finds, so they change no output.  Empty when this sequence does not draft forced tokens."""
        if not self.forced_drafts:
            return []
        tick = time.perf_counter()
        matcher = self.matcher
        if path:
            matcher = matcher.deep_copy()
            matcher.consume_tokens(path)
        tokens = matcher.compute_ff_tokens()
        held_back = matcher.compute_ff_bytes()[len(self.tokenizer.decode_bytes(tokens)) :]
        if held_back:
            guess = tokens + self.tokenizer.tokenize_bytes(held_back)
            tokens = guess[: matcher.validate_tokens(guess)]
        self.mask_s += time.perf_counter() - tick
        return tokens

    def row_masks(self, draft: Draft) -> torch.Tensor:
        """[nodes + 1, vocab] bool: the tokens the grammar admits at each verification row (:func:`row_masks`)."""
        return row_masks([(self, draft)])[0]

    def valid_nodes(self, draft: Draft) -> list[int]:
        """The draft's nodes whose path the grammar accepts (closed under ancestors, in order)."""
        tick = time.perf_counter()
        if draft.is_chain:
            kept = list(range(self.matcher.validate_tokens(draft.tokens))) if draft.tokens else []
        else:
            paths = draft.row_paths()[1:]
            valid: list[bool] = []
            for node, parent in enumerate(draft.parent_list):
                ok = (parent < 0 or valid[parent]) and self.matcher.validate_tokens(paths[node]) == len(paths[node])
                valid.append(ok)
            kept = [node for node, ok in enumerate(valid) if ok]
        self.mask_s += time.perf_counter() - tick
        return kept


def _admitted(matcher, mask: torch.Tensor, rules: _MaskRules) -> torch.Tensor:
    """llguidance's ``mask`` where ``matcher`` stands (changed in place), made exactly what the matcher accepts: less
    the end-of-sequence token where the grammar cannot end (llguidance's answer to a dead end), and, where the grammar
    forces bytes that the vocabulary may have no token for, less each token the matcher refuses."""
    if not matcher.is_accepting():
        mask[rules.ends] = False
    if not rules.writes_every_byte and matcher.compute_ff_bytes():
        for token in mask.nonzero().flatten().tolist():
            mask[token] = matcher.validate_tokens([token]) == 1
    return mask


def row_masks(drafts: Sequence[tuple[SequenceGrammar, Draft]]) -> list[torch.Tensor]:
    """Each sequence's [nodes + 1, vocab] bool masks: the tokens its grammar admits at each verification row, after its
    accepted tokens and the row's draft path; the rows of every sequence of a batch computed together, by one
    llguidance executor call (its threads work on several rows at once where the CPU has room).

    A copy of each sequence's matcher walks its draft's paths (consuming, and rolling back to the shared prefix of
    the next path: a chain is walked once) and leaves a copy of itself at each row; the sequence's own matcher never
    moves.  Three kinds of row admit everything, as what they choose is never output: a row behind a token the grammar
    refuses (that token has probability 0, so the row is never reached), a row past the grammar's completion, and a
    row at a dead end (the output ends before these two, :meth:`SequenceGrammar.advance`)."""
    tick = time.perf_counter()
    vocab = drafts[0][0].vocab
    words = (vocab + 31) // 32
    sizes = [len(draft.tokens) + 1 for _, draft in drafts]
    bitmask = torch.full((sum(sizes), words), -1, dtype=torch.int32)
    jobs, job_rules = [], []
    first = 0
    for (grammar, draft), size in zip(drafts, sizes):
        walker, walked = grammar.matcher.deep_copy(), []
        for row, path in enumerate(draft.row_paths()):
            shared = next((i for i, (a, b) in enumerate(zip(walked, path)) if a != b), min(len(walked), len(path)))
            if len(walked) > shared:
                walker.rollback(len(walked) - shared)
            taken = walker.try_consume_tokens(path[shared:])
            walked = path[: shared + taken]
            if len(walked) == len(path) and not walker.is_stopped():
                jobs.append((walker.deep_copy(), first + row))
                job_rules.append(grammar.rules)
        first += size
    if jobs:
        _executor().unsafe_compute_mask_ptr(jobs, bitmask.data_ptr(), 4 * words, len(bitmask))
    unpacked = _unpack(bitmask, vocab)
    for (matcher, row), rules in zip(jobs, job_rules):
        if not _admitted(matcher, unpacked[row], rules).any():
            unpacked[row] = True
    masks = list(unpacked.split(sizes))
    spent = (time.perf_counter() - tick) / len(drafts)
    for grammar, _ in drafts:
        grammar.mask_s += spent
    return masks


@functools.cache
def _executor():
    import llguidance

    return llguidance.LLExecutor()


_BITS = torch.arange(32, dtype=torch.int32)


def _unpack(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, words] int32 bitmask (bit b of word w: token 32 w + b) → [rows, vocab] bool."""
    return ((bitmask.unsqueeze(-1) >> _BITS) & 1).bool().flatten(1)[:, :vocab]
