"""The ctc drafter and its head: greedy equality for any head weights (prefix-beam trees, best paths, batches),
training that lowers its CTC loss and gets drafts accepted, resumable training, storage round trips and clear
errors, the collapse and the prefix beam search against brute force, and exact sampling (chi-square, with a
broken control that must fail)."""

from __future__ import annotations

import argparse
import itertools
import json
import shutil

import pytest
import torch

import specdecode.drafters.ctc
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
    random_ctc_head,
    random_heads,
    run,
    sharpened_choice,
)
from specdecode.drafters import create_drafter
from specdecode.drafters.ctc import prefix_beam_search
from specdecode.errors import SpecDecodeError
from specdecode.heads.ctc import load_ctc, save_ctc
from specdecode.heads.medusa import save_heads
from specdecode.models.loading import LoadedModel, load_model
from specdecode.train.cli import add_train_command
from specdecode.train.ctc import CTCTrainConfig, collapse, train_ctc
from specdecode.train.eagle import compute_features


@pytest.fixture(scope="module")
def features(tiny_target):
    """The tiny target's own greedy continuations, through the target once (final features only); the test prompts'
    continuations are in the data twice (holding one out leaves its twin), with others."""
    backend = tiny_target.backend
    generator = torch.Generator().manual_seed(0)
    prompts = [*PROMPTS, *PROMPTS]
    prompts += [torch.randint(0, backend.vocab_size, (5,), generator=generator).tolist() for _ in range(10)]
    sequences = [prompt + hf_greedy(tiny_target, prompt, 30) for prompt in prompts]
    return compute_features(backend, sequences, (), progress=False)


@pytest.fixture(scope="module")
def trained(tiny_target, features):
    """A head trained for a second or two, with its figures."""
    config = CTCTrainConfig(epochs=30, run=32, lr=3e-3, draft_vocab=64)
    return train_ctc(tiny_target.backend, features, config)


@pytest.mark.parametrize("tree_nodes", [0, 10, "auto"])
@pytest.mark.parametrize("draft_length", [3, "auto"])
def test_greedy_output_is_plain_greedy_for_any_head(tiny_target, trained, tree_nodes, draft_length):
    backend = tiny_target.backend
    for head in (random_ctc_head(backend, 40), random_ctc_head(backend, 40, slots=3), trained.head):
        drafter = create_drafter("ctc", tiny_target, head=head, tree_nodes=tree_nodes, top_k=3)
        for prompt in PROMPTS:
            tokens, _ = run(tiny_target, drafter, prompt, max_new_tokens=24, num_draft_tokens=draft_length)
            assert tokens == hf_greedy(tiny_target, prompt, 24), (head.config.slots, prompt)


def test_held_out_acceptance_on_the_targets_own_tokens_counts_the_labels_drafting_meets(tiny_target, trained):
    """A sequence the target wrote itself (greedy from its first token) is all own rows: both figures agree.  The
    control: random tokens, which the target would not have written, are almost never read as its own."""
    from specdecode.train.common import target_views
    from specdecode.train.ctc import held_out_acceptance, make_labels
    from specdecode.train.medusa import make_stream

    backend, head = tiny_target.backend, trained.head
    _, layerwise = target_views(backend, "ctc")

    def measured(ids: list[int]):
        (item,) = compute_features(backend, [ids], (), progress=False)
        stream = make_stream([item], 4)
        return held_out_acceptance(head, stream, make_labels(stream, layerwise, head, 4, 16), run=16)

    check_own_token_figures(tiny_target, measured)


def test_training_lowers_the_loss_and_gets_drafts_accepted(tiny_target, trained):
    assert trained.epoch_losses[-1] < 0.5 * trained.epoch_losses[0]
    assert len(trained.acceptance.every) == 4 and all(0.0 <= rate <= 1.0 for rate in trained.acceptance.every)
    assert trained.rows > 0 and trained.held_out_rows > 0

    def accepted(head, tree_nodes: int) -> int:
        drafter = create_drafter("ctc", tiny_target, head=head, tree_nodes=tree_nodes)
        return sum(
            run(tiny_target, drafter, p, max_new_tokens=24, num_draft_tokens=4)[1].stats.accepted_tokens
            for p in PROMPTS[:2]
        )

    untrained = random_ctc_head(tiny_target.backend, 64)
    for tree_nodes in (0, 10):
        assert accepted(trained.head, tree_nodes) > accepted(untrained, tree_nodes)


