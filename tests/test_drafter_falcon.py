"""The falcon drafter and its head: greedy equality for any head weights (block trees, chains, batches, blocks of
2 and 3), training that lowers its loss and matches drafting, storage round trips and clear errors, and exact
sampling (chi-square, with a broken control that must fail)."""

from __future__ import annotations

import argparse
import json
import shutil

import pytest
import torch

import specdecode.drafters.falcon
from helpers import (
    DRAWS,
    FAIL_P,
    PROMPTS,
    BigramFeatures,
    V,
    assert_batched_greedy_is_solo,
    assert_head_drafter_samples_exactly,
    assert_one_line_error,
    assert_saved_head_loads_and_drafts_the_same,
    check_own_token_figures,
    head_drafter_pvalues,
    hf_greedy,
    random_falcon_head,
    random_heads,
    run,
    sharpened_choice,
)
from specdecode.drafters import create_drafter
from specdecode.drafters.base import DraftRequest
from specdecode.errors import SpecDecodeError
from specdecode.heads.falcon import load_falcon, save_falcon
from specdecode.heads.medusa import save_heads
from specdecode.models.loading import LoadedModel, load_model
from specdecode.train.cli import add_train_command
from specdecode.train.common import trainable_embed
from specdecode.train.eagle import compute_features
from specdecode.train.falcon import FalconTrainConfig, make_windows, train_falcon, unrolled


@pytest.fixture(scope="module")
def features(tiny_target):
    """The tiny target's own greedy continuations, through the target once (final features only).  A random tiny
    model's text is close to noise that no head predicts on unseen prompts, so the test prompts' continuations are
    in the data (each twice: holding one out leaves its twin), with others."""
    backend = tiny_target.backend
    generator = torch.Generator().manual_seed(0)
    prompts = [*PROMPTS, *PROMPTS]
    prompts += [torch.randint(0, backend.vocab_size, (5,), generator=generator).tolist() for _ in range(10)]
    sequences = [prompt + hf_greedy(tiny_target, prompt, 30) for prompt in prompts]
    return compute_features(backend, sequences, (), progress=False)


@pytest.fixture(scope="module")
def trained(tiny_target, features):
    """A head trained for a second or two, with its figures."""
    config = FalconTrainConfig(epochs=20, window=32, batch_windows=4, lr=3e-3, draft_vocab=64)
    return train_falcon(tiny_target.backend, features, config)


@pytest.mark.parametrize("tree_nodes", [0, 10, "auto"])
@pytest.mark.parametrize("draft_length", [3, "auto"])
def test_greedy_output_is_plain_greedy_for_any_head(tiny_target, trained, tree_nodes, draft_length):
    backend = tiny_target.backend
    for head in (random_falcon_head(backend, 40), random_falcon_head(backend, 40, block=3), trained.head):
        drafter = create_drafter("falcon", tiny_target, head=head, tree_nodes=tree_nodes, top_k=3)
        for prompt in PROMPTS:
            tokens, _ = run(tiny_target, drafter, prompt, max_new_tokens=24, num_draft_tokens=draft_length)
            assert tokens == hf_greedy(tiny_target, prompt, 24), (head.config.block, prompt)


def test_training_lowers_the_loss_and_gets_drafts_accepted(tiny_target, trained):
    """The head's own drafts (the lookup off: it would help either head), trained against untrained."""
    assert trained.epoch_losses[-1] < 0.5 * trained.epoch_losses[0]
    assert len(trained.acceptance.every) == 4 and all(
        0.0 <= rate <= 1.0 for rate in trained.acceptance.every
    )  # 2 passes of 2
    assert len(trained.acceptance.own) == 4 and 0 < trained.acceptance.own_rows <= trained.held_out_rows
    assert trained.rows > 0 and trained.held_out_rows > 0

    def accepted(head, tree_nodes: int) -> int:
        drafter = create_drafter("falcon", tiny_target, head=head, tree_nodes=tree_nodes, lookup=False)
        return sum(
            run(tiny_target, drafter, p, max_new_tokens=24, num_draft_tokens=4)[1].stats.accepted_tokens
            for p in PROMPTS[:2]
        )

    untrained = random_falcon_head(tiny_target.backend, 64)
    for tree_nodes in (0, 10):
        assert accepted(trained.head, tree_nodes) > accepted(untrained, tree_nodes)


def test_held_out_acceptance_on_the_targets_own_tokens_counts_the_chains_drafting_meets(tiny_target, trained):
    """The own-token figure as every trainer's (:func:`check_own_token_figures`); a chain runs through blocks of
    passes here, so also: one token the target did not choose ends the own chains that reach it."""
    from specdecode.train.common import target_views
    from specdecode.train.falcon import held_out_acceptance

    backend, head = tiny_target.backend, trained.head
    _, layerwise = target_views(backend, "falcon")

    def measured(ids: list[int]):
        (features,) = compute_features(backend, [ids], (), progress=False)
        windows = make_windows([features], 16, head.config.block)
        return held_out_acceptance(head, layerwise, backend.embed, windows, passes=2, batch_windows=4)

    # PROMPTS[2]'s continuation, which the head trained on; 30 rows, the last without a target.
    own = check_own_token_figures(tiny_target, measured, own_rows=29, start=7)
    assert own.every[0] > 0
    ids = [7, *hf_greedy(tiny_target, [7], 30)]
    ids[16] = (ids[16] + 1) % 60  # one token the target did not choose: its chains and the rows after it are not own
    edited = measured(ids)
    assert edited.own_rows < 29 and edited.own != edited.every, (edited.own, edited.every)


