"""Penalties, logit bias, min-p, min_tokens and stop token ids: each verified row is processed with its own prefix
(the context and the draft tokens on the path to it), so speculative output equals plain decoding with the same
settings — greedy, for every kind of drafter, chains and trees, alone and batched — and sampling still follows the
processed target exactly (chi-square, with a control that forgets the draft tokens and must fail)."""

from __future__ import annotations

import dataclasses
import itertools
import json

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import MinPLogitsWarper, RepetitionPenaltyLogitsProcessor

from helpers import DRAWS, FAIL_P, PASS_P, PROMPTS, BigramLM, V, WrongBranchTree, chi2_pvalue
from specdecode.batch_engine import BatchEngine, BatchRequest
from specdecode.cli import main
from specdecode.config import GenerationConfig
from specdecode.draft_length.factory import make_policy
from specdecode.drafters import create_drafter
from specdecode.drafters.base import Drafter, StatelessSession
from specdecode.engine import speculative_decode
from specdecode.errors import SpecDecodeError
from specdecode.generator import SpeculativeGenerator
from specdecode.logits_processing import RowHistory, process_rows
from specdecode.sampling import sampling_probs
from specdecode.sampling_params import SamplingParams
from specdecode.types import Draft
from tiny_models import TINY_VOCAB

PENALTIES = SamplingParams(presence_penalty=0.8, frequency_penalty=0.6, repetition_penalty=1.4)
BIAS = SamplingParams(logit_bias={7: 4.0, 9: 3.5, 11: -100.0}, repetition_penalty=1.2)


def decode(target, drafter, prompt, config, eos=frozenset()) -> list[int]:
    return [t for chunk in speculative_decode(target.backend, drafter, prompt, config, eos) for t in chunk]


def plain(target, prompt, config, eos=frozenset()) -> list[int]:
    return decode(target, create_drafter("none", target), prompt, config, eos)


def wrong_branch_tree(target, truth: list[int], prompt_len: int) -> WrongBranchTree:
    return WrongBranchTree(target, truth, prompt_len, lambda token: (token + 1) % TINY_VOCAB)


def drafters(target, draft):
    return {
        "pld": create_drafter("pld", target),
        "suffix": create_drafter("suffix", target),
        "draft-model": create_drafter("draft-model", target, draft_model=draft),
    }


CASES = {
    "penalties": dict(sampling=PENALTIES),
    "bias": dict(sampling=BIAS),
    "min-p-ignored-when-greedy": dict(sampling=dataclasses.replace(PENALTIES, min_p=0.3)),
}


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("k", [3, 6])
def test_greedy_output_with_processing_equals_plain_decoding(tiny_target, tiny_draft, case, k):
    for prompt in PROMPTS:
        config = GenerationConfig(max_new_tokens=40, num_draft_tokens=k, **CASES[case])
        expected = plain(tiny_target, prompt, config)
        assert expected != plain(tiny_target, prompt, GenerationConfig(max_new_tokens=40)), "processing changed nothing"
        for name, drafter in drafters(tiny_target, tiny_draft).items():
            assert decode(tiny_target, drafter, prompt, config) == expected, f"{name} (k={k}, {case})"
        tree = wrong_branch_tree(tiny_target, expected, len(prompt))
        assert decode(tiny_target, tree, prompt, config) == expected, f"tree (k={k}, {case})"


def test_min_tokens_holds_back_the_stop_tokens_until_then(tiny_target, tiny_draft):
    prompt = PROMPTS[0]
    free = plain(tiny_target, prompt, GenerationConfig(max_new_tokens=40))
    stop = free[2]  # plain decoding would end at its third token
    config = GenerationConfig(max_new_tokens=40, num_draft_tokens=4, stop_token_ids=(stop,), min_tokens=12)
    expected = plain(tiny_target, prompt, config)
    assert len(expected) >= 12 and stop not in expected[:11]
    assert plain(tiny_target, prompt, dataclasses.replace(config, min_tokens=0)) == free[: free.index(stop) + 1]
    eos_config = dataclasses.replace(config, stop_token_ids=(), min_tokens=12)
    eos_expected = plain(tiny_target, prompt, eos_config, eos=frozenset({stop}))
    assert stop not in eos_expected[:11]
    for name, drafter in drafters(tiny_target, tiny_draft).items():
        assert decode(tiny_target, drafter, prompt, config) == expected, name
        assert decode(tiny_target, drafter, prompt, eos_config, frozenset({stop})) == eos_expected, name
    tree = wrong_branch_tree(tiny_target, expected, len(prompt))
    assert decode(tiny_target, tree, prompt, config) == expected


