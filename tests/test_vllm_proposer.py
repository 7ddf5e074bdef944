"""specdecode's drafters as vLLM's custom proposer (``specdecode.integrations.vllm_proposer``).

The adapter is tested on the inputs vLLM hands a proposer, faked: no vLLM needed.  The end-to-end test starts
vLLM's CPU build (``tools/vllm_cpu.py serve --proposer suffix``; skipped where its venv is absent) and checks
that its greedy texts equal our plain decoding's and that it accepted drafted tokens.  Starting vLLM takes one
to three minutes."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import numpy as np
import openai
import pytest

from specdecode.generator import SpeculativeGenerator
from specdecode.integrations.vllm_proposer import PROPOSERS, CacheBackProposer, SuffixProposer, main_path
from specdecode.types import Draft

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import vllm_cpu  # noqa: E402  (a tool script, not a package module)

MAX_MODEL_LEN = 64


def vllm_config(draft_tokens: int = 4) -> SimpleNamespace:
    """The fields of vLLM's ``VllmConfig`` a proposer reads."""
    return SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=draft_tokens),
        model_config=SimpleNamespace(max_model_len=MAX_MODEL_LEN),
    )


class FakeBatch:
    """vLLM's persistent batch as a proposer sees it: a row of tokens per request, rows condensed when one leaves."""

    def __init__(self) -> None:
        self.rows: list[list[int]] = []

    def step(self, sampled: list[list[int]]) -> tuple[list[list[int]], np.ndarray, np.ndarray]:
        """Append each row's sampled tokens; the arguments of ``propose``."""
        for row, tokens in zip(self.rows, sampled, strict=True):
            row.extend(tokens)
        token_ids = np.zeros((max(len(self.rows), 1), MAX_MODEL_LEN), dtype=np.int32)
        for index, row in enumerate(self.rows):
            token_ids[index, : len(row)] = row
        return sampled, np.array([len(row) for row in self.rows], dtype=np.int32), token_ids


REPEATED = [5, 6, 7, 8, 9, 10, 11, 12]


def test_each_row_gets_its_draft_capped_and_a_row_that_sampled_nothing_gets_none():
    proposer = SuffixProposer(vllm_config(draft_tokens=4))
    batch = FakeBatch()
    batch.rows = [[*REPEATED, *REPEATED[:2]], [1, 2, 3]]
    drafts = proposer.propose(*batch.step([[], []]))
    assert drafts == [[], []]  # prompts being read: nothing sampled yet
    drafts = proposer.propose(*batch.step([[7], []]))
    assert drafts == [[8, 9, 10, 11], []]
    batch.rows[0] = [*REPEATED * 7, 5]  # 57 tokens: room for 6 more, so a draft of at most 5
    sampled, lengths, token_ids = batch.step([[6], [4]])
    assert len(proposer.propose(sampled, lengths, token_ids)[0]) <= MAX_MODEL_LEN - 58 - 1


def test_a_request_keeps_its_session_when_its_row_moves():
    proposer = PROPOSERS["cacheback"](vllm_config())
    batch = FakeBatch()
    batch.rows = [[1, 2, 3], [4, 5, 6]]
    proposer.propose(*batch.step([[9], [9]]))
    second = next(tracked.session for tracked in proposer.tracked if tracked.row == 1)
    del batch.rows[0]  # the first request ends: vLLM moves the second into row 0
    proposer.propose(*batch.step([[7]]))
    assert [tracked.session for tracked in proposer.tracked] == [second]


def test_a_request_that_leaves_the_batch_teaches_the_next_one():
    proposer = SuffixProposer(vllm_config(draft_tokens=4))
    batch = FakeBatch()
    answer = [40, 41, 42, 43, 44, 45]
    batch.rows = [[1, 2, 3]]
    proposer.propose(*batch.step([[answer[0]]]))
    proposer.propose(*batch.step([answer[1:]]))
    assert proposer.drafter.global_size == 0  # still running: nothing remembered yet
    batch.rows = [[7, 8, answer[0]]]  # the first request ended; another prompt ends as its answer began
    drafts = proposer.propose(*batch.step([[answer[1]]]))
    assert proposer.drafter.global_size == len(answer)
    assert drafts == [answer[2:6]]