def test_an_interrupted_training_resumes_to_the_same_head(tiny_target, features, tmp_path, monkeypatch):
    """Checkpointed after every batch and stopped in its second epoch, a run started again with the same settings
    ends with the weights of a run never stopped (the batches' order and glances are seeded by the step)."""
    import specdecode.train.falcon as falcon_training

    config = FalconTrainConfig(epochs=2, window=32, batch_windows=4, lr=3e-3, draft_vocab=64, checkpoint_seconds=0)
    whole = train_falcon(tiny_target.backend, features, config).head
    glance, calls = falcon_training.glance, []

    def stops_at_the_eighth_batch(*args):
        calls.append(1)
        if len(calls) == 8:
            raise KeyboardInterrupt
        return glance(*args)

    monkeypatch.setattr(falcon_training, "glance", stops_at_the_eighth_batch)
    with pytest.raises(KeyboardInterrupt):
        train_falcon(tiny_target.backend, features, config, checkpoint=tmp_path / "checkpoint.pt")
    monkeypatch.setattr(falcon_training, "glance", glance)
    resumed = train_falcon(tiny_target.backend, features, config, checkpoint=tmp_path / "checkpoint.pt").head
    for name, value in whole.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_training_unroll_matches_drafting(tiny_target, trained):
    """Each unrolled training pass sees exactly what drafting sees: the logits of pass p at the rows of a block
    equal those of the drafter's session at that block after p - 1 blocks of true tokens fed back — whether the
    context's features came in one piece or in steps (the last block's rows then fed again)."""
    backend, head = tiny_target.backend, trained.head
    ids = PROMPTS[0] + hf_greedy(tiny_target, PROMPTS[0], 20)
    (features,) = compute_features(backend, [ids], (), progress=False)
    windows = make_windows([features], window=32, block=2)
    with torch.no_grad():
        passes = unrolled(head, trainable_embed(backend), windows.batch(torch.arange(1)), passes=3)
    drafter = create_drafter("falcon", tiny_target, head=head)
    for start in (2, 6, 8):  # the block of rows start, start + 1 predicts tokens start + 3, start + 4
        context = ids[: start + 3]
        one_piece = drafter.session(DraftRequest(tuple(context)))
        one_piece.observe_prompt(features.final[: start + 2])
        in_steps = drafter.session(DraftRequest(tuple(context)))
        in_steps.observe_prompt(features.final[: start + 1])
        with torch.inference_mode():
            in_steps._catch_up(context[:-1])
            in_steps.observe_prompt(features.final[start + 1 : start + 2])  # the rest, as a step's feedback adds it
            for session in (one_piece, in_steps):
                outputs = session._catch_up(context)
                for p in range(3):
                    rows = slice(start + 2 * p, start + 2 * p + 2)
                    torch.testing.assert_close(
                        head.logits(outputs), head.logits(passes[p][0, rows]), rtol=1e-4, atol=1e-4
                    )
                    first = start + 3 + 2 * p
                    path = list(range(session.committed, session.cache.length))
                    outputs = session._feed(outputs[None], [ids[first : first + 2]], first, [path])[0]


def test_batched_greedy_equals_solo(tiny_target, trained):
    prompts = [*PROMPTS, [5, 17, 22], [30, 31] * 4, [44, 45, 46, 47, 44], [88, 3, 71]]
    drafter = create_drafter("falcon", tiny_target, head=trained.head)
    assert_batched_greedy_is_solo(tiny_target, drafter, prompts, batch_size=8)


def test_head_round_trips_through_storage(tiny_target, trained, tmp_path):
    save_falcon(trained.head, tmp_path / "head", verifier="tiny")
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    assert config["specdecode"]["block"] == 2 and config["specdecode"]["draft_vocab_size"] == 64
    assert_saved_head_loads_and_drafts_the_same(tiny_target, "falcon", trained.head, tmp_path / "head", load_falcon)


def test_missing_or_mismatched_head_gives_clear_errors(tiny_target, tiny_draft, trained, tmp_path):
    with pytest.raises(SpecDecodeError, match="specdecode train falcon --model"):
        create_drafter("falcon", tiny_target, head=str(tmp_path / "nowhere"))
    save_heads(random_heads(tiny_target.backend, "medusa", 16), tmp_path / "medusa", verifier="tiny")
    with pytest.raises(SpecDecodeError, match="no Falcon head"):
        create_drafter("falcon", tiny_target, head=str(tmp_path / "medusa"))
    with pytest.raises(SpecDecodeError, match="the head is for a target"):
        create_drafter("falcon", tiny_target, head=random_falcon_head(tiny_draft.backend, 16))
    with pytest.raises(SpecDecodeError, match="top-k"):
        create_drafter("falcon", tiny_target, head=trained.head, top_k=0)


