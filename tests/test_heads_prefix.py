"""Hydra++'s prefix attention: the window a session slides is one pass over the context, training reads what
drafting reads, and heads with it train, store, load, keep greedy output exact (solo and batched) and sample
exactly (chi-square, with a broken control that fails)."""

from __future__ import annotations

import json

import pytest
import torch

import specdecode.drafters.medusa
from helpers import (
    DRAWS,
    FAIL_P,
    PROMPTS,
    BigramFeatures,
    V,
    assert_batched_greedy_is_solo,
    assert_head_drafter_samples_exactly,
    assert_one_line_error,
    head_drafter_pvalues,
    hf_greedy,
    run,
    sharpened_choice,
)
from specdecode.drafters import create_drafter
from specdecode.heads.medusa import DraftHeads, HeadsConfig, heads_for_target, load_heads, save_heads
from specdecode.heads.prefix import PrefixAttention, PrefixWindow
from specdecode.models.fastpath import PackedLinear
from specdecode.models.loading import LoadedModel, fast_path_default
from specdecode.models.quantize import quantize_supported
from specdecode.models.quantized_layers import Int8Linear
from specdecode.train.eagle import compute_features
from specdecode.train.medusa import HeadsTrainConfig, make_stream, read_states, train_heads

KINDS = ("medusa", "hydra")


def _layer(window: int, seed: int = 0) -> PrefixAttention:
    torch.manual_seed(seed)
    layer = PrefixAttention(32, 4, window)
    torch.nn.init.normal_(layer.out.weight, std=0.2)  # a trained layer's output, not the zero it starts from
    return layer


def _one_pass(layer: PrefixAttention, hidden: torch.Tensor, window_mask: bool = True) -> torch.Tensor:
    positions = torch.arange(hidden.shape[0])
    q, k, v = layer.project(hidden, positions)
    mask = layer.in_window(positions, positions) if window_mask else positions.unsqueeze(-1) >= positions
    return layer.attend(hidden, q, k, v, mask)


@pytest.mark.parametrize("window", [1, 3, 8, 64])
def test_the_window_slides_as_one_pass_over_the_context(window):
    layer, hidden = _layer(window), torch.randn(29, 32)
    session = PrefixWindow(layer)
    with torch.no_grad():
        pieces = [session.extend(hidden[a:b]) for a, b in ((0, 11), (11, 12), (12, 15), (15, 29))]
        torch.testing.assert_close(torch.cat(pieces), _one_pass(layer, hidden))
        assert session.keys.shape[1] == min(window - 1, 29)  # memory bounded by the window
        if window < 28:  # broken control: attending over the whole context is another function
            assert not torch.allclose(_one_pass(layer, hidden, window_mask=False), _one_pass(layer, hidden))


def test_an_untrained_layer_hands_the_state_over_unchanged():
    layer, hidden = PrefixAttention(32, 4, 8), torch.randn(5, 32)
    with torch.no_grad():
        assert torch.equal(PrefixWindow(layer).extend(hidden), hidden)


def test_training_reads_what_drafting_reads(tiny_target):
    """Rows of a run that starts inside a sequence and crosses into the next: each reads its own sequence's
    window only, as a session fed that sequence does."""
    backend = tiny_target.backend
    sequences = [list(range(3, 3 + n)) for n in (13, 9, 17)]
    features = compute_features(backend, sequences, (), progress=False)
    heads = heads_for_target(backend, "hydra", 2, torch.arange(16), prefix_window=5)
    torch.nn.init.normal_(heads.prefix.out.weight, std=0.2)
    stream = make_stream(features, 2)
    with torch.no_grad():
        expected = torch.cat([PrefixWindow(heads.prefix).extend(f.final.float()) for f in features])
        for start, stop in ((0, 39), (4, 20), (13, 14), (15, 39)):
            torch.testing.assert_close(read_states(heads, stream, start, stop), expected[start:stop])
        # Broken control: a window that ignored sequence boundaries would read the sequence before.
        mixed = PrefixWindow(heads.prefix).extend(torch.cat([f.final.float() for f in features]))
        assert not torch.allclose(mixed[13:20], expected[13:20])


@pytest.fixture(scope="module")
def prefix_heads(tiny_target):
    """Heads of each kind with a prefix window of 6, trained for a second or two on the prompts' continuations."""
    generator = torch.Generator().manual_seed(0)
    prompts = [*PROMPTS, *PROMPTS]
    prompts += [torch.randint(0, tiny_target.backend.vocab_size, (5,), generator=generator).tolist() for _ in range(6)]
    features = compute_features(
        tiny_target.backend, [p + hf_greedy(tiny_target, p, 30) for p in prompts], (), progress=False
    )
    config = {"epochs": 20, "run": 64, "lr": 1e-2, "draft_vocab": 64, "prefix_window": 6}
    return {
        kind: train_heads(tiny_target.backend, features, HeadsTrainConfig(kind=kind, **config)).heads for kind in KINDS
    }


