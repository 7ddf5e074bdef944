"""The medusa and hydra drafters: greedy equality for any head weights (trees, chains, auto length,
batches), training that gets drafts accepted, storage round trips and clear errors, and exact sampling."""

from __future__ import annotations

import argparse
import itertools
import json
import shutil

import pytest
import torch

from helpers import (
    PROMPTS,
    BigramFeatures,
    V,
    assert_batched_greedy_is_solo,
    assert_head_drafter_samples_exactly,
    assert_one_line_error,
    check_own_token_figures,
    hf_greedy,
    random_heads,
    run,
)
from specdecode.drafters import create_drafter
from specdecode.drafters.base import DraftRequest
from specdecode.errors import SpecDecodeError
from specdecode.heads.medusa import DraftHeads, HeadsConfig, load_heads, save_heads
from specdecode.models.fastpath import PackedLinear
from specdecode.models.loading import LoadedModel, fast_path_default, load_model
from specdecode.models.quantize import default_draft_quantization, quantize_supported
from specdecode.models.quantized_layers import Int8Linear
from specdecode.models.w4a8 import W4A8Linear, w4a8_fits
from specdecode.train.cli import add_train_command
from specdecode.train.eagle import compute_features
from specdecode.train.medusa import HeadsTrainConfig, train_heads

KINDS = ("medusa", "hydra")


@pytest.fixture(scope="module")
def features(tiny_target):
    """The tiny target's own greedy continuations, through the target once.  A random tiny model's text
    is close to noise that no head predicts on unseen prompts, so the test prompts' continuations are
    in the data (each twice: holding one out for the acceptance figures leaves its twin), with others."""
    backend = tiny_target.backend
    generator = torch.Generator().manual_seed(0)
    prompts = [*PROMPTS, *PROMPTS]
    prompts += [torch.randint(0, backend.vocab_size, (5,), generator=generator).tolist() for _ in range(10)]
    sequences = [prompt + hf_greedy(tiny_target, prompt, 30) for prompt in prompts]
    return compute_features(backend, sequences, (), progress=False)


@pytest.fixture(scope="module")
def trained(tiny_target, features) -> dict[str, DraftHeads]:
    """Heads of each kind trained for a second or two."""
    config = {"epochs": 20, "run": 64, "lr": 1e-2, "draft_vocab": 64}
    return {
        kind: train_heads(tiny_target.backend, features, HeadsTrainConfig(kind=kind, **config)).heads for kind in KINDS
    }


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tree_nodes", [0, 10, "auto"])
@pytest.mark.parametrize("draft_length", [3, "auto"])
def test_greedy_output_is_plain_greedy_for_any_heads(tiny_target, trained, kind, tree_nodes, draft_length):
    for heads in (random_heads(tiny_target.backend, kind, 40), trained[kind]):
        drafter = create_drafter(kind, tiny_target, heads=heads, tree_nodes=tree_nodes, top_k=3)
        for prompt in PROMPTS:
            tokens, _ = run(tiny_target, drafter, prompt, max_new_tokens=24, num_draft_tokens=draft_length)
            assert tokens == hf_greedy(tiny_target, prompt, 24)


@pytest.mark.parametrize("kind", KINDS)
def test_trained_heads_get_more_drafts_accepted(tiny_target, trained, kind):
    def accepted(heads: DraftHeads, tree_nodes: int) -> int:
        drafter = create_drafter(kind, tiny_target, heads=heads, tree_nodes=tree_nodes, lookup=False)
        return sum(
            run(tiny_target, drafter, p, max_new_tokens=24, num_draft_tokens=4)[1].stats.accepted_tokens
            for p in PROMPTS[:2]
        )

    untrained = random_heads(tiny_target.backend, kind, 64)
    for tree_nodes in (0, 10):
        assert accepted(trained[kind], tree_nodes) > accepted(untrained, tree_nodes)


def test_training_reports_acceptance_per_head(tiny_target, features):
    config = HeadsTrainConfig(kind="hydra", num_heads=3, epochs=2, run=64, draft_vocab=0)
    result = train_heads(tiny_target.backend, features, config)
    assert len(result.acceptance.every) == 3 and all(0.0 <= rate <= 1.0 for rate in result.acceptance.every)
    assert result.heads.config.draft_vocab_size == tiny_target.backend.vocab_size
    assert result.rows > 0 and result.held_out_rows > 0 and len(result.epoch_losses) == 2