def test_an_interrupted_training_resumes_to_the_same_head(tiny_target, features, tmp_path, monkeypatch):
    """Checkpointed after every batch and stopped in its second epoch, a run started again with the same settings
    ends with the weights of a run never stopped."""
    import specdecode.train.ctc as ctc_training

    config = CTCTrainConfig(epochs=2, run=32, lr=3e-3, draft_vocab=64, checkpoint_seconds=0)
    whole = train_ctc(tiny_target.backend, features, config).head
    losses, calls = ctc_training.ctc_losses, []

    def stops_at_the_eighth_batch(*args):
        calls.append(1)
        if len(calls) == 8:
            raise KeyboardInterrupt
        return losses(*args)

    monkeypatch.setattr(ctc_training, "ctc_losses", stops_at_the_eighth_batch)
    with pytest.raises(KeyboardInterrupt):
        train_ctc(tiny_target.backend, features, config, checkpoint=tmp_path / "checkpoint.pt")
    monkeypatch.setattr(ctc_training, "ctc_losses", losses)
    resumed = train_ctc(tiny_target.backend, features, config, checkpoint=tmp_path / "checkpoint.pt").head
    for name, value in whole.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_collapse_merges_repeats_then_removes_blanks():
    assert collapse([9, 1, 1, 9, 2, 9, 2, 2, 9], blank=9) == [1, 2, 2]
    assert collapse([9, 9], blank=9) == []


def test_prefix_beam_search_sums_every_alignment_of_a_prefix():
    """With a beam wide enough to keep everything, each prefix's probability is the brute-force sum over every
    slot path collapsing to it."""
    probs = torch.softmax(torch.randn(4, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64), dim=-1)
    blank = 3
    exact: dict[tuple[int, ...], float] = {}
    for path in itertools.product(range(4), repeat=4):
        prefix = tuple(collapse(list(path), blank))
        weight = float(torch.prod(probs[torch.arange(4), torch.tensor(path)]))
        exact[prefix] = exact.get(prefix, 0.0) + weight
    beams = prefix_beam_search(probs, blank, width=len(exact))
    assert set(beams) == {prefix for prefix in exact if prefix}
    for prefix, probability in beams.items():
        assert probability == pytest.approx(exact[prefix], rel=1e-9)
    narrow = prefix_beam_search(probs, blank, width=3)
    assert len(narrow) <= 3 and set(narrow) <= set(exact)


def test_batched_greedy_equals_solo(tiny_target, trained):
    prompts = [*PROMPTS, [5, 17, 22], [30, 31] * 4, [44, 45, 46, 47, 44], [88, 3, 71]]
    drafter = create_drafter("ctc", tiny_target, head=trained.head)
    assert_batched_greedy_is_solo(tiny_target, drafter, prompts, batch_size=8)


def test_head_round_trips_through_storage(tiny_target, trained, tmp_path):
    save_ctc(trained.head, tmp_path / "head", verifier="tiny")
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    assert config["specdecode"]["slots"] == 8 and config["specdecode"]["draft_vocab_size"] == 64
    assert_saved_head_loads_and_drafts_the_same(tiny_target, "ctc", trained.head, tmp_path / "head", load_ctc)


def test_missing_or_mismatched_head_gives_clear_errors(tiny_target, tiny_draft, trained, tmp_path):
    with pytest.raises(SpecDecodeError, match="specdecode train ctc --model"):
        create_drafter("ctc", tiny_target, head=str(tmp_path / "nowhere"))
    save_heads(random_heads(tiny_target.backend, "medusa", 16), tmp_path / "medusa", verifier="tiny")
    with pytest.raises(SpecDecodeError, match="no CTC head"):
        create_drafter("ctc", tiny_target, head=str(tmp_path / "medusa"))
    with pytest.raises(SpecDecodeError, match="the head is for a target"):
        create_drafter("ctc", tiny_target, head=random_ctc_head(tiny_draft.backend, 16))
    with pytest.raises(SpecDecodeError, match="top-k"):
        create_drafter("ctc", tiny_target, head=trained.head, top_k=0)


