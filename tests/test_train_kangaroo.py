"""Kangaroo adapter training: on a tiny model in seconds, the loss falls and acceptance rises over the
untrained shallow exit; the CLI saves where the drafter looks."""

from __future__ import annotations

import argparse

import torch

from helpers import hf_greedy, run, tiny_llama3, tiny_qwen2
from specdecode.drafters import create_drafter
from specdecode.drafters.kangaroo import ADAPTER_FILE, KangarooAdapter
from specdecode.train.cli import add_train_command
from specdecode.train.kangaroo import TrainConfig, train_adapter
from tiny_models import wrap


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 96, (length,), generator=generator).tolist() for _ in range(n)]


def _acceptance(target, adapter: KangarooAdapter, prompts: list[list[int]]) -> float:
    drafter = create_drafter("kangaroo", target, adapter=adapter, threshold=0.0)
    per_step = []
    for prompt in prompts:
        tokens, outcome = run(target, drafter, prompt, max_new_tokens=40, num_draft_tokens=3)
        assert tokens == hf_greedy(target, prompt, 40)  # lossless whatever the adapter
        per_step.append(outcome.stats.mean_accepted_tokens)
    return sum(per_step) / len(per_step)


def test_training_lowers_the_loss_and_raises_acceptance():
    torch.manual_seed(0)
    target = wrap(tiny_llama3(), tokenizer=None)
    config = TrainConfig(exit_layer=1, new_tokens=32, epochs=20, lr=3e-3)
    result = train_adapter(target, _prompts(24, 12, seed=0), config)
    assert result.epoch_losses[-1] < 0.8 * result.epoch_losses[0]
    assert result.after.kl < result.before.kl and result.after.top1 > result.before.top1
    held_out = _prompts(4, 8, seed=1)
    untrained = _acceptance(target, KangarooAdapter.for_backend(target.backend, 1), held_out)
    assert _acceptance(target, result.adapter, held_out) > untrained


def test_train_command_saves_where_the_drafter_looks(tiny_dirs, tmp_path, monkeypatch):
    import shutil

    from specdecode.models.loading import load_model

    model_dir = shutil.copytree(tiny_dirs["target"], tmp_path / "model")
    monkeypatch.setattr("specdecode.train.kangaroo_run.prompt_ids", lambda target, tasks, n, seed: _prompts(n, 8, seed))
    parser = argparse.ArgumentParser()
    add_train_command(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(
        ["train", "kangaroo", "--model", str(model_dir), "--prompts", "4", "--new-tokens", "8", "--epochs", "1"]
    )
    assert args.run(args) == 0
    assert (model_dir / ADAPTER_FILE).is_file()
    target = load_model(str(model_dir))
    drafter = create_drafter("kangaroo", target)  # found without options
    assert drafter.adapter.exit_layer == 1


def test_training_works_on_qwen2_with_an_untied_head():
    torch.manual_seed(0)
    target = wrap(tiny_qwen2().eval(), tokenizer=None)
    result = train_adapter(target, _prompts(6, 8, seed=2), TrainConfig(exit_layer=1, new_tokens=8, epochs=2))
    assert len(result.epoch_losses) == 2 and result.positions == 6 * 16


def test_train_command_refuses_bad_input_clearly(tiny_dirs, tmp_path, monkeypatch):
    import shutil

    import pytest

    from specdecode.errors import SpecDecodeError

    model_dir = shutil.copytree(tiny_dirs["target"], tmp_path / "model")
    monkeypatch.setattr("specdecode.train.kangaroo_run.prompt_ids", lambda target, tasks, n, seed: _prompts(n, 8, seed))
    parser = argparse.ArgumentParser()
    add_train_command(parser.add_subparsers(dest="command", required=True))
    cases = {
        "unknown model": ["--model", "no-such-model"],
        "must be positive": ["--model", str(model_dir), "--prompts", "0"],
        "--lr must be positive": ["--model", str(model_dir), "--lr", "0"],
        "exit layer must be in": ["--model", str(model_dir), "--exit-layer", "99"],
    }
    for message, argv in cases.items():
        args = parser.parse_args(["train", "kangaroo", *argv])
        with pytest.raises(SpecDecodeError, match=message):
            args.run(args)
    assert not (model_dir / ADAPTER_FILE).exists()