def test_train_command_saves_a_head_where_the_drafter_looks(tiny_dirs, tmp_path, monkeypatch, capsys):
    model_dir = shutil.copytree(tiny_dirs["target"], tmp_path / "model")
    assert_one_line_error(capsys, ["generate", "w1", "--model", str(model_dir), "--drafter", "falcon"], "train falcon")
    prompts = [[5 + i, 17, 22, 9] for i in range(4)]
    monkeypatch.setattr("specdecode.train.features.prompt_ids", lambda target, tasks, n, seed: prompts[:n])
    parser = argparse.ArgumentParser()
    add_train_command(parser.add_subparsers(dest="command", required=True))
    flags = ["--prompts", "4", "--new-tokens", "12", "--conversations", "0", "--epochs", "2", "--block", "3"]
    args = parser.parse_args(["train", "falcon", "--model", str(model_dir), *flags])
    assert args.run(args) == 0
    assert "top-1 acceptance per drafted token" in capsys.readouterr().out
    written = {p.name for p in (model_dir / "falcon-head").iterdir()}
    assert {"config.json", "model.safetensors", "manifest.json"} <= written
    target = load_model(str(model_dir))
    drafter = create_drafter("falcon", target)  # found without options
    assert drafter.head.config.block == 3
    tokens, _ = run(target, drafter, PROMPTS[0], max_new_tokens=12, num_draft_tokens=4)
    assert tokens == hf_greedy(target, PROMPTS[0], 12)


def test_train_falcon_refuses_a_block_of_zero(capsys):
    assert_one_line_error(capsys, ["train", "falcon", "--block", "0"], "--block must be positive")


# -- exact sampling with a head, on a toy model whose distribution is known --------------------------


def bigram_falcon() -> tuple[BigramFeatures, torch.Tensor, object]:
    table = 2.0 * torch.randn(V, V, generator=torch.Generator().manual_seed(3))
    model = BigramFeatures(table)
    target = LoadedModel(name="bigram", backend=model, tokenizer=None)
    head = random_falcon_head(model, V - 1, seed=1)  # one token is never drafted: output must not change
    return model, table, create_drafter("falcon", target, head=head)


def test_sampling_with_a_head_reproduces_the_target_distribution():
    model, table, drafter = bigram_falcon()
    assert_head_drafter_samples_exactly(model, table, drafter)


def test_a_drafter_reporting_other_distributions_than_it_sampled_from_fails_the_same_test(monkeypatch):
    """The control: tokens drawn from each row's distribution, but the draft reports them sharpened (as a drafter
    would that forgot the temperature); rejection sampling then keeps too many likely tokens."""

    monkeypatch.setattr(specdecode.drafters.falcon, "choose_from_subset", sharpened_choice)
    model, table, drafter = bigram_falcon()
    assert min(head_drafter_pvalues(model, table, drafter, DRAWS // 4)) < FAIL_P


@pytest.mark.real_model
def test_untrained_head_keeps_smollm2_greedy_output_alone_and_in_a_batch_of_8(smollm2):
    """Greedy equality on a real model for a head whose weights mean nothing (random, drafting 4096 random ids):
    the tree and the chain alone, and eight requests batched."""
    from specdecode.generator import SpeculativeGenerator

    prompts = [
        "Write a short story about a lighthouse keeper who finds a message in a bottle.",
        "What is 2 + 2? Answer with one number.",
        "List three prime numbers.",
        "Explain recursion to a child in two sentences.",
        "def fibonacci(n):",
        "Translate 'good morning' into French.",
        "Name the capital of Japan.",
        "Summarize: the cat sat on the mat because it was warm.",
    ]
    plain = SpeculativeGenerator.build(smollm2, "none")
    expected = [plain.generate(p, chat=True, max_new_tokens=16) for p in prompts]
    head = random_falcon_head(smollm2.backend, 4096)
    for tree_nodes in (16, 0):
        generator = SpeculativeGenerator.build(smollm2, "falcon", head=head, tree_nodes=tree_nodes)
        result = generator.generate(prompts[0], chat=True, max_new_tokens=16, num_draft_tokens=4)
        assert result.token_ids == expected[0].token_ids, tree_nodes
    generator = SpeculativeGenerator.build(smollm2, "falcon", head=head)
    requests = [(p, generator.config_for(max_new_tokens=16)) for p in prompts]
    batch = generator.run_batch(requests, chat=True, batch_size=8)
    for index, (alone, together) in enumerate(zip(expected, batch)):
        assert together.token_ids == alone.token_ids, f"sequence {index} differs from plain"