@pytest.mark.parametrize("kind", KINDS)
def test_held_out_acceptance_on_the_targets_own_tokens_counts_the_rows_drafting_meets(tiny_target, trained, kind):
    """A sequence the target wrote itself (greedy from its first token) is all own rows: both figures agree.  The
    control: random tokens, which the target would not have written, are almost never read as its own."""
    from specdecode.train.common import target_views
    from specdecode.train.medusa import held_out_acceptance, make_stream

    backend, heads = tiny_target.backend, trained[kind]
    _, layerwise = target_views(backend, kind)

    def measured(ids: list[int]):
        (item,) = compute_features(backend, [ids], (), progress=False)
        stream = make_stream([item], heads.config.num_heads)
        return held_out_acceptance(heads, layerwise, backend.embed, stream, run=16)

    check_own_token_figures(tiny_target, measured)


def test_medusa_tree_is_the_best_paths_of_the_heads_top_k(tiny_target, trained):
    """Medusa's tree: exactly the ``tree_nodes`` best paths of the heads' top-k product, parents first."""
    drafter = create_drafter("medusa", tiny_target, heads=trained["medusa"], tree_nodes=9, top_k=3, lookup=False)
    context = PROMPTS[0] + hf_greedy(tiny_target, PROMPTS[0], 6)
    session = drafter.session(DraftRequest(tuple(PROMPTS[0])))
    backend = tiny_target.backend
    out = backend.forward(torch.tensor(context[:-1]), backend.new_cache(), hidden_layers=session.hidden_layers)
    session.observe_prompt(out.hidden)
    draft = session.propose(context, 3)
    logprobs, ids = torch.log_softmax(session.logits[:3], dim=-1).topk(3, dim=-1)
    tokens = drafter.target_ids[ids].tolist()
    scores = {}
    for ranks in itertools.product(range(3), repeat=3):
        for depth in (1, 2, 3):
            path = tuple(tokens[d][ranks[d]] for d in range(depth))
            scores[path] = sum(float(logprobs[d, ranks[d]]) for d in range(depth))
    expected = sorted(scores, key=scores.get, reverse=True)[:9]
    paths: list[tuple[int, ...]] = []
    for token, parent in zip(draft.tokens, draft.parent_list):
        paths.append((paths[parent] if parent >= 0 else ()) + (token,))
    assert sorted(paths) == sorted(expected)


@pytest.mark.parametrize("kind", KINDS)
def test_batched_greedy_equals_solo(tiny_target, trained, kind):
    drafter = create_drafter(kind, tiny_target, heads=trained[kind])
    assert_batched_greedy_is_solo(tiny_target, drafter, PROMPTS, batch_size=3)