def test_train_command_saves_a_head_where_the_drafter_looks(tiny_dirs, tmp_path, monkeypatch, capsys):
    model_dir = shutil.copytree(tiny_dirs["target"], tmp_path / "model")
    assert_one_line_error(capsys, ["generate", "w1", "--model", str(model_dir), "--drafter", "ctc"], "train ctc")
    prompts = [[5 + i, 17, 22, 9] for i in range(4)]
    monkeypatch.setattr("specdecode.train.features.prompt_ids", lambda target, tasks, n, seed: prompts[:n])
    parser = argparse.ArgumentParser()
    add_train_command(parser.add_subparsers(dest="command", required=True))
    flags = ["--prompts", "4", "--new-tokens", "12", "--conversations", "0", "--epochs", "2", "--slots", "6"]
    args = parser.parse_args(["train", "ctc", "--model", str(model_dir), *flags, "--tokens", "3"])
    assert args.run(args) == 0
    assert "top-1 acceptance per drafted token" in capsys.readouterr().out
    written = {p.name for p in (model_dir / "ctc-head").iterdir()}
    assert {"config.json", "model.safetensors", "manifest.json"} <= written
    target = load_model(str(model_dir))
    drafter = create_drafter("ctc", target)  # found without options
    assert drafter.head.config.slots == 6
    tokens, _ = run(target, drafter, PROMPTS[0], max_new_tokens=12, num_draft_tokens=4)
    assert tokens == hf_greedy(target, PROMPTS[0], 12)


def test_train_ctc_refuses_too_few_slots(capsys):
    assert_one_line_error(capsys, ["train", "ctc", "--slots", "0"], "--slots must be positive")
    assert_one_line_error(capsys, ["train", "ctc", "--slots", "5", "--tokens", "3"], "at least twice --tokens")


# -- exact sampling with a head, on a toy model whose distribution is known --------------------------


def bigram_ctc() -> tuple[BigramFeatures, torch.Tensor, object]:
    table = 2.0 * torch.randn(V, V, generator=torch.Generator().manual_seed(3))
    model = BigramFeatures(table)
    target = LoadedModel(name="bigram", backend=model, tokenizer=None)
    head = random_ctc_head(model, V - 1, seed=1, slots=6)  # one token is never drafted: output must not change
    return model, table, create_drafter("ctc", target, head=head)


def test_sampling_with_a_head_reproduces_the_target_distribution():
    model, table, drafter = bigram_ctc()
    assert_head_drafter_samples_exactly(model, table, drafter)


def test_a_drafter_reporting_other_distributions_than_it_sampled_from_fails_the_same_test(monkeypatch):
    """The control: tokens drawn from each slot's distribution, but the draft reports them sharpened (as a drafter
    would that forgot the temperature); rejection sampling then keeps too many likely tokens."""

    monkeypatch.setattr(specdecode.drafters.ctc, "choose_from_subset", sharpened_choice)
    model, table, drafter = bigram_ctc()
    assert min(head_drafter_pvalues(model, table, drafter, DRAWS // 4)) < FAIL_P


@pytest.mark.real_model
def test_untrained_head_keeps_smollm2_greedy_output_alone_and_in_a_batch_of_8(smollm2):
    """Greedy equality on a real model for a head whose weights mean nothing (random, drafting 4096 random ids):
    the tree and the best path alone, and eight requests batched."""
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
    head = random_ctc_head(smollm2.backend, 4096)
    for tree_nodes in (16, 0):
        generator = SpeculativeGenerator.build(smollm2, "ctc", head=head, tree_nodes=tree_nodes)
        result = generator.generate(prompts[0], chat=True, max_new_tokens=16, num_draft_tokens=4)
        assert result.token_ids == expected[0].token_ids, tree_nodes
    generator = SpeculativeGenerator.build(smollm2, "ctc", head=head)
    requests = [(p, generator.config_for(max_new_tokens=16)) for p in prompts]
    batch = generator.run_batch(requests, chat=True, batch_size=8)
    for index, (alone, together) in enumerate(zip(expected, batch)):
        assert together.token_ids == alone.token_ids, f"sequence {index} differs from plain"
