"""Incremental detokenisation (``TextAssembler``): the released pieces add up to the whole output's text, never
split a character, hold a stop string back until it is decided, and cost work in proportion to the new tokens."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode

from specdecode.config import GenerationConfig
from specdecode.engine import DecodeOutcome
from specdecode.generator import SpeculativeGenerator, TextAssembler
from tiny_models import tiny_model

TEXTS = ["héllo wörld, 日本語のテキスト 🙂 done", "plain ascii text with spaces", "ß" * 7 + " 🙂🙂 end"]


@pytest.fixture(scope="module")
def byte_generator() -> SpeculativeGenerator:
    """A byte-level tokenizer (one token per byte, as GPT-2's byte alphabet): every character beyond ASCII spans
    several tokens."""
    alphabet = bytes_to_unicode()
    backend = Tokenizer(models.BPE(vocab={alphabet[b]: b for b in range(256)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    return SpeculativeGenerator.build(tiny_model(tokenizer, seed=0), "none")


def assemble(generator, ids: list[int], steps: list[int], stop: tuple[str, ...] = ()) -> tuple[list[str], str]:
    assembler = TextAssembler(generator, [0], GenerationConfig(stop=stop))
    pieces, at = [], 0
    for size in steps:
        if at >= len(ids) or assembler.stopped:
            break
        pieces.append(assembler.add(ids[at : at + size]).text)
        at += size
    final = assembler.finish(DecodeOutcome())
    pieces.append(final.text)
    return pieces, final.result.text


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_pieces_add_up_to_the_text_and_never_split_a_character(byte_generator, text, seed):
    ids = byte_generator.target.tokenizer.encode(text)
    assert len(ids) > len(text) or text.isascii()  # characters do span tokens
    steps = [random.Random(seed).randint(1, 4) for _ in ids]
    pieces, whole = assemble(byte_generator, ids, steps)
    assert "".join(pieces) == whole == text
    assert not any("\ufffd" in piece for piece in pieces)


def test_a_stop_string_is_held_back_and_cuts_the_text(byte_generator):
    text = "héllo wörld and more"
    ids = byte_generator.target.tokenizer.encode(text)
    pieces, whole = assemble(byte_generator, ids, [1] * len(ids), stop=("wör",))
    assert whole == "héllo " and "".join(pieces) == whole


def test_an_incomplete_character_at_the_end_is_kept_as_the_tokenizer_decodes_it(byte_generator):
    ids = byte_generator.target.tokenizer.encode("ok 日")[:-1]  # the last character's final byte is missing
    pieces, whole = assemble(byte_generator, ids, [1] * len(ids))
    assert whole == byte_generator.target.tokenizer.decode(ids) and whole.endswith("\ufffd")
    assert "".join(pieces) == whole


def test_work_grows_with_the_new_tokens_not_with_the_whole_output(byte_generator, monkeypatch):
    decoded = []
    decode = byte_generator._decode
    monkeypatch.setattr(byte_generator, "_decode", lambda ids, *skip: decoded.append(len(ids)) or decode(ids, *skip))
    ids = byte_generator.target.tokenizer.encode("abcdefghij " * 40)
    pieces, whole = assemble(byte_generator, ids, [1] * len(ids))
    assert whole == "abcdefghij " * 40
    assert sum(decoded) < 8 * len(ids)  # a whole-output decode per step would read len(ids)**2 / 2