@pytest.mark.parametrize("kind", KINDS)
def test_heads_round_trip_through_storage(tiny_target, trained, kind, tmp_path):
    save_heads(trained[kind], tmp_path / "heads", verifier="tiny")
    config = json.loads((tmp_path / "heads" / "config.json").read_text())
    assert config["model_type"] == kind and config["truncated_vocab_size"] == 64
    loaded = load_heads(tmp_path / "heads", kind)
    for name, value in trained[kind].state_dict().items():
        assert torch.equal(value, loaded.state_dict()[name]), name
    drafts = []
    for heads in (trained[kind], str(tmp_path / "heads")):
        drafter = create_drafter(kind, tiny_target, heads=heads)
        tokens, outcome = run(tiny_target, drafter, PROMPTS[0], max_new_tokens=12, num_draft_tokens=4)
        drafts.append((tokens, outcome.stats.drafted_tokens, outcome.stats.accepted_tokens))
    assert drafts[0] == drafts[1]
    (tmp_path / "heads" / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(SpecDecodeError, match="SHA-256"):
        load_heads(tmp_path / "heads", kind)


def test_missing_or_mismatched_heads_give_clear_errors(tiny_target, tiny_draft, trained, tmp_path):
    for kind in KINDS:
        with pytest.raises(SpecDecodeError, match=f"specdecode train {kind} --model"):
            create_drafter(kind, tiny_target, heads=str(tmp_path / "nowhere"))
    save_heads(trained["medusa"], tmp_path / "medusa", verifier="tiny")
    with pytest.raises(SpecDecodeError, match="not 'hydra' ones"):
        create_drafter("hydra", tiny_target, heads=str(tmp_path / "medusa"))
    other = random_heads(tiny_draft.backend, "medusa", 16)  # the tiny draft model has another depth
    with pytest.raises(SpecDecodeError, match="trained for another target"):
        create_drafter("medusa", tiny_target, heads=other)
    foreign = random_heads(tiny_target.backend, "hydra", 16)
    with torch.no_grad():
        foreign.lm_head.weight.mul_(2.0)  # same sizes, another model's LM head
    with pytest.raises(SpecDecodeError, match="their LM head is not"):
        create_drafter("hydra", tiny_target, heads=foreign)
    with pytest.raises(SpecDecodeError, match="top-k"):
        create_drafter("medusa", tiny_target, heads=trained["medusa"], top_k=0)


@pytest.mark.parametrize("kind", KINDS)
def test_train_command_saves_heads_where_the_drafter_looks(tiny_dirs, tmp_path, monkeypatch, capsys, kind):
    model_dir = shutil.copytree(tiny_dirs["target"], tmp_path / "model")
    assert_one_line_error(capsys, ["generate", "w1", "--model", str(model_dir), "--drafter", kind], f"train {kind}")
    prompts = [[5 + i, 17, 22, 9] for i in range(4)]
    monkeypatch.setattr("specdecode.train.features.prompt_ids", lambda target, tasks, n, seed: prompts[:n])
    parser = argparse.ArgumentParser()
    add_train_command(parser.add_subparsers(dest="command", required=True))
    flags = ["--prompts", "4", "--new-tokens", "12", "--conversations", "0", "--epochs", "2", "--num-heads", "3"]
    args = parser.parse_args(["train", kind, "--model", str(model_dir), *flags])
    assert args.run(args) == 0
    assert "top-1 acceptance per head" in capsys.readouterr().out
    assert {"config.json", "model.safetensors", "manifest.json"} <= {
        p.name for p in (model_dir / f"{kind}-heads").iterdir()
    }
    target = load_model(str(model_dir))
    drafter = create_drafter(kind, target)  # found without options
    assert drafter.heads.config.num_heads == 3
    tokens, _ = run(target, drafter, PROMPTS[0], max_new_tokens=12, num_draft_tokens=3)
    assert tokens == hf_greedy(target, PROMPTS[0], 12)


def test_runs_given_one_data_dir_share_the_answers_and_the_features_of_the_same_layers(
    tiny_dirs, tmp_path, monkeypatch
):
    from specdecode.train import features

    model_dir = shutil.copytree(tiny_dirs["target"], tmp_path / "model")
    prompts = [[5 + i, 17, 22, 9] for i in range(4)]
    monkeypatch.setattr("specdecode.train.features.prompt_ids", lambda target, tasks, n, seed: prompts[:n])
    parser = argparse.ArgumentParser()
    add_train_command(parser.add_subparsers(dest="command", required=True))
    data = tmp_path / "data"
    flags = ["--model", str(model_dir), "--prompts", "4", "--new-tokens", "12", "--conversations", "0"]
    flags += ["--epochs", "1", "--data-dir", str(data)]
    args = parser.parse_args(["train", "hydra", *flags, "--out", str(tmp_path / "hydra")])
    assert args.run(args) == 0
    answers = sorted(data.glob("distilled-*.jsonl"))
    assert len(answers) == 1 and not list((tmp_path / "hydra.work").glob("distilled-*"))
    written = features.self_distill

    def no_new_answers(target, prompts, new_tokens, max_tokens, skip=0):
        assert skip == len(prompts), "the answers were written again"
        return written(target, prompts, new_tokens, max_tokens, skip=skip)

    monkeypatch.setattr("specdecode.train.features.self_distill", no_new_answers)
    for kind in ("medusa", "eagle"):
        args = parser.parse_args(["train", kind, *flags, "--out", str(tmp_path / kind)])
        assert args.run(args) == 0
        assert (tmp_path / kind / "model.safetensors").is_file()
    assert sorted(data.glob("distilled-*.jsonl")) == answers
    # Hydra's and Medusa's features keep the final hidden state alone (one set); EAGLE's keep three layers more.
    assert len([path for path in data.glob("features-*") if path.is_dir()]) == 2


# -- exact sampling with heads, on a toy model whose distribution is known ---------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_sampling_with_heads_reproduces_the_target_distribution(kind):
    g = torch.Generator().manual_seed(3)
    table = 2.0 * torch.randn(V, V, generator=g)
    model = BigramFeatures(table)
    target = LoadedModel(name="bigram", backend=model, tokenizer=None)
    torch.manual_seed(1)
    heads = DraftHeads(HeadsConfig(kind, model.hidden_size, 3, V, V - 1, model.num_layers))
    heads.token_map.copy_(torch.randperm(V)[: V - 1].sort().values)  # one token is never drafted
    drafter = create_drafter(kind, target, heads=heads)
    assert_head_drafter_samples_exactly(model, table, drafter)


@pytest.mark.real_model
def test_untrained_heads_keep_smollm2_greedy_output(smollm2):
    """Greedy equality on a real model for heads whose weights mean nothing (random blocks, the target's
    LM head rows of 4096 random ids): medusa's tree, hydra's tree and chain."""
    from specdecode.generator import SpeculativeGenerator

    prompt = "Write a short story about a lighthouse keeper who finds a message in a bottle."
    plain = SpeculativeGenerator.build(smollm2, "none")
    prompt_ids = plain.encode_prompt(prompt, chat=True)
    expected = hf_greedy(smollm2, prompt_ids, 24)
    for kind, tree_nodes in (("medusa", 16), ("hydra", 16), ("hydra", 0)):
        heads = random_heads(smollm2.backend, kind, 4096)
        generator = SpeculativeGenerator.build(smollm2, kind, heads=heads, tree_nodes=tree_nodes)
        result = generator.generate(prompt_ids, max_new_tokens=24, ignore_eos=True, num_draft_tokens=4)
        assert result.token_ids == expected, (kind, tree_nodes)


@pytest.mark.skipif(not fast_path_default(), reason="this torch build has no packed CPU linears")
@pytest.mark.parametrize("kind", KINDS)
def test_drafting_packs_a_cpu_heads_linears_and_leaves_the_heads_passed_in_alone(tiny_target, trained, kind):
    heads = trained[kind]
    drafter = create_drafter(kind, tiny_target, heads=heads, int8_head=False)
    linears = [module for module in drafter.heads.modules() if isinstance(module, (torch.nn.Linear, PackedLinear))]
    assert all(isinstance(module, PackedLinear) for module in linears)
    assert len(linears) == heads.config.num_heads + 1  # the blocks, the LM head
    assert not any(isinstance(module, PackedLinear) for module in heads.modules())
    assert any(param.requires_grad for param in heads.parameters())  # still trainable: the drafter froze its copy
    hidden = torch.randn(3, heads.config.hidden_size)
    embeds = torch.randn(3, 3, heads.config.hidden_size) if kind == "hydra" else None
    with torch.inference_mode():
        expected = heads.logits(heads.head(2, hidden, embeds))
        got = drafter.heads.logits(drafter.heads.head(2, hidden, embeds))
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(
    not fast_path_default() or not quantize_supported("int8"),
    reason="no packed or int8 CPU linears here",
)
@pytest.mark.parametrize("kind", KINDS)
def test_a_cpu_heads_lm_head_and_blocks_draft_rounded_unless_told_not_to(tiny_target, trained, kind):
    heads = trained[kind]
    drafter = create_drafter(kind, tiny_target, heads=heads)
    w4a8 = default_draft_quantization() == "w4a8" and w4a8_fits(heads.lm_head)  # where our kernel beats int8
    assert type(drafter.heads.lm_head) is (W4A8Linear if w4a8 else Int8Linear)
    for block in drafter.heads.blocks:  # read once a step each, as the LM head is
        assert type(block.layers[0]) is (W4A8Linear if w4a8 else Int8Linear)
    assert type(heads.lm_head) is torch.nn.Linear and type(heads.blocks[0].layers[0]) is torch.nn.Linear
    exact = create_drafter(kind, tiny_target, heads=heads, int8_head="false").heads
    assert isinstance(exact.lm_head, PackedLinear) and isinstance(exact.blocks[0].layers[0], PackedLinear)
    hidden = torch.randn(8, heads.config.hidden_size)
    with torch.inference_mode():
        exact, rounded = heads.logits(hidden), drafter.heads.logits(hidden)
    assert not torch.equal(rounded, exact)  # rounded, so the draft is another one ...
    within = 0.2 if w4a8 else 0.05  # of the largest logit: int4 weights round coarser than int8
    torch.testing.assert_close(rounded, exact, rtol=0.05, atol=within * float(exact.abs().max()))  # ... close to it
    with pytest.raises(SpecDecodeError, match="int8_head must be true or false"):
        create_drafter(kind, tiny_target, heads=heads, int8_head="maybe")


@pytest.mark.parametrize("kind", KINDS)
def test_heads_of_several_layers_train_store_and_keep_greedy_output(tiny_target, features, kind, tmp_path):
    config = HeadsTrainConfig(kind=kind, num_layers=2, epochs=20, run=64, lr=1e-2, draft_vocab=64)
    heads = train_heads(tiny_target.backend, features, config).heads
    assert all(len(block.layers) == 2 for block in heads.blocks)
    assert any(block.layers[1].weight.abs().sum() > 0 for block in heads.blocks)  # the second layers learnt too
    save_heads(heads, tmp_path / "heads", verifier="tiny")
    assert json.loads((tmp_path / "heads" / "config.json").read_text())["num_hidden_layers"] == 2
    loaded = load_heads(tmp_path / "heads", kind)
    assert loaded.config.num_layers == 2
    drafter = create_drafter(kind, tiny_target, heads=str(tmp_path / "heads"), tree_nodes=10, top_k=3)
    for prompt in PROMPTS:
        tokens, outcome = run(tiny_target, drafter, prompt, max_new_tokens=24, num_draft_tokens=4)
        assert tokens == hf_greedy(tiny_target, prompt, 24)
        assert outcome.stats.accepted_tokens > 0
