"""Tiny randomly initialised models with a real (tiny) tokenizer, built in milliseconds: what the fixtures in
``conftest.py`` save to disk and what tests build in memory (import from here, not from ``conftest``)."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from specdecode.models.hf import HFCausalLM
from specdecode.models.loading import LoadedModel

TINY_VOCAB = 96
TINY_CONTEXT = 256
CHAT_TEMPLATE = (
    "{% for m in messages %}<s> {{ m['role'] }} : {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<s> assistant : {% endif %}"
)


def tiny_tokenizer(words: list[str]) -> PreTrainedTokenizerFast:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for word in words:
        vocab.setdefault(word, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="</s>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_words(n: int = TINY_VOCAB - 3, prefix: str = "w") -> list[str]:
    base = ["system", "user", "assistant", ":", "stop", "here"]
    return base + [f"{prefix}{i}" for i in range(n - len(base))]


def tiny_llama(seed: int, layers: int = 2, hidden: int = 64, context: int = TINY_CONTEXT) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=TINY_VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=context,
        initializer_range=0.3,  # peaky logits: greedy choices are far from numerical ties
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    return LlamaForCausalLM(config).eval()


def save_tiny(
    path: Path,
    seed: int,
    words: list[str] | None = None,
    layers: int = 2,
    context: int = TINY_CONTEXT,
    hidden: int = 64,
) -> Path:
    tiny_llama(seed, layers=layers, hidden=hidden, context=context).save_pretrained(path)
    tiny_tokenizer(words or tiny_words()).save_pretrained(path)
    return path


def wrap(model, tokenizer, name: str = "tiny") -> LoadedModel:
    return LoadedModel(name=name, backend=HFCausalLM(model, name), tokenizer=tokenizer)


def bpe_tokenizer(pieces: list[str], merges: list[tuple[str, str]] = ()) -> PreTrainedTokenizerFast:
    """A BPE over the given pieces (characters, or merges of them), no pre-tokeniser, no specials."""
    backend = Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=list(merges)))
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def tiny_model(tokenizer, seed: int, layers: int = 2) -> LoadedModel:
    """A tiny random Llama over ``tokenizer``'s vocabulary (its EOS, if it has one), loaded in memory."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.3,
        eos_token_id=tokenizer.eos_token_id,
    )
    return wrap(LlamaForCausalLM(config).eval(), tokenizer, name=f"tiny-{seed}")
