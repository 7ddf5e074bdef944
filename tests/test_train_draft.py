"""``specdecode train draft`` (DistillSpec): the divergences over the teacher's buckets, a tiny draft distilled into a
tiny target drafting closer to it and still losslessly, and the command's errors."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import PROMPTS, assert_one_line_error, hf_greedy, run
from specdecode.cli import main
from specdecode.drafters import create_drafter
from specdecode.models.loading import load_model
from specdecode.train import draft as draft_module
from specdecode.train.draft import (
    FULL_FINE_TUNING_LR,
    LORA_LR,
    DistillConfig,
    Sequence,
    answers,
    bucketed,
    distill,
    divergence,
    held_out,
    save_draft,
    teacher,
    teachers,
)
from tiny_models import save_tiny


def sequence_of(target_logits: torch.Tensor, top: int) -> Sequence:
    values = torch.log_softmax(target_logits, -1).topk(top, dim=-1)
    return Sequence(torch.zeros(1), 1, values.indices.to(torch.int32), values.values)


def test_the_divergences_are_those_of_the_whole_distributions_when_the_teacher_covers_the_vocabulary():
    g = torch.Generator().manual_seed(0)
    p_logits, q_logits = torch.randn(5, 12, generator=g), torch.randn(5, 12, generator=g)
    sequence = sequence_of(p_logits, 12)
    log_p, log_q = torch.log_softmax(p_logits, -1), torch.log_softmax(q_logits, -1)
    p, q = log_p.exp(), log_q.exp()
    torch.testing.assert_close(divergence("fkl", sequence, q_logits), (p * (log_p - log_q)).sum(-1), atol=1e-4, rtol=0)
    torch.testing.assert_close(divergence("rkl", sequence, q_logits), (q * (log_q - log_p)).sum(-1), atol=1e-4, rtol=0)
    torch.testing.assert_close(divergence("tvd", sequence, q_logits), 0.5 * (p - q).abs().sum(-1), atol=1e-5, rtol=0)
    for name in ("fkl", "rkl", "tvd"):
        assert divergence(name, sequence, p_logits).abs().max() < 1e-4  # the draft is the target: nothing to learn


def test_full_fine_tuning_takes_its_own_learning_rate_unless_one_is_given():
    assert DistillConfig().lr == LORA_LR
    assert DistillConfig(lora_rank=0).lr == FULL_FINE_TUNING_LR < LORA_LR
    assert DistillConfig(lora_rank=0, lr=1e-3).lr == 1e-3


def test_the_rest_of_the_vocabulary_is_one_bucket():
    top = torch.log(torch.tensor([[0.5, 0.25]]))
    torch.testing.assert_close(bucketed(top).exp(), torch.tensor([[0.5, 0.25, 0.25]]))
    g = torch.Generator().manual_seed(1)
    p_logits, q_logits = torch.randn(3, 40, generator=g), torch.randn(3, 40, generator=g)
    coarse = divergence("tvd", sequence_of(p_logits, 8), q_logits)
    fine = divergence("tvd", sequence_of(p_logits, 40), q_logits)
    assert torch.all(coarse <= fine + 1e-6)  # merging tokens into a bucket can only hide differences


@pytest.mark.parametrize(
    ("data", "name", "rank", "bf16"),
    [("target", "fkl", 4, False), ("draft", "tvd", 0, False), ("target", "fkl", 4, True)],
)
def test_a_distilled_tiny_draft_agrees_more_with_its_target_and_drafts_losslessly(
    tiny_dirs, tiny_target, data, name, rank, bf16, tmp_path
):
    torch.manual_seed(0)  # LoRA's initial adapters come from torch's global generator: the same whatever ran before
    draft = load_model(str(tiny_dirs["draft"]), fast_path=False)
    prompts = [prompt + [index + 1] for index in range(4) for prompt in PROMPTS]  # 12 distinct prompts
    config = DistillConfig(data=data, divergence=name, lora_rank=rank, epochs=12, lr=1e-2, new_tokens=24, bf16=bf16)
    model, result = distill(tiny_target, draft, prompts, config, progress=False)
    assert result.held_out_sequences >= 1 and result.train_sequences >= 8
    assert result.after.one_minus_tvd > result.before.one_minus_tvd
    assert result.epoch_losses[-1] < result.epoch_losses[0]
    save_draft(model, draft, tmp_path / "distilled", {"divergence": name})
    assert json.loads((tmp_path / "distilled" / "distill.json").read_text()) == {"divergence": name}
    drafter = create_drafter("draft-model", tiny_target, draft_model=load_model(str(tmp_path / "distilled")))
    for prompt in PROMPTS:
        tokens, _ = run(tiny_target, drafter, prompt, max_new_tokens=20, num_draft_tokens=3)
        assert tokens == hf_greedy(tiny_target, prompt, 20)


@pytest.mark.parametrize(("data", "writer"), [("target", "self_distill"), ("draft", "draft_samples")])
def test_decoded_sequences_are_kept_and_a_rerun_decodes_only_those_missing(
    tiny_dirs, tiny_target, data, writer, tmp_path, monkeypatch
):
    draft = load_model(str(tiny_dirs["draft"]), fast_path=False)
    prompts = [prompt + [index + 1] for index in range(2) for prompt in PROMPTS]  # 6 distinct prompts
    config = DistillConfig(data=data, new_tokens=8)
    fresh = answers(tiny_target, draft, prompts, config, progress=False)  # the control: no cache
    cache = tmp_path / "answers.jsonl"
    assert answers(tiny_target, draft, prompts, config, progress=False, cache=cache) == fresh
    lines = cache.read_text().splitlines(keepends=True)
    assert len(lines) == len(prompts)

    decode, skips = getattr(draft_module, writer), []

    def recorded(*args, skip, **kwargs):
        skips.append(skip)
        return decode(*args, skip=skip, **kwargs)

    monkeypatch.setattr(draft_module, writer, recorded)
    cache.write_text("".join(lines[:2]) + lines[2][:5])  # two sequences, then a write cut short
    assert answers(tiny_target, draft, prompts, config, progress=False, cache=cache) == fresh
    assert cache.read_text() == "".join(lines)
    assert answers(tiny_target, draft, prompts, config, progress=False, cache=cache) == fresh
    assert skips == [2, len(prompts)]  # the rerun decoded from the third prompt, the next one nothing


def test_the_targets_scores_are_kept_and_a_rerun_on_the_same_answers_scores_nothing(tiny_target, tmp_path, monkeypatch):
    pairs = [(prompt + hf_greedy(tiny_target, prompt, 6), len(prompt)) for prompt in PROMPTS]
    fresh = teachers(tiny_target, pairs, progress=False)  # the control: no cache
    cache = tmp_path / "answers.scores.pt"
    calls = []

    def counted(*args):
        calls.append(args)
        return teacher(*args)

    monkeypatch.setattr(draft_module, "teacher", counted)
    for _ in range(2):
        kept = teachers(tiny_target, pairs, cache, progress=False)
        assert [s.ids.tolist() for s in kept] == [s.ids.tolist() for s in fresh]
        assert all(
            torch.equal(a.top_ids, b.top_ids) and torch.equal(a.top_logprobs, b.top_logprobs)
            for a, b in zip(kept, fresh)
        )
    assert len(calls) == len(pairs)  # scored once: the rerun read them
    teachers(tiny_target, pairs[:2], cache, progress=False)  # other answers: scored again, not read
    assert len(calls) == len(pairs) + 2


def test_nested_exits_are_trained_to_agree_with_the_target_too(tiny_target, tmp_path):
    """S2D: the exit after 1 of a 3-layer draft's layers learns the target's answers far more than when only the last
    layer is trained (the control); the held-out figures name it."""
    prompts = [prompt + [index + 1] for index in range(4) for prompt in PROMPTS]
    figures = {}
    for exits in ((1,), ()):
        draft = load_model(str(save_tiny(tmp_path / f"deep{len(exits)}", seed=3, layers=3)), fast_path=False)
        config = DistillConfig(lora_rank=0, epochs=12, lr=1e-2, new_tokens=24, exits=exits)
        model, result = distill(tiny_target, draft, prompts, config, progress=False)
        assert set(result.before.exits) == set(result.after.exits) == set(exits)
        scored = [teacher(tiny_target, ids, start) for ids, start in answers(tiny_target, draft, prompts, config)]
        figures[exits] = held_out(model, scored, (1,)).exits[1].one_minus_tvd
    assert figures[(1,)] > figures[()] + 0.1


def test_the_command_trains_nested_exits_and_reports_each(tiny_dirs, capsys, tmp_path):
    draft = save_tiny(tmp_path / "deep", seed=3, layers=3)
    argv = ["train", "draft", "--model", str(tiny_dirs["target"]), "--draft", str(draft), "--exits", "1,2"]
    argv += ["--prompts", "4", "--new-tokens", "8", "--epochs", "1", "--lora-rank", "0", "--out", str(tmp_path / "d")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "exit after 1 layers: held-out top-1 agreement" in out and "exit after 2 layers" in out
    facts = json.loads((tmp_path / "d" / "distill.json").read_text())
    assert set(facts["held_out_after"]["exits"]) == {"1", "2"} and facts["config"]["exits"] == [1, 2]
    assert len(list((tmp_path / "d.work").glob("answers-*.jsonl"))) == 1  # kept for a rerun on the same data


def test_the_command_refuses_another_vocabulary_and_bad_flags_in_one_line(tiny_dirs, capsys, tmp_path):
    command = ["train", "draft", "--model", str(tiny_dirs["target"]), "--out", str(tmp_path / "d")]
    other = [*command, "--draft", str(tiny_dirs["other-vocab"]), "--prompts", "2"]
    assert_one_line_error(capsys, other, "needs a draft sharing the target's vocabulary")
    draft = [*command, "--draft", str(tiny_dirs["draft"])]
    assert_one_line_error(capsys, [*draft, "--lora-rank", "-1"], "--lora-rank")
    assert_one_line_error(capsys, [*draft, "--prompts", "0"], "--prompts")
    assert_one_line_error(capsys, [*draft, "--lr", "0"], "--lr must be positive")
    assert_one_line_error(capsys, [*draft, "--exits", "1"], "--exits must be below the draft's 1 layers")
    assert_one_line_error(capsys, [*draft, "--exits", "x"], "--exits takes comma-separated layer counts")