@pytest.mark.parametrize("kind", KINDS)
def test_prefix_heads_train_store_and_keep_greedy_output(tiny_target, prefix_heads, kind, tmp_path):
    heads = prefix_heads[kind]
    assert heads.prefix.out.weight.abs().sum() > 0  # the layer learnt from its zero start
    save_heads(heads, tmp_path / "heads", verifier="tiny")
    assert json.loads((tmp_path / "heads" / "config.json").read_text())["specdecode"]["prefix_window"] == 6
    loaded = load_heads(tmp_path / "heads", kind)
    for name, value in heads.state_dict().items():
        assert torch.equal(value, loaded.state_dict()[name]), name
    for tree_nodes in (0, 10):
        drafter = create_drafter(kind, tiny_target, heads=str(tmp_path / "heads"), tree_nodes=tree_nodes, top_k=3)
        accepted = 0
        for prompt in PROMPTS:
            tokens, outcome = run(tiny_target, drafter, prompt, max_new_tokens=24, num_draft_tokens=4)
            assert tokens == hf_greedy(tiny_target, prompt, 24)
            accepted += outcome.stats.accepted_tokens
        assert accepted > 0


@pytest.mark.parametrize("kind", KINDS)
def test_prefix_heads_batched_greedy_equals_solo(tiny_target, prefix_heads, kind):
    drafter = create_drafter(kind, tiny_target, heads=prefix_heads[kind])
    assert_batched_greedy_is_solo(tiny_target, drafter, PROMPTS, batch_size=3)


def test_a_negative_prefix_window_is_refused_before_any_data(tiny_dirs, capsys):
    argv = ["train", "hydra", "--model", str(tiny_dirs["target"]), "--prefix-window", "-1"]
    assert_one_line_error(capsys, argv, "--prefix-window must be >= 0")


# -- exact sampling with prefix heads, on a toy model whose distribution is known ------------------------------


def bigram_prefix_hydra() -> tuple[BigramFeatures, torch.Tensor, object]:
    table = 2.0 * torch.randn(V, V, generator=torch.Generator().manual_seed(3))
    model = BigramFeatures(table)
    torch.manual_seed(1)
    config = HeadsConfig("hydra", model.hidden_size, 3, V, V - 1, model.num_layers, prefix_window=4, prefix_heads=2)
    heads = DraftHeads(config)
    heads.token_map.copy_(torch.randperm(V)[: V - 1].sort().values)  # one token is never drafted
    torch.nn.init.normal_(heads.prefix.out.weight, std=0.5)  # the layer changes what the heads read
    return model, table, create_drafter("hydra", LoadedModel(name="bigram", backend=model, tokenizer=None), heads=heads)


def test_sampling_with_prefix_heads_reproduces_the_target_distribution():
    model, table, drafter = bigram_prefix_hydra()
    assert_head_drafter_samples_exactly(model, table, drafter)


def test_prefix_heads_reporting_other_distributions_than_they_sampled_from_fail_the_same_test(monkeypatch):
    """The control: tokens drawn from each head's distribution, reported sharpened."""

    monkeypatch.setattr(specdecode.drafters.medusa, "choose_from_subset", sharpened_choice)
    model, table, drafter = bigram_prefix_hydra()
    assert min(head_drafter_pvalues(model, table, drafter, DRAWS // 4)) < FAIL_P


@pytest.mark.skipif(
    not fast_path_default() or not quantize_supported("int8"), reason="no packed or int8 CPU linears here"
)
def test_a_prefix_layer_drafts_in_int8_with_the_lm_head_unless_told_not_to(tiny_target, prefix_heads):
    heads = prefix_heads["hydra"]
    rounded = create_drafter("hydra", tiny_target, heads=heads).heads.prefix
    assert isinstance(rounded.qkv, Int8Linear) and isinstance(rounded.out, Int8Linear)
    assert type(heads.prefix.qkv) is torch.nn.Linear  # the heads passed in keep their own
    exact = create_drafter("hydra", tiny_target, heads=heads, int8_head=False).heads.prefix
    assert isinstance(exact.qkv, PackedLinear) and isinstance(exact.out, PackedLinear)
