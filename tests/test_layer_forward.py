"""The decoder layer's written-out forward (:mod:`specdecode.models.layer_forward`): its kernels compute what
transformers' modules compute to float noise, each row bitwise the same alone as among others; a model's logits with it
are transformers' to float noise (and, the control, not bitwise theirs); through the ragged batched forward a row gets
the same bits alone and beside another sequence; it steps aside for gradients and for a replaced projection; quantized
layers (bf16, int8, int4) take it too, their rows the same alone as in a batch; w4a8 layers, bf16 models and unpacked
models keep transformers' forward.
Greedy equality of every drafter with it is in the real-model tests (``tests/test_real_smollm2.py``: ``smollm2-135m``
takes it, and its bf16 trees)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from specdecode.models.base import SequenceInput
from specdecode.models.cpu_kernels import panels_pay
from specdecode.models.fastpath import apply_cpu_fast_path
from specdecode.models.hf import HFCausalLM
from specdecode.models.layer_forward import LayerForward, install_layer_forward, remove_layer_forward
from specdecode.models.quantize import quantize_model, quantize_supported

pytestmark = pytest.mark.skipif(not panels_pay(), reason="the CPU kernels (panel products) are not built here")

SIZES = dict(
    vocab_size=160,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=256,
    initializer_range=0.3,  # peaky logits: greedy choices are far from numerical ties
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)


def model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "llama":
        built = LlamaForCausalLM(LlamaConfig(**SIZES))
    else:  # q/k/v projections with biases, the sliding window handed to the attention
        built = Qwen2ForCausalLM(Qwen2Config(**SIZES, tie_word_embeddings=False))
    return built.eval()


def rows(count: int, width: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(count, width, generator=torch.Generator().manual_seed(seed)) * scale


def test_the_norm_is_transformers_rmsnorm_and_each_row_is_alone():
    norm = LlamaRMSNorm(128, eps=1e-5)
    norm.weight.data = torch.randn(128)
    x = rows(7, 128)
    out = torch.empty_like(x)
    torch.ops.specdecode_layer.rms_norm_rows(x, norm.weight, norm.variance_epsilon, out)
    assert torch.allclose(out, norm(x), atol=1e-5, rtol=1e-5)
    alone = torch.empty(1, 128)
    torch.ops.specdecode_layer.rms_norm_rows(x[3:4].contiguous(), norm.weight, 1e-5, alone)
    assert torch.equal(alone[0], out[3])


def test_the_rotation_is_transformers_rotary_embedding():
    rotary = LlamaRotaryEmbedding(LlamaConfig(**SIZES))
    positions = torch.tensor([[0, 5, 17, 200, 3]])
    cos, sin = rotary(torch.empty(1, dtype=torch.float32), positions)
    q = rows(5, 4 * 64, seed=1)
    heads = q.view(1, 5, 4, 64).transpose(1, 2)
    expected, _ = apply_rotary_pos_emb(heads, heads, cos, sin)
    got = q.clone()
    torch.ops.specdecode_layer.rotate_rows(got, cos[0].contiguous(), sin[0].contiguous(), 64, got)
    assert torch.allclose(got.view(1, 5, 4, 64).transpose(1, 2), expected, atol=1e-5, rtol=1e-5)


def test_bf16_rows_rotate_bitwise_as_their_fp32_copies_do():
    """A quantized layer's bf16 query and key products are rotated as read, into fp32: the bits of converting first."""
    rotary = LlamaRotaryEmbedding(LlamaConfig(**SIZES))
    cos, sin = (t[0].contiguous() for t in rotary(torch.empty(1, dtype=torch.float32), torch.tensor([[0, 9, 40]])))
    q = rows(3, 4 * 64, seed=6).to(torch.bfloat16)
    converted = q.float()
    torch.ops.specdecode_layer.rotate_rows(converted, cos, sin, 64, converted)
    direct = torch.empty(q.shape)
    torch.ops.specdecode_layer.rotate_rows(q, cos, sin, 64, direct)
    assert torch.equal(direct, converted)


