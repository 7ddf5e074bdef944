"""The grammar engine behind structured outputs (llguidance): a request's :class:`~specdecode.constraints.Constraint`
compiled once for a tokenizer, and each sequence's matcher.

A constraint is one more step of the per-row processing (:mod:`specdecode.logits_processing`): the mask at a verified
row is the grammar's after the sequence's accepted tokens *and* that row's draft path, so the row is the masked
distribution plain constrained decoding reads at that position.  The sequence's matcher itself only ever advances over
accepted tokens; a row's path is consumed and rolled back (llguidance's ``rollback``), so a rejected draft leaves no
trace in it.
"""

from __future__ import annotations

import json
import re
import threading

from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode

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
