"""vLLM's CPU build drafting with the EAGLE-3 head the package ships for ``smollm2-135m``, exported by ``specdecode
export eagle``: its greedy texts equal our plain decoding's and it accepts drafted tokens.

Skipped where vLLM's venv is absent (``python tools/vllm_cpu.py setup``).  Starting vLLM takes one to three
minutes."""

from __future__ import annotations

import pytest

from specdecode.cli import main
from vllm_server import accepted_tokens, assert_greedy_texts_equal_ours, require_vllm, vllm_serving

# One worker runs every vLLM test, one server at a time (each module starts its own).
pytestmark = pytest.mark.xdist_group("vllm")

PROMPTS = [
    "Name three primary colours.",
    "Write a Python function that reverses a string.",
    "Explain in two sentences why the sky is blue.",
]
NEW_TOKENS = 48


@pytest.fixture(scope="module")
def vllm_eagle_url(tmp_path_factory):
    require_vllm()
    head = tmp_path_factory.mktemp("export") / "eagle3"
    assert main(["export", "eagle", "--model", "smollm2-135m", "--out", str(head)]) == 0
    with vllm_serving("--eagle", str(head), "--num-speculative-tokens", "3") as url:
        yield url


@pytest.mark.real_model
@pytest.mark.slow
def test_vllm_drafts_with_our_shipped_head_and_answers_as_plain_decoding(vllm_eagle_url, smollm2):
    assert_greedy_texts_equal_ours(vllm_eagle_url, smollm2, PROMPTS, NEW_TOKENS)
    assert accepted_tokens(vllm_eagle_url) > 0