def test_the_norm_writes_bf16_bitwise_as_converting_its_fp32_result():
    """Rows a quantized layer multiplies in bf16 come out of the norm in bf16, rounded as torch rounds the fp32 norm."""
    weight = torch.randn(128, generator=torch.Generator().manual_seed(7))
    x = rows(5, 128, seed=8, scale=3.0)
    fp32 = torch.empty_like(x)
    torch.ops.specdecode_layer.rms_norm_rows(x, weight, 1e-5, fp32)
    bf16 = torch.empty(x.shape, dtype=torch.bfloat16)
    torch.ops.specdecode_layer.rms_norm_rows(x, weight, 1e-5, bf16)
    assert torch.equal(bf16.view(torch.int16), fp32.to(torch.bfloat16).view(torch.int16))


def test_the_gated_activation_is_silu_times_up_at_any_magnitude():
    gate, up = rows(3, 256, seed=2, scale=30.0), rows(3, 256, seed=3)
    gate[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -0.0])
    out = torch.empty_like(gate)
    torch.ops.specdecode_layer.silu_mul(gate, up, out)
    assert torch.allclose(out, nn.functional.silu(gate) * up, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("inputs", [torch.float32, torch.bfloat16])
def test_the_gated_activation_reads_and_writes_bf16_as_conversions_around_fp32_would(inputs):
    """A quantized layer's bf16 products go into the activation and its bf16 result into the next product, bitwise
    what converting them to fp32, computing in fp32 and converting back (torch's rounding) gives."""
    gate, up = rows(4, 256, seed=4, scale=8.0), rows(4, 256, seed=5)
    gate, up = gate.to(inputs), up.to(inputs)
    fp32 = torch.empty(gate.shape)
    torch.ops.specdecode_layer.silu_mul(gate.float(), up.float(), fp32)
    bf16 = torch.empty(gate.shape, dtype=torch.bfloat16)
    torch.ops.specdecode_layer.silu_mul(gate, up, bf16)
    assert torch.equal(bf16.view(torch.int16), fp32.to(torch.bfloat16).view(torch.int16))
    widened = torch.empty(gate.shape)
    torch.ops.specdecode_layer.silu_mul(gate, up, widened)
    assert torch.equal(widened, fp32)


def test_bf16_results_round_to_nearest_even_as_torch_does():
    # silu(64) is 64 in fp32 (e^-64 vanishes beside 1), so silu(gate) * up is exactly up * 64: floats halfway between
    # two bf16 numbers (one rounds down to even, one up) and either side of halfway.
    gate = torch.full((1, 64), 64.0)
    halfway = torch.tensor([0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF] * 16, dtype=torch.int32)
    up = (halfway.view(torch.float32) / 64.0).reshape(1, 64)
    out = torch.empty(gate.shape, dtype=torch.bfloat16)
    torch.ops.specdecode_layer.silu_mul(gate, up, out)
    fp32 = torch.empty(gate.shape)
    torch.ops.specdecode_layer.silu_mul(gate, up, fp32)
    assert torch.equal(fp32, halfway.view(torch.float32).reshape(1, 64))
    assert torch.equal(out.view(torch.int16), fp32.to(torch.bfloat16).view(torch.int16))
    assert out[0, :4].view(torch.int16).tolist() == [0x3F80, 0x3F82, 0x3F81, 0x3F80]


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_a_fast_path_model_takes_it_and_computes_transformers_logits(kind):
    reference = model(kind)
    fast = model(kind)
    apply_cpu_fast_path(fast)
    assert install_layer_forward(fast) == SIZES["num_hidden_layers"]
    ids = torch.tensor([[1, 5, 9, 33, 70, 7, 150, 4]])
    with torch.inference_mode():
        expected = reference(ids).logits
        got = fast(ids).logits
        remove_layer_forward(fast)
        without = fast(ids).logits
    assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4)
    assert not torch.equal(got, without)  # the control: its kernels round differently from the modules'