def test_a_new_request_whose_prompt_differs_gets_a_session_of_its_own():
    proposer = CacheBackProposer(vllm_config())
    batch = FakeBatch()
    batch.rows = [[1, 2, 3]]
    proposer.propose(*batch.step([[4]]))
    first = proposer.tracked[0].session
    batch.rows = [[1, 2, 9]]
    proposer.propose(*batch.step([[4]]))
    assert proposer.tracked[0].session is not first


def test_a_tree_becomes_its_path_through_first_children():
    tree = Draft(tokens=[10, 11, 20, 12, 21], parents=[-1, 0, -1, 1, 2])
    assert main_path(tree) == [10, 11, 12]
    assert main_path(Draft(tokens=[3, 4])) == [3, 4]


def test_the_proposer_module_loads_without_transformers():
    """vLLM's venv has a transformers of its own; importing ours there would break one or the other."""
    code = "import sys, specdecode.integrations.vllm_proposer\nprint(sorted({'transformers'} & set(sys.modules)))"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert result.stdout.strip() == "[]"


def test_the_launcher_refuses_two_speculative_methods():
    command = [sys.executable, str(ROOT / "tools" / "vllm_cpu.py"), "serve", "smollm2-135m", "--ngram", "4"]
    result = subprocess.run([*command, "--proposer", "suffix"], capture_output=True, text=True)
    assert result.returncode == 2 and "choose one" in result.stderr


# -- vLLM itself ---------------------------------------------------------------------------------------------------

PROMPTS = [
    "Repeat this sentence three times: the quick brown fox jumps over the lazy dog.",
    "Write a Python function that reverses a string.",
    "Repeat this sentence three times: the quick brown fox jumps over the lazy dog.",
]
NEW_TOKENS = 48


@pytest.fixture(scope="module")
def vllm_suffix_url():
    if not vllm_cpu.python().exists():
        pytest.skip(f"vLLM's CPU build is not installed in {vllm_cpu.VENV}: python tools/vllm_cpu.py setup")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, str(ROOT / "tools" / "vllm_cpu.py"), "serve", "smollm2-135m", "--port", str(port)]
    command += ["--proposer", "suffix"]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 400
        while True:
            assert server.poll() is None, server.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "vLLM did not start within 400 s"
            try:
                if httpx.get(f"{url}/v1/models", timeout=2, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(2)
        yield url
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)


def accepted_tokens(url: str) -> float:
    metrics = httpx.get(f"{url}/metrics", timeout=10, trust_env=False).text
    found = re.search(r"^vllm:spec_decode_num_accepted_tokens_total(?:\{[^}]*\})? (\S+)$", metrics, re.MULTILINE)
    assert found, "vLLM exposes no spec_decode_num_accepted_tokens_total: is speculation on?"
    return float(found.group(1))


@pytest.mark.real_model
@pytest.mark.slow
def test_vllm_with_our_suffix_proposer_answers_as_plain_decoding(vllm_suffix_url, smollm2):
    client = openai.OpenAI(base_url=f"{vllm_suffix_url}/v1", api_key="unused", max_retries=0, timeout=120)
    ours = SpeculativeGenerator.build(smollm2, "none")
    for prompt in PROMPTS:
        reply = client.chat.completions.create(
            model="smollm2-135m",
            messages=[{"role": "user", "content": prompt}],
            max_tokens=NEW_TOKENS,
            temperature=0,
        )
        expected = ours.generate(prompt, chat=True, max_new_tokens=NEW_TOKENS)
        assert reply.choices[0].message.content == expected.text, prompt
    assert accepted_tokens(vllm_suffix_url) > 0
