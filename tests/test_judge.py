"""The judge verifier (LOSSY): on hand-built logits and hidden states it keeps a plausible mismatch the exact
verifier rejects and rejects what it must; training finds a threshold with the precision asked for; the
train command saves where ``--verifier judge`` looks, and the verifier runs through the engine and the CLI."""

from __future__ import annotations

import argparse
import json
import shutil

import pytest
import torch

from helpers import assert_one_line_error
from specdecode.errors import SpecDecodeError
from specdecode.generator import SpeculativeGenerator
from specdecode.models.loading import load_model
from specdecode.sampling import argmax_last
from specdecode.sampling_params import SamplingParams
from specdecode.train.cli import add_train_command
from specdecode.train.judge import choose_threshold, fit_judge
from specdecode.types import Draft, Verdict
from specdecode.verify.base import TargetRows
from specdecode.verify.greedy import verify_greedy
from specdecode.verify.judge import Judge, JudgeOptions, verify_judge
from specdecode.verify.registry import is_lossless

V, H = 50, 4
PARAMS = JudgeOptions(top_k=5, min_prob=0.05)


def judge_reading_hidden_unit(sign: float) -> Judge:
    """Harmless iff ``sign`` * hidden[0] > 0 (features are not rescaled: mean 0, std 1)."""
    weight = torch.zeros(H + 2)
    weight[0] = 10.0 * sign
    return Judge(weight, 0.0, torch.zeros(H + 2), torch.ones(H + 2), threshold=0.5)


def unsure(top: int, second: int) -> torch.Tensor:
    row = torch.zeros(V)
    row[top], row[second] = 2.0, 1.8
    return row


def test_judge_keeps_a_mismatch_it_rates_harmless_and_only_then():
    logits = torch.stack([unsure(3, 4), unsure(7, 1), unsure(8, 1)])
    draft = Draft([4, 7])
    hidden = torch.ones(3, H)  # hidden[0] > 0 at every row
    rows = TargetRows(logits, SamplingParams())
    assert verify_greedy(argmax_last(logits), draft) == Verdict((), 3)  # exact rejects the 4
    assert verify_judge(rows, draft, PARAMS, judge_reading_hidden_unit(+1), hidden) == Verdict((0, 1), 8)
    assert verify_judge(rows, draft, PARAMS, judge_reading_hidden_unit(-1), hidden) == Verdict((), 3)
    lenient = judge_reading_hidden_unit(+1)
    assert verify_judge(rows, draft, JudgeOptions(judge_threshold=1.0), lenient, hidden) == Verdict((), 3)


def test_judge_never_keeps_an_implausible_token_however_it_rates_it():
    row = unsure(3, 4)
    row[4] = -8.0  # below the probability floor and out of the top-k
    logits = torch.stack([row, unsure(7, 1), unsure(8, 1)])
    rows = TargetRows(logits, SamplingParams())
    keep_all = judge_reading_hidden_unit(+1)
    assert verify_judge(rows, Draft([4, 7]), PARAMS, keep_all, torch.ones(3, H)) == Verdict((), 3)


def test_threshold_reaches_the_precision_asked_for():
    scores = torch.tensor([0.875, 0.75, 0.625, 0.5, 0.25])  # exact in float32
    truth = torch.tensor([True, True, False, True, False])
    threshold, report = choose_threshold(scores, truth, precision=0.75)
    assert threshold == 0.5 and report["held_out_precision"] == 0.75 and report["held_out_recall"] == 1.0
    threshold, report = choose_threshold(scores, truth, precision=1.0)
    assert threshold == 0.75 and report["held_out_recall"] == pytest.approx(2 / 3, abs=1e-3)
    assert choose_threshold(scores, ~truth | True, precision=1.0)[0] == 0.25
    threshold, report = choose_threshold(scores, truth, precision=1.01)  # unreachable: the best F1 instead
    assert threshold == 0.5 and not report["precision_reached"] and report["held_out_recall"] == 1.0


def test_fit_judge_learns_a_separable_rule_and_refuses_one_class():
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(400, H + 2, generator=generator)
    labels = features[:, 1] > 0.3
    judge = fit_judge(features, labels, precision=0.95)
    assert judge.report["held_out_precision"] >= 0.95 and judge.report["held_out_recall"] > 0.5
    with pytest.raises(SpecDecodeError, match="harmless and harmful"):
        fit_judge(features, torch.ones(400, dtype=torch.bool), precision=0.9)


def _random_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 96, (length,), generator=generator).tolist() for _ in range(n)]


@pytest.fixture(scope="module")
def judged_model(tiny_dirs, tmp_path_factory):
    """A copy of the tiny target with a judge trained by the CLI next to it (where the verifier looks)."""
    model_dir = shutil.copytree(tiny_dirs["target"], tmp_path_factory.mktemp("judged") / "model")
    parser = argparse.ArgumentParser()
    add_train_command(parser.add_subparsers(dest="command", required=True))
    argv = ["train", "judge", "--model", str(model_dir), "--prompts", "6", "--new-tokens", "24", "--positions", "12"]
    args = parser.parse_args([*argv, "--window", "1", "--top-k", "8", "--min-prob", "0.01", "--precision", "0.6"])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            "specdecode.train.judge_run.prompt_ids", lambda target, tasks, n, seed: _random_prompts(n, 8, seed)
        )
        assert args.run(args) == 0
    return model_dir


def test_train_command_saves_a_judge_the_verifier_finds(judged_model, capsys):
    config = json.loads((judged_model / "judge" / "config.json").read_text())
    assert config["kind"] == "specdecode-judge" and 0 < config["report"]["harmless_share"] < 1
    generator = SpeculativeGenerator.build(load_model(str(judged_model)), "pld")
    prompt = _random_prompts(1, 10, seed=5)[0]
    exact = generator.generate(prompt, max_new_tokens=20)
    judged = generator.generate(prompt, max_new_tokens=20, verifier="judge", verifier_options={"judge_threshold": 0.0})
    assert exact.stats.lossless and not judged.stats.lossless and not is_lossless("judge")
    assert len(judged.token_ids) == 20 and len(exact.token_ids) == 20


def test_judge_without_a_trained_judge_is_a_clear_error(tiny_dirs, capsys):
    generator = SpeculativeGenerator.build(load_model(str(tiny_dirs["target"])), "pld")
    with pytest.raises(SpecDecodeError, match="specdecode train judge"):
        generator.config_for(verifier="judge")
    assert_one_line_error(
        capsys, ["generate", "w1 w2", "--model", str(tiny_dirs["target"]), "--verifier", "judge"], "train judge"
    )