def test_stop_token_ids_end_the_request_even_with_ignore_eos(tiny_target):
    prompt = PROMPTS[0]
    free = plain(tiny_target, prompt, GenerationConfig(max_new_tokens=30))
    config = GenerationConfig(max_new_tokens=30, ignore_eos=True, stop_token_ids=(free[5],))
    assert plain(tiny_target, prompt, config, eos=frozenset({free[2]})) == free[: free.index(free[5]) + 1]


def test_a_batch_with_mixed_settings_gives_each_sequence_its_plain_output(tiny_target, tiny_draft):
    settings = [
        dict(sampling=PENALTIES),
        dict(sampling=BIAS),
        {},
        dict(sampling=SamplingParams(frequency_penalty=1.5), min_tokens=5, stop_token_ids=(3,)),
        dict(sampling=dataclasses.replace(PENALTIES, temperature=0.8, seed=4, min_p=0.05)),
    ]
    requests = [
        (prompt, GenerationConfig(max_new_tokens=30, num_draft_tokens=3, **setting))
        for prompt, setting in zip(itertools.cycle(PROMPTS), settings)
    ]
    expected = [plain(tiny_target, prompt, config) for prompt, config in requests]
    for name, drafter in {**drafters(tiny_target, tiny_draft), "none": create_drafter("none", tiny_target)}.items():
        engine = BatchEngine(
            tiny_target.backend, drafter, lambda config, _: make_policy(config.num_draft_tokens), frozenset(), 8
        )
        for index, (prompt, config) in enumerate(requests):
            engine.submit(BatchRequest(prompt, config, tag=index))
        outputs: dict[int, list[int]] = {index: [] for index in range(len(requests))}
        for event in engine.run():
            outputs[event.tag].extend(event.new_tokens)
        assert [outputs[index] for index in range(len(requests))] == expected, name


def test_seeded_sampling_with_processing_is_the_same_text_with_every_drafter(tiny_target, tiny_draft):
    sampling = dataclasses.replace(BIAS, temperature=0.9, seed=11, min_p=0.02, presence_penalty=0.5)
    config = GenerationConfig(max_new_tokens=40, num_draft_tokens=4, sampling=sampling)
    for prompt in PROMPTS:
        expected = plain(tiny_target, prompt, config)
        for name, drafter in drafters(tiny_target, tiny_draft).items():
            assert decode(tiny_target, drafter, prompt, config) == expected, name


def test_the_python_api_takes_the_settings_and_checks_token_ids(tiny_target):
    generator = SpeculativeGenerator.build(tiny_target, "pld")
    prompt = PROMPTS[1]
    config = GenerationConfig(max_new_tokens=20, ignore_eos=True, sampling=BIAS)
    result = generator.generate(
        prompt, max_new_tokens=20, ignore_eos=True, logit_bias={"7": 4.0, 9: 3.5, 11: -100}, repetition_penalty=1.2
    )
    assert result.token_ids == plain(tiny_target, prompt, config)
    with pytest.raises(SpecDecodeError, match="logit-bias ids must be in"):
        generator.generate(prompt, logit_bias={TINY_VOCAB: 1.0})
    with pytest.raises(SpecDecodeError, match="stop token ids must be in"):
        generator.generate(prompt, stop_token_ids=[TINY_VOCAB + 3])
    with pytest.raises(SpecDecodeError, match="presence-penalty"):
        generator.generate(prompt, presence_penalty=3.0)
    with pytest.raises(SpecDecodeError, match="min-tokens"):
        generator.generate(prompt, max_new_tokens=4, min_tokens=5)


# --- the definitions, one row at a time ---------------------------------------------------------------------


def reference_row(logits: torch.Tensor, prompt: list[int], output: list[int], sampling: SamplingParams) -> torch.Tensor:
    """vLLM's order, written out token by token: bias, repetition (prompt + output), frequency and presence (output)."""
    row = logits.double().clone()
    for token, bias in sampling.logit_bias:
        row[token] += bias
    penalty = sampling.repetition_penalty
    for token in set(prompt) | set(output):
        row[token] = row[token] / penalty if row[token] > 0 else row[token] * penalty
    for token in set(output):
        row[token] -= sampling.frequency_penalty * output.count(token) + sampling.presence_penalty
    return row.float()


