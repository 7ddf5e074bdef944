"""specdecode's drafters as vLLM's custom proposer (``specdecode.integrations.vllm_proposer``).

The adapter is tested on the inputs vLLM hands a proposer, faked: no vLLM needed.  The end-to-end test starts
vLLM's CPU build (``tools/vllm_cpu.py serve --proposer suffix``; skipped where its venv is absent) and checks
that its greedy texts equal our plain decoding's and that it accepted drafted tokens.  Starting vLLM takes one
to three minutes."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from specdecode.integrations.vllm_proposer import PROPOSERS, CacheBackProposer, SuffixProposer, main_path
from specdecode.types import Draft
from vllm_server import ROOT, accepted_tokens, assert_greedy_texts_equal_ours, vllm_serving

# One worker runs every vLLM test, one server at a time (each module starts its own).
pytestmark = pytest.mark.xdist_group("vllm")

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
    with vllm_serving("--proposer", "suffix") as url:
        yield url


@pytest.mark.real_model
@pytest.mark.slow
def test_vllm_with_our_suffix_proposer_answers_as_plain_decoding(vllm_suffix_url, smollm2):
    assert_greedy_texts_equal_ours(vllm_suffix_url, smollm2, PROMPTS, NEW_TOKENS)
    assert accepted_tokens(vllm_suffix_url) > 0