@pytest.mark.parametrize(
    "mode",
    [
        "none",
        pytest.param("bf16", marks=pytest.mark.skipif(not quantize_supported("bf16"), reason="no oneDNN bf16 matmul")),
        "int8",
    ],
)
def test_the_ragged_forward_gives_a_row_the_same_bits_alone_and_in_a_batch(mode):
    """Rows decoded one at a time get the bits the same rows get verified together beside another sequence: fp32
    panels compute each row alone in any call; bf16 in oneDNN's layout (a CPU with AMX) and int8 only in calls of the
    sizes their probe or kernel allows, which the layer's forward keeps."""
    fast = model("llama")
    quantize_model(fast, mode)
    apply_cpu_fast_path(fast)
    install_layer_forward(fast)
    assert isinstance(fast.model.layers[0].forward, LayerForward)
    backend = HFCausalLM(fast, "tiny")
    pool = backend.new_pool()
    pool.reserve(3, 64)
    first, second = pool.allocate(), pool.allocate()
    prompt = torch.tensor([1, 5, 9, 33, 70, 7])
    for cache in (first, second):
        backend.forward(prompt, cache, invariant=False)
    alone = torch.cat([backend.forward(torch.tensor([token]), first).logits for token in (11, 12, 13)])
    first.crop(len(prompt))
    together = backend.forward_batch(
        [SequenceInput(torch.tensor([11, 12, 13]), first), SequenceInput(torch.tensor([90, 91, 92, 93, 94]), second)]
    )[0].logits
    assert torch.equal(alone, together)


def test_it_steps_aside_for_gradients_and_for_a_replaced_projection():
    fast = model("llama")
    apply_cpu_fast_path(fast)
    install_layer_forward(fast)
    ids = torch.tensor([[1, 5, 9, 33]])
    with torch.enable_grad():
        assert fast(ids).logits.requires_grad  # transformers' forward, through the dense weights
    for layer in fast.model.layers:
        assert isinstance(layer.forward, LayerForward) and layer.forward.intact()
        mlp = layer.mlp
        layer.mlp = copy.copy(mlp)  # another module holding the same projections
        assert not layer.forward.intact()
        layer.mlp = mlp
        assert layer.forward.intact()
        layer.self_attn.q_proj = layer.self_attn.q_proj.to_linear()  # as an adapter's wrapping would
        assert not layer.forward.intact()
    with torch.inference_mode():
        replaced = fast(ids).logits
        remove_layer_forward(fast)
        modules = fast(ids).logits
    assert torch.equal(replaced, modules)


def test_bf16_models_and_unpacked_models_keep_transformers_forward():
    bf16 = model("llama").to(torch.bfloat16)
    assert install_layer_forward(bf16) == 0
    plain = model("llama")  # fp32 but not packed
    assert install_layer_forward(plain) == 0


@pytest.mark.parametrize("mode", ["bf16", "int8", "int4"])
def test_quantized_layers_take_it_and_compute_their_modules_logits(mode):
    if not quantize_supported(mode):
        pytest.skip(f"no {mode} kernel in this torch build or on this CPU")
    reference, fast = model("llama"), model("llama")
    for each in (reference, fast):
        quantize_model(each, mode)
    apply_cpu_fast_path(fast)
    assert install_layer_forward(fast) == SIZES["num_hidden_layers"]
    ids = torch.tensor([[1, 5, 9, 33, 70, 7, 150, 4]])
    with torch.inference_mode():
        got, expected = fast(ids).logits, reference(ids).logits
    # Up to rounding: the rotation fuses one of its two products into the sum, a rounding fewer than transformers'
    # (an fp32 unit in the last place of a query or key), which can move a bf16 product downstream by a bf16 unit,
    # and the logits by about one at their own scale.
    bf16_unit = expected.abs().max() * 2**-7
    assert torch.allclose(got, expected, atol=bf16_unit.item(), rtol=0)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_w4a8_layers_keep_transformers_forward():
    """The w4a8 target step reproduces the modules' bits for one sequence; the batched forward must give the same."""
    if not quantize_supported("w4a8"):
        pytest.skip("no w4a8 kernel on this CPU")
    w4a8 = model("llama")
    quantize_model(w4a8, "w4a8")
    apply_cpu_fast_path(w4a8)
    assert install_layer_forward(w4a8) == 0
