"""The CPU fast path must be a numerically faithful, in-place swap of ``nn.Linear``, in both of its layouts (our panel
kernel's where the CPU kernels are built for AVX-512 or AVX2, oneDNN's prepacked one elsewhere)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from specdecode.models import fastpath
from specdecode.models.cpu_kernels import panels_pay
from specdecode.models.fastpath import (
    FastPathReport,
    PackedLinear,
    apply_cpu_fast_path,
    fast_path_supported,
    remove_cpu_fast_path,
)
from specdecode.models.hf import HFCausalLM

pytestmark = pytest.mark.skipif(not fast_path_supported(), reason="torch build without oneDNN linear ops")


@pytest.fixture(autouse=True, params=["panels", "onednn"])
def layout(request, monkeypatch) -> str:
    """Every test in both layouts: oneDNN's is what a machine without the CPU kernels packs."""
    if request.param == "panels" and not panels_pay():
        pytest.skip("the fast path does not multiply with panels here (CPU kernels not built for AVX-512 or AVX2)")
    if request.param == "onednn":
        monkeypatch.setattr(fastpath, "panels_pay", lambda: False)
    return request.param


SIZES = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    initializer_range=0.3,  # peaky logits: greedy choices are far from numerical ties
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)


def llama(tied: bool) -> nn.Module:
    return LlamaForCausalLM(LlamaConfig(**SIZES, tie_word_embeddings=tied))


def qwen2() -> nn.Module:  # q/k/v projections carry biases
    return Qwen2ForCausalLM(Qwen2Config(**SIZES, tie_word_embeddings=False))


def gemma3() -> nn.Module:  # tied, scaled embedding, sliding-window layers
    return Gemma3ForCausalLM(Gemma3TextConfig(**SIZES, head_dim=16, sliding_window=8))


BUILDERS = {
    "llama": lambda: llama(tied=False),
    "llama-tied": lambda: llama(tied=True),
    "qwen2": qwen2,
    "gemma3": gemma3,
}


