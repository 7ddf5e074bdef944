"""The written-out one-token step of draft models (:mod:`specdecode.models.draft_step`): the logits and the
cache the modules would give, fused weights that share the layers' storage, and the modules wherever the
step does not apply."""

from __future__ import annotations

import pytest
import torch

from helpers import tiny_gemma3, tiny_qwen2
from specdecode.drafters._vocab import DraftHead
from specdecode.models.draft_step import DraftStep
from specdecode.models.fastpath import PackedLinear
from specdecode.models.loading import fast_path_default, load_model
from specdecode.models.quantize import quantize_model, quantize_supported
from tiny_models import wrap

pytestmark = pytest.mark.skipif(
    not quantize_supported("int4"), reason="torch build without the CPU weight-only kernels"
)

PROMPT = torch.tensor([3, 9, 14, 2, 7, 30, 11, 5, 8, 21, 4, 17])


def quantized(model, mode: str):
    quantize_model(model, mode)
    return wrap(model.eval(), tokenizer=None).backend


def forward_logits(backend, token: int, cache) -> torch.Tensor:
    tokens = torch.tensor([token])
    return backend.forward(tokens, cache, logits_rows=slice(-1, None), invariant=False).logits[0]


def assert_steps_match_the_modules(backend, steps: int = 6) -> None:
    """Draft steps on one cache and module forwards on another: the same logits (to float noise) every step,
    and the caches they leave behind serve the modules alike."""
    drafted, reference = backend.new_cache(), backend.new_cache()
    for cache in (drafted, reference):
        backend.forward(PROMPT, cache, invariant=False)
    token = 6
    for _ in range(steps):
        expected = forward_logits(backend, token, reference)
        got = backend.draft_logits(torch.tensor([token]), drafted)[0]
        assert torch.allclose(got, expected, atol=1e-3, rtol=1e-3)
        assert drafted.length == reference.length
        token = int(expected.argmax())
    after = [backend.forward(torch.tensor([1, 2]), cache, invariant=False).logits for cache in (drafted, reference)]
    assert torch.allclose(after[0], after[1], atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize(
    "mode",
    ["int4", "int8", pytest.param("w4a8", marks=pytest.mark.skipif(not quantize_supported("w4a8"), reason="no w4a8"))],
)
def test_a_quantized_llama_drafts_through_the_written_out_step(tiny_dirs, mode):
    backend = load_model(str(tiny_dirs["target"]), quantize=mode).backend
    assert_steps_match_the_modules(backend)
    assert isinstance(backend._draft_step, DraftStep)


def test_qwen2_biases_go_through_the_fused_projection():
    torch.manual_seed(0)
    model = tiny_qwen2()
    for name, parameter in model.named_parameters():  # transformers starts biases at zero: make them count
        if name.endswith("bias"):
            torch.nn.init.normal_(parameter, std=0.5)
    backend = quantized(model, "int4")
    assert_steps_match_the_modules(backend)
    assert backend._draft_step.layers[0].qkv.bias is not None
    assert backend.model.model.layers[0].self_attn.q_proj.bias is not None  # fusing left the layers' own


def test_fused_weights_are_the_layers_own_storage_and_change_no_module_output(tiny_dirs):
    backend = load_model(str(tiny_dirs["target"]), quantize="int4").backend
    before = backend.forward(PROMPT, backend.new_cache()).logits
    step = backend._draft_step
    layer, fused = backend.model.model.layers[0], step.layers[0]
    assert fused.gate_up.fused  # 2 x 128 output channels: whole blocks of the int4 layout on every CPU
    storage = fused.gate_up.layer.qweight.untyped_storage().data_ptr()
    for projection in (layer.mlp.gate_proj, layer.mlp.up_proj):
        assert projection.qweight.untyped_storage().data_ptr() == storage
    # 64 + 32 + 32 output channels: whole blocks of the layout on an AVX2 CPU, not on an AVX-512 one, where
    # each projection keeps its call and its own weight (no second copy is held).
    attention = layer.self_attn
    if fused.qkv.fused:
        storage = fused.qkv.layer.qweight.untyped_storage().data_ptr()
        assert all(p.qweight.untyped_storage().data_ptr() == storage for p in (attention.q_proj, attention.k_proj))
    else:
        assert fused.qkv.layer is None
    assert torch.equal(backend.forward(PROMPT, backend.new_cache()).logits, before)


@pytest.mark.parametrize(
    "build",
    [
        pytest.param(lambda dirs: load_model(str(dirs["target"])).backend, id="fp32 llama"),
        pytest.param(lambda dirs: quantized(tiny_gemma3(), "int4"), id="int4 gemma3"),
    ],
)
def test_other_models_draft_through_their_modules(tiny_dirs, build):
    backend = build(tiny_dirs)
    assert backend._draft_step is None
    drafted, reference = backend.new_cache(), backend.new_cache()
    for cache in (drafted, reference):
        backend.forward(PROMPT, cache, invariant=False)
    assert torch.equal(backend.draft_logits(torch.tensor([6]), drafted)[0], forward_logits(backend, 6, reference))


def test_an_empty_pool_is_fed_through_the_modules(tiny_dirs):
    """The step writes into storage the modules create; before any forward there is none."""
    backend = load_model(str(tiny_dirs["target"]), quantize="int4").backend
    cache = backend.new_cache()
    expected = forward_logits(backend, 6, backend.new_cache())
    assert torch.equal(backend.draft_logits(torch.tensor([6]), cache)[0], expected)
    assert cache.length == 1


@pytest.mark.parametrize("quantize", ["int4", "none"], ids=["written-out step", "modules"])
def test_a_vocabtrim_head_replaces_the_lm_head_on_either_route(tiny_dirs, quantize):
    """Draft logits through a head of some rows are the full logits of those rows, whichever route the
    step takes (a head that left the written-out step for the modules would cost more than it saves)."""
    backend = load_model(str(tiny_dirs["target"]), quantize=quantize).backend
    rows = torch.tensor([0, 5, 9, 17, 40])
    head = DraftHead(backend, base=rows).for_prompt([])
    drafted, reference = backend.new_cache(), backend.new_cache()
    for cache in (drafted, reference):
        backend.forward(PROMPT, cache, invariant=False)
    got = backend.draft_logits(torch.tensor([6]), drafted, head)[0]
    # The rows' own block may compute in another precision than the quantized head (bf16 activations there).
    assert torch.allclose(got, forward_logits(backend, 6, reference)[rows], atol=5e-2, rtol=1e-2)
    assert drafted.length == reference.length


@pytest.mark.skipif(not fast_path_default(), reason="this torch build has no packed CPU linears")
@pytest.mark.parametrize("setting", ["1", "0"])
def test_vocabtrim_rows_are_packed_as_the_target_is(tiny_dirs, monkeypatch, setting):
    """``SPECDECODE_FAST_PATH=0`` asks for torch's own kernels everywhere: the draft rows follow it as the
    target's layers do, and pack otherwise."""
    monkeypatch.setenv("SPECDECODE_FAST_PATH", setting)
    backend = load_model(str(tiny_dirs["target"])).backend
    (block,) = DraftHead(backend, base=torch.tensor([0, 5, 9])).for_prompt([]).blocks
    assert isinstance(block, PackedLinear) == (setting == "1")
    assert isinstance(backend.model.model.layers[0].mlp.up_proj, PackedLinear) == (setting == "1")