def test_each_row_is_processed_with_its_own_path():
    generator = torch.Generator().manual_seed(0)
    vocab = 12
    draft = Draft(tokens=[3, 4, 3, 5, 3], parents=[-1, 0, 1, -1, 3])
    logits = 2 * torch.randn(len(draft.tokens) + 1, vocab, generator=generator)
    context = [1, 2, 3, 6, 6, 4]
    sampling = SamplingParams(presence_penalty=0.7, frequency_penalty=0.4, repetition_penalty=1.5, logit_bias={2: 1.0})
    processed = process_rows(logits, sampling, RowHistory(context, 3, draft))
    paths = [[], [3], [3, 4], [3, 4, 3], [5], [5, 3]]
    for row, path in enumerate(paths):
        expected = reference_row(logits[row], context[:3], context[3:] + path, sampling)
        torch.testing.assert_close(processed[row], expected)


def test_repetition_penalty_is_transformers_and_min_p_is_transformers():
    generator = torch.Generator().manual_seed(1)
    logits = 3 * torch.randn(4, 40, generator=generator)
    ids = torch.tensor([[4, 9, 9, 17, 30]])
    sampling = SamplingParams(repetition_penalty=1.7)
    ours = process_rows(logits, sampling, RowHistory([4, 9], 2, Draft(tokens=[9, 17, 30])))[3:]
    # Row 3 follows the path 9, 17, 30 — the prefix transformers is given.
    theirs = RepetitionPenaltyLogitsProcessor(1.7)(ids, logits[3:].clone())
    torch.testing.assert_close(ours, theirs)
    tempered = SamplingParams(temperature=0.7, min_p=0.1)
    warped = MinPLogitsWarper(0.1)(ids.expand(4, -1), logits / 0.7)
    torch.testing.assert_close(sampling_probs(logits, tempered), torch.softmax(warped, dim=-1))


def test_min_tokens_masks_the_rows_whose_prefix_is_short():
    logits = torch.zeros(4, 6)
    history = RowHistory([0, 1, 2], 1, Draft(tokens=[3, 3, 3]), stop_ids=frozenset({5}), min_tokens=4)
    processed = process_rows(logits, SamplingParams(), history)
    # Two tokens generated: rows 0 and 1 (2 and 3 tokens before them) may not stop, rows 2 and 3 may.
    assert processed[:2, 5].tolist() == [float("-inf")] * 2 and processed[2:, 5].tolist() == [0.0, 0.0]


# --- sampling: exact draws from the processed target, and a control with the wrong prefix -----------------

STRONG = SamplingParams(
    temperature=1.0, presence_penalty=1.0, frequency_penalty=1.2, repetition_penalty=1.6, logit_bias={2: 1.5}
)


class ChainDrafter(Drafter):
    """Proposes a chain from its own bigram table (point-mass proposals; rejection sampling corrects them)."""

    def __init__(self, table: torch.Tensor, branches: int = 1) -> None:
        super().__init__(target=None)
        self.table, self.branches = table, branches

    def session(self, request):
        return StatelessSession(self.propose)

    def propose(self, context, max_tokens) -> Draft:
        tokens, parents = [], []
        for branch in range(self.branches):
            last = (int(self.table[context[-1]].argmax()) + branch) % V
            parents.append(-1)
            tokens.append(last)
            for _ in range(max_tokens - 1):
                last = int(self.table[last].argmax())
                parents.append(len(tokens) - 1)
                tokens.append(last)
        return Draft(tokens=tokens, parents=parents if self.branches > 1 else None)


def joint_counts(sampling: SamplingParams, branches: int, draws: int) -> tuple[np.ndarray, np.ndarray]:
    """Counts of every 3-token output of the bigram toy after prompt [0, 1] (one step: 2 draft tokens and the
    target's), and the probabilities plain decoding with ``sampling`` gives each."""
    g = torch.Generator().manual_seed(3)
    target_table = 2.0 * torch.randn(V, V, generator=g)
    draft_table = target_table + 1.0 * torch.randn(V, V, generator=g)
    model, drafter = BigramLM(target_table), ChainDrafter(draft_table, branches)
    prompt = [0, 1]
    counts = np.zeros(V**3)
    for seed in range(draws):
        config = GenerationConfig(
            max_new_tokens=3, num_draft_tokens=2, sampling=dataclasses.replace(sampling, seed=seed, coupled=False)
        )
        a, b, c = [t for chunk in speculative_decode(model, drafter, prompt, config) for t in chunk]
        counts[(a * V + b) * V + c] += 1
    expected = np.zeros(V**3)
    for a, b, c in itertools.product(range(V), repeat=3):
        probability = 1.0
        for output, token in (([], a), ([a], b), ([a, b], c)):
            context = [*prompt, *output]
            row = reference_row(target_table[context[-1]], prompt, output, sampling)
            probability *= float(sampling_probs(row, sampling)[token])
        expected[(a * V + b) * V + c] = probability
    return counts, expected