def build(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return BUILDERS[kind]().eval()


def fast_copy(model: nn.Module) -> tuple[nn.Module, FastPathReport]:
    fast = copy.deepcopy(model)
    return fast, apply_cpu_fast_path(fast)


def prompt(length: int = 20) -> torch.Tensor:
    return torch.randint(3, SIZES["vocab_size"], (1, length), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("kind", BUILDERS)
def test_logits_match_unmodified_model(kind):
    model = build(kind)
    fast, report = fast_copy(model)
    with torch.inference_mode():
        expected = model(prompt()).logits
        got = fast(prompt()).logits
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert not any(type(m) is nn.Linear for m in fast.modules())
    assert len(report.replaced) == sum(type(m) is nn.Linear for m in model.modules())
    assert not report.skipped


@pytest.mark.parametrize("kind", BUILDERS)
def test_greedy_generate_unchanged(kind):
    model = build(kind)
    fast, _ = fast_copy(model)
    args = dict(max_new_tokens=12, do_sample=False, pad_token_id=2)
    with torch.inference_mode():
        assert torch.equal(fast.generate(prompt(8), **args), model.generate(prompt(8), **args))


def test_cached_backend_forward_matches_full_forward():
    """Incremental forwards through ``HFCausalLM`` (cache, several rows, crop) see the same numbers."""
    model = build("qwen2")
    apply_cpu_fast_path(model)
    backend = HFCausalLM(model, "tiny")
    tokens = prompt(16)[0]
    full = backend.forward(tokens, backend.new_cache()).logits
    cache = backend.new_cache()
    backend.forward(tokens[:10], cache)
    backend.forward(tokens[10:13], cache)
    cache.crop(10)
    tail = backend.forward(tokens[10:], cache).logits
    torch.testing.assert_close(tail, full[10:], atol=1e-4, rtol=1e-4)


def test_deterministic_for_same_rows():
    model = build("llama")
    apply_cpu_fast_path(model)
    with torch.inference_mode():
        assert torch.equal(model(prompt()).logits, model(prompt()).logits)


@pytest.mark.parametrize("kind", ["llama-tied", "gemma3"])
def test_tied_embeddings_stay_tied_and_usable(kind):
    model = build(kind)
    fast, report = fast_copy(model)
    assert report.tied == ["lm_head"]
    head, embedding = fast.get_output_embeddings(), fast.get_input_embeddings()
    assert isinstance(head, PackedLinear)
    assert head.weight is embedding.weight
    assert "lm_head.weight" in fast.state_dict()
    torch.testing.assert_close(embedding(prompt()), model.get_input_embeddings()(prompt()))
    assert HFCausalLM(fast, "tiny").vocab_size == SIZES["vocab_size"]


def test_untied_head_exposes_shape_without_dense_copy(layout):
    model = build("llama")
    dense_params = sum(p.numel() for p in model.parameters())
    original = model.get_output_embeddings().weight.detach().clone()
    apply_cpu_fast_path(model)
    head = model.get_output_embeddings()
    assert tuple(head.weight.shape) == (SIZES["vocab_size"], SIZES["hidden_size"])
    assert head.weight.is_mkldnn if layout == "onednn" else head.weight.is_meta
    assert torch.equal(head.dense_weight(), original)
    assert torch.equal(HFCausalLM(model, "tiny").output_weight(), original)
    linear_params = sum(m.packed.numel() for m in model.modules() if isinstance(m, PackedLinear))
    assert sum(p.numel() for p in model.parameters()) == dense_params - linear_params
    assert HFCausalLM(model, "tiny").vocab_size == SIZES["vocab_size"]


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_remove_restores_original_weights_and_outputs(kind):
    model = build(kind)
    fast, report = fast_copy(model)
    assert remove_cpu_fast_path(fast) == len(report.replaced)
    assert not any(isinstance(m, PackedLinear) for m in fast.modules())
    original = model.state_dict()
    for key, value in fast.state_dict().items():
        assert torch.equal(value, original[key]), key
    if kind == "gemma3":  # tied: the restored head shares the embedding again
        assert fast.get_output_embeddings().weight is fast.get_input_embeddings().weight
    with torch.inference_mode():
        assert torch.equal(fast(prompt()).logits, model(prompt()).logits)


def test_non_fp32_layers_are_skipped():
    model = build("llama").to(torch.bfloat16)
    report = apply_cpu_fast_path(model)
    assert not report.replaced
    assert set(report.skipped.values()) == {"dtype torch.bfloat16"}
    assert "skipped" in report.summary()


def test_gradients_flow_through_packed_layers_to_their_inputs():
    """Training an adapter *under* a packed layer (kangaroo) needs correct input gradients."""
    torch.manual_seed(0)
    dense = torch.nn.Linear(16, 8)
    packed = torch.nn.Sequential(torch.nn.Linear(16, 8))
    packed[0].load_state_dict(dense.state_dict())
    apply_cpu_fast_path(packed)
    x1 = torch.randn(3, 16, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_(True)
    dense(x1).square().sum().backward()
    packed(x2).square().sum().backward()
    torch.testing.assert_close(x2.grad, x1.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["panels"], indirect=True)  # oneDNN's one-row kernel differs in the last bits
def test_panels_keep_no_dense_copy_and_a_row_gets_the_same_bits_alone_as_in_a_batch(layout):
    from specdecode.models.fastpath import dense_copies

    model = apply_fast_path_to(qwen2())  # biases too
    assert not dense_copies(model)
    with torch.inference_mode():
        for module in (m for m in model.modules() if isinstance(m, PackedLinear)):
            x = torch.randn(9, module.in_features)
            together = module(x)
            assert all(torch.equal(module(x[row : row + 1])[0], together[row]) for row in range(9))


@pytest.mark.parametrize("layout", ["onednn"], indirect=True)  # panels keep no dense copy
def test_tuning_times_both_kernels_once_keeps_the_choice_and_frees_unused_copies(monkeypatch, layout):
    """``tune_fast_path`` times forwards with and without the dense copies, keeps its choice on disk for the
    next load of the same structure (no timing then), and frees the copies where they lost."""
    from specdecode.models import cost
    from specdecode.models.fastpath import DENSE_ROWS, dense_copies

    monkeypatch.setattr(cost.OthersLoad, "busy", property(lambda self: False))  # kept even on a loaded test machine
    first = HFCausalLM(apply_fast_path_to(llama(tied=False)), "tiny")
    assert dense_copies(first.model)  # every layer of the tiny model is small enough to keep one
    rows = cost.tune_fast_path(first)
    assert 0 <= rows <= DENSE_ROWS
    assert {m.dense_rows for m in dense_copies(first.model)} <= {rows}
    assert not dense_copies(first.model) if rows == 0 else len(dense_copies(first.model)) > 0

    def no_timing(*args, **kwargs):
        raise AssertionError("timed again")

    monkeypatch.setattr(cost, "prefilled", no_timing)
    again = HFCausalLM(apply_fast_path_to(llama(tied=False)), "tiny")
    assert cost.tune_fast_path(again) == rows


@pytest.mark.parametrize("layout", ["onednn"], indirect=True)  # panels keep no dense copy
def test_without_dense_copies_the_forward_is_unchanged(layout):
    from specdecode.models.fastpath import dense_copies, use_dense_rows

    model = apply_fast_path_to(llama(tied=False)).eval()
    ids = torch.randint(3, 128, (1, 3))
    with torch.inference_mode():
        before = model(ids).logits
        use_dense_rows(model, 0)
        assert not dense_copies(model)
        after = model(ids).logits
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)


def apply_fast_path_to(model: nn.Module) -> nn.Module:
    apply_cpu_fast_path(model)
    return model
