"""Chat text no benchmark prompt is drawn from, rendered for one model: what drafters are fitted to.

Two users: head training (``specdecode train``) prefills these ShareGPT conversations for the target's
features, and VocabTrim (:mod:`specdecode.drafters._vocab`) drafts over the tokens most frequent in them.
The benchmark takes the first prompts of each task in a seeded order; this text starts after
:data:`BENCH_PROMPTS_SKIPPED` of them, so no measured prompt is ever trained or ranked on.
"""

from __future__ import annotations

import hashlib
import json
import sys
import weakref
from functools import partial
from typing import TYPE_CHECKING

import torch

from specdecode.data.datasets import sharegpt_records
from specdecode.data.tasks import load_task
from specdecode.errors import SpecDecodeError
from specdecode.heads.files import replace_atomically
from specdecode.models.cache import cache_dir

if TYPE_CHECKING:
    from specdecode.models.loading import LoadedModel

#: The first prompts of each task (seed 0) are the ones ``specdecode bench`` measures; training skips them.
BENCH_PROMPTS_SKIPPED = 8
#: Conversations a token ranking counts: 2.5M tokens of Qwen's tokenizer, about 10 s, once per tokenizer.
#: With Qwen2.5-Coder-1.5B's own greedy answers as the measure, the 32,768 most frequent of 5,000
#: conversations missed 1.1% of its tokens where its tokenizer's first 32,768 ids missed 2.7%.
RANKING_CONVERSATIONS = 2000
_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "assistant": "assistant"}


def sharegpt_conversations(target: LoadedModel, n: int, max_tokens: int, seed: int = 0) -> list[list[int]]:
    """Up to ``n`` ShareGPT conversations none of whose opening turns the benchmark draws, rendered with the
    model's chat template (plain text joined by blank lines without one), cut to ``max_tokens``."""
    benchmark = {p.text for p in load_task("sharegpt", 4 * BENCH_PROMPTS_SKIPPED, seed).prompts}
    tokenizer = target.tokenizer
    out: list[list[int]] = []
    for record in sharegpt_records():
        if len(out) >= n:
            break
        turns = record.get("conversations") if isinstance(record, dict) else None
        if not turns:
            continue
        messages = [
            {"role": _ROLES[t.get("from")], "content": str(t.get("value", ""))}
            for t in turns
            if isinstance(t, dict) and t.get("from") in _ROLES and str(t.get("value", "")).strip()
        ]
        if len(messages) < 2 or messages[0]["role"] != "user" or messages[0]["content"].strip() in benchmark:
            continue
        if getattr(tokenizer, "chat_template", None):
            ids = list(tokenizer.apply_chat_template(messages, tokenize=True))
        else:
            ids = tokenizer("\n\n".join(m["content"] for m in messages), add_special_tokens=True)["input_ids"]
        if len(ids) >= 16:
            out.append(ids[:max_tokens])
    return out


#: Ranking keys of the tokenizers seen in this process: hashing Qwen's 152k tokens takes a noticeable fraction of a
#: second, which every drafter built with VocabTrim would pay.
_KEYS: weakref.WeakKeyDictionary[object, str] = weakref.WeakKeyDictionary()


def _ranking_key(model: LoadedModel) -> str:
    """Names the tokenizer (every token and its id, the chat template) and what was counted; once per tokenizer."""
    tokenizer = model.tokenizer
    key = _KEYS.get(tokenizer)
    if key is None:
        text = json.dumps(
            [sorted(tokenizer.get_vocab().items()), getattr(tokenizer, "chat_template", None), RANKING_CONVERSATIONS]
        )
        key = _KEYS[tokenizer] = hashlib.sha256(text.encode()).hexdigest()[:16]
    return key


def token_ranking(model: LoadedModel, vocab_size: int) -> torch.Tensor | None:
    """Every id below ``vocab_size`` from the most to the least frequent in :data:`RANKING_CONVERSATIONS`
    conversations rendered for ``model`` (ties by id), counted once per tokenizer and kept in
    ``<cache>/token-rankings/``; None, with a warning, when the conversations cannot be loaded."""
    path = cache_dir() / "token-rankings" / f"{_ranking_key(model)}-{vocab_size}.pt"
    if path.is_file():
        return torch.load(path)
    print("specdecode: counting token frequencies for VocabTrim (once for this tokenizer) ...", file=sys.stderr)
    try:
        conversations = sharegpt_conversations(model, RANKING_CONVERSATIONS, max_tokens=4096)
    except SpecDecodeError as exc:
        print(f"specdecode: warning: VocabTrim falls back to the first token ids: {exc}", file=sys.stderr)
        return None
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids in conversations:
        tokens = torch.tensor(ids, dtype=torch.long)
        counts += torch.bincount(tokens[tokens < vocab_size], minlength=vocab_size)
    ranking = torch.argsort(counts, descending=True, stable=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_atomically(path, partial(torch.save, ranking))  # two processes may count at once
    return ranking