def pooled_pvalue(counts: np.ndarray, expected: np.ndarray) -> float:
    """Chi-square over the outcomes, the rare ones (fewer than 5 expected draws) pooled into one cell."""
    expected = expected / expected.sum() * counts.sum()
    rare = expected < 5
    return chi2_pvalue(np.append(counts[~rare], counts[rare].sum()), np.append(expected[~rare], expected[rare].sum()))


@pytest.mark.parametrize("branches", [1, 2], ids=["chain", "tree"])
def test_sampling_with_penalties_and_bias_follows_the_processed_target(branches):
    counts, expected = joint_counts(STRONG, branches, DRAWS // 3)
    assert pooled_pvalue(counts, expected) > PASS_P


def test_processing_rows_with_the_context_alone_fails_the_same_test(monkeypatch):
    monkeypatch.setattr(RowHistory, "row_paths", lambda self: [[] for _ in range(len(self.draft.tokens) + 1)])
    counts, expected = joint_counts(STRONG, 1, DRAWS // 3)
    assert pooled_pvalue(counts, expected) < FAIL_P


# --- the command line ------------------------------------------------------------------------------------------

PROCESSING_FLAGS = [
    "--presence-penalty",
    "0.8",
    "--frequency-penalty",
    "0.6",
    "--repetition-penalty",
    "1.3",
    "--logit-bias",
    "7=4",
    "--logit-bias",
    "11=-100",
    "--min-tokens",
    "6",
    "--stop-token-id",
    "9",
]


def cli_json(capsys, *argv: str) -> tuple[int, list[dict], str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, [json.loads(line) for line in out.splitlines() if line.strip()], err


def test_generate_and_batch_flags_give_plain_decodings_output(capsys, tiny_dirs):
    model = ["--model", str(tiny_dirs["target"]), "--max-new-tokens", "16", "--json", "--no-chat"]
    outputs = {}
    for drafter in ("none", "pld", "suffix"):
        argv = ["generate", "w1 w2 w3 w1 w2", *model, "--drafter", drafter, *PROCESSING_FLAGS]
        code, rows, err = cli_json(capsys, *argv)
        assert code == 0, err
        outputs[drafter] = rows[0]["token_ids"]
    assert outputs["pld"] == outputs["none"] == outputs["suffix"]
    logprobs = {}
    for drafter in ("none", "pld"):
        argv = ["generate", "w1 w2 w3 w1 w2", *model, "--drafter", drafter, *PROCESSING_FLAGS, "--logprobs", "2"]
        code, rows, err = cli_json(capsys, *argv)
        assert code == 0, err
        logprobs[drafter] = rows[0]["logprobs"]
        assert [entry["token"] for entry in logprobs[drafter]] == outputs["none"]
        assert all(len(entry["top"]) == 2 for entry in logprobs[drafter])
    assert [e["logprob"] for e in logprobs["pld"]] == pytest.approx([e["logprob"] for e in logprobs["none"]], abs=1e-4)
    code, rows, err = cli_json(capsys, "generate", "w1 w2 w3 w1 w2", *model, "--drafter", "none")
    assert rows[0]["token_ids"] != outputs["none"]  # the flags changed the output
    assert 11 not in outputs["none"] and (9 not in outputs["none"] or outputs["none"].index(9) >= 5)


def test_batch_lines_take_the_settings_and_bad_ones_are_named(capsys, tiny_dirs, tmp_path):
    path = tmp_path / "prompts.jsonl"
    lines = [
        {"prompt": "w1 w2 w3 w1 w2", "presence_penalty": 0.8, "logit_bias": {"7": 4}, "min_tokens": 3},
        {"prompt": "w1 w2", "logit_bias": {"7": 400}},
        {"prompt": "w1 w2", "stop_token_ids": [10**6]},
    ]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    model = ["--model", str(tiny_dirs["target"]), "--max-new-tokens", "8", "--json", "--no-chat", "--ignore-eos"]
    code, rows, err = cli_json(capsys, "batch", str(path), *model, "--drafter", "pld")
    assert code == 2
    code_one, one, _ = cli_json(
        capsys,
        "generate",
        "w1 w2 w3 w1 w2",
        *model,
        "--drafter",
        "none",
        "--presence-penalty",
        "0.8",
        "--logit-bias",
        "7=4",
        "--min-tokens",
        "3",
    )
    assert rows[0]["token_ids"] == one[0]["token_ids"]
    assert "line 2" in rows[1]["error"] and "logit-bias" in rows[1]["error"]
    assert "line 3" in rows[2]["error"] and "stop token ids" in rows[2]["error"]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--logit-bias", "seven=1"], "--logit-bias takes ID=BIAS"),
        (["--presence-penalty", "2.5"], "presence-penalty"),
        (["--repetition-penalty", "0"], "repetition-penalty"),
        (["--repetition-penalty", "1000"], "repetition-penalty"),
        (["--min-p", "1.5"], "min-p"),
        (["--min-tokens", "200"], "min-tokens"),
        (["--logprobs", "21"], "logprobs"),
    ],
)
def test_bad_processing_flags_are_one_clean_error(capsys, flags, message):
    code = main(["generate", "w1 w2", *flags])
    assert code == 2 and message in capsys.readouterr().err


# --- log-probabilities ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sampling", [PENALTIES, dataclasses.replace(BIAS, temperature=0.8, seed=2)], ids=["greedy", "seeded"]
)
def test_logprobs_are_the_same_with_and_without_drafting(tiny_target, tiny_draft, sampling):
    prompt = PROMPTS[1]
    config = dict(vars(sampling), max_new_tokens=24, ignore_eos=True, logprobs=3, logit_bias=dict(sampling.logit_bias))
    plain_result = SpeculativeGenerator.build(tiny_target, "none").generate(prompt, **config)
    assert len(plain_result.logprobs) == len(plain_result.token_ids) == 24
    history = RowHistory(prompt, len(prompt), Draft(tokens=[]))
    first = plain_result.logprobs[0]
    with torch.no_grad():
        logits = tiny_target.backend.model(torch.tensor([prompt])).logits[0, -1:].float()
    expected = torch.log_softmax(process_rows(logits, sampling, history)[0], dim=-1)
    assert first.token == plain_result.token_ids[0]
    assert first.logprob == pytest.approx(float(expected[first.token]), abs=1e-4)
    assert [token for token, _ in first.top] == torch.topk(expected, 3).indices.tolist()
    results = {}
    for name in ("pld", "suffix", "draft-model"):
        options = {"draft_model": tiny_draft} if name == "draft-model" else {}
        speculative = SpeculativeGenerator.build(tiny_target, name, **options).generate(
            prompt, num_draft_tokens=4, **config
        )
        results[name] = speculative
    oracle = wrong_branch_tree(tiny_target, plain_result.token_ids, len(prompt))
    results["tree"] = SpeculativeGenerator(tiny_target, oracle).generate(prompt, num_draft_tokens=4, **config)
    assert results["tree"].stats.mean_accepted_tokens > 3  # rows deep in the tree were read
    for name, speculative in results.items():
        assert speculative.token_ids == plain_result.token_ids, name
        for ours, theirs in zip(speculative.logprobs, plain_result.logprobs):
            assert ours.token == theirs.token and ours.logprob == pytest.approx(theirs.logprob, abs=1e-4), name
            assert [t for t, _ in ours.top] == [t for t, _ in theirs.top], name


class ProposesStop(Drafter):
    """Always drafts the given token."""

    def __init__(self, target, token: int) -> None:
        super().__init__(target)
        self.token = token

    def session(self, request):
        return StatelessSession(lambda context, max_tokens: Draft(tokens=[self.token]))


def test_a_lossy_verifier_keeping_a_drafted_stop_token_does_not_end_before_min_tokens(tiny_target):
    stop = 5
    keeps_anything = "fly:entropy=0:top_k=96:min_prob=0:window=0"
    config = GenerationConfig(max_new_tokens=12, num_draft_tokens=1, stop_token_ids=(stop,), verifier=keeps_anything)
    drafter = ProposesStop(tiny_target, stop)
    assert decode(tiny_target, drafter, PROMPTS[0], config) == [stop]  # the control: kept, and it ends the request
    held = decode(tiny_target, drafter, PROMPTS[0], dataclasses.replace(config, min_tokens=6))
    assert len(held) >= 6 and held[5:].count(stop) <= 1 and held[-1] == stop
