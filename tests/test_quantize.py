"""Weight-only quantization (``--quantize int8|int4|bf16``): close to fp32, and lossless against plain decoding of
the same quantized model, for prompt lookup and a (quantized) draft model."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from helpers import (
    PROMPTS,
    RandomOracleTrees,
    assert_one_line_error,
    assert_tree_nodes_get_their_branch_fed_alone,
    hf_greedy,
    run,
)
from specdecode.bench.suites import resolve_settings
from specdecode.cli import main
from specdecode.drafters import create_drafter
from specdecode.drafters._vocab import DraftHead
from specdecode.engine import ancestor_mask
from specdecode.errors import SpecDecodeError
from specdecode.generator import SpeculativeGenerator
from specdecode.models import cpu_kernels, loading, quantize, quantized_layers, w4a8
from specdecode.models.base import SequenceInput
from specdecode.models.quantize import (
    default_draft_quantization,
    draft_quantization,
    quantize_model,
    quantize_supported,
)
from specdecode.models.quantized_layers import (
    BLOCK_MIN_ROWS,
    DENSE_BLOCK_MIN_ROWS,
    Bf16Linear,
    Int4Linear,
    Int8Linear,
    RowSplit,
    free_row_calls,
    probe_row_split,
)
from specdecode.models.w4a8 import W4A8Linear, reference_matmul, unavailable_reason
from specdecode.types import Draft
from tiny_models import tiny_llama

LAYERS = {"int8": Int8Linear, "int4": Int4Linear, "bf16": Bf16Linear, "w4a8": W4A8Linear}

pytestmark = pytest.mark.skipif(
    not all(quantize_supported(mode) for mode in ("int8", "int4")),
    reason="torch build without the CPU weight-only kernels",
)
#: bf16 needs oneDNN's bf16 matmul, which an AVX2-only CPU lacks (int8 and int4 run there, without block copies).
needs_bf16 = pytest.mark.skipif(
    not quantize_supported("bf16"), reason="this CPU has no oneDNN bf16 matmul (AVX-512 BW/VL/DQ or AVX-NE-CONVERT)"
)
#: w4a8 is our own AVX2 kernel, compiled on first use.
needs_w4a8 = pytest.mark.skipif(unavailable_reason() is not None, reason=f"w4a8: {unavailable_reason()}")
MODES = ["int8", "int4", pytest.param("bf16", marks=needs_bf16), pytest.param("w4a8", marks=needs_w4a8)]


@pytest.fixture(scope="module")
def quantized(tiny_dirs):
    """mode -> (target, draft), both quantized in that mode, loaded on first use."""

    class Loaded(dict):
        def __missing__(self, mode: str):
            self[mode] = tuple(loading.load_model(str(tiny_dirs[n]), quantize=mode) for n in ("target", "draft"))
            return self[mode]

    return Loaded()


@pytest.mark.parametrize(
    ("mode", "layer_error", "logit_error"),
    [
        ("int8", 0.02, 0.1),
        ("int4", 0.15, 0.8),
        pytest.param("bf16", 0.01, 0.05, marks=needs_bf16),
        pytest.param("w4a8", 0.15, 0.8, marks=needs_w4a8),
    ],
)
def test_quantized_layers_and_forward_are_close_to_fp32(tiny_target, quantized, mode, layer_error, logit_error):
    """Loose bounds: 4 bits per weight of a random network (initialiser range 0.3) is a coarse copy of it,
    and three such layers compound; each layer's own error is what quantization controls."""
    fp32 = tiny_llama(0, layers=3)  # the weights saved as tiny_dirs["target"]
    linears = {name: m for name, m in fp32.named_modules() if isinstance(m, nn.Linear)}
    model = quantized[mode][0].backend.model
    for name, linear in linears.items():
        layer = model.get_submodule(name)
        assert isinstance(layer, LAYERS[mode]), name
        x = torch.randn(5, linear.in_features)
        with torch.inference_mode():
            exact, approx = linear(x), layer(x)
        assert 0 < ((approx - exact).norm() / exact.norm()).item() < layer_error, name
        # The weight it reports is the one it multiplies by (inputs and outputs rounded aside) ...
        if mode == "w4a8":  # its inputs are rounded to int8 steps per 64, which reference_matmul restates
            expected = reference_matmul(layer, x) + (layer.bias if layer.bias is not None else 0)
        else:
            expected = nn.functional.linear(x.bfloat16().float(), layer.weight, layer.bias)
        torch.testing.assert_close(approx, expected, rtol=2e-2, atol=3e-2)
        # ... and a row's result does not depend on the rows beside it.
        assert all(torch.equal(layer(x[:m])[:1], approx[:1]) for m in range(1, 5))
    assert quantized[mode][0].backend.vocab_size == tiny_target.backend.vocab_size
    ids = torch.tensor([PROMPTS[0] + PROMPTS[1]])
    with torch.inference_mode():
        exact, approx = tiny_target.backend.model(ids).logits, model(ids).logits
    assert ((approx - exact).norm() / exact.norm()).item() < logit_error


def test_a_tied_head_keeps_the_fp32_embedding_and_its_weight():
    model = tiny_llama(3)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    embedding = model.get_input_embeddings().weight
    replaced = quantize_model(model, "int8")
    head = model.get_output_embeddings()
    assert "lm_head" in replaced and isinstance(head, Int8Linear)
    assert head.weight is not None and head.weight.data_ptr() == embedding.data_ptr()
    assert model.get_input_embeddings().weight is embedding


def test_int8_leaves_layers_its_kernel_cannot_take_in_fp32():
    """torch's int8 kernel reads inputs in blocks of 16: a layer of 24 inputs would compute garbage."""
    model = torch.nn.Sequential(torch.nn.Linear(24, 32, bias=False), torch.nn.Linear(32, 24, bias=False))
    assert quantize_model(model, "int8") == ["1"]
    assert type(model[0]) is torch.nn.Linear and isinstance(model[1], Int8Linear)
    x = torch.randn(3, 24)
    with torch.inference_mode():
        hidden = model[0](x)
        torch.testing.assert_close(model[1](hidden), hidden @ model[1].dequantized().T, rtol=0, atol=1e-2)


@pytest.mark.parametrize("mode", MODES)
def test_speculative_greedy_equals_plain_greedy_of_the_same_quantized_model(quantized, mode):
    target, draft = quantized[mode]
    drafters = {
        "pld": create_drafter("pld", target),
        "draft-model": create_drafter("draft-model", target, draft_model=draft),
    }
    for prompt in PROMPTS:
        plain, _ = run(target, create_drafter("none", target), prompt, max_new_tokens=40)
        if mode != "w4a8":  # our plain decoding is transformers' on the same model ...
            assert plain == hf_greedy(target, prompt, 40)
        # ... except under w4a8: its int8 steps per 64 inputs turn the last-bit differences between
        # transformers' attention and ours (row by row) into whole steps, so the two plain decodings part.
        for name, drafter in drafters.items():
            for k in (3, "auto"):
                tokens, _ = run(target, drafter, prompt, max_new_tokens=40, num_draft_tokens=k)
                assert tokens == plain, f"{name} (k={k}, {mode}) diverged from plain greedy decoding"


@pytest.mark.parametrize("mode", MODES)
def test_a_quantized_forward_gives_every_row_the_logits_it_gets_fed_alone(quantized, mode):
    """Bitwise, not close: a quantized layer rounds its input to bf16, so a last-bit difference in attention
    can move a logit by a whole bf16 step and break a near-tie unlike plain decoding.  Chain rows, tree nodes
    (each against plain decoding of its own branch), and rows beside another sequence in a batch."""
    backend = quantized[mode][0].backend
    assert backend.row_invariant_attention
    prompt = torch.tensor(PROMPTS[0])

    def prefilled(pool=None):
        cache = (pool or backend.new_pool()).allocate()
        backend.forward_batch([SequenceInput(prompt, cache, invariant=False)])
        return cache

    def fed_alone(branch: list[int]) -> list[torch.Tensor]:
        cache = prefilled()
        return [backend.forward_batch([SequenceInput(torch.tensor([t]), cache)])[0].logits[0] for t in branch]

    a, b = fed_alone([5, 6, 7]), fed_alone([5, 9, 3])
    chain = backend.forward_batch([SequenceInput(torch.tensor([5, 6, 7]), prefilled())])[0].logits
    assert all(torch.equal(chain[i], a[i]) for i in range(3))
    # Tree, as the engine lays one out (row 0: the last token, 5): 6 and 9 under it, 7 under 6, 3 under 9.
    mask = ancestor_mask(Draft([6, 9, 7, 3], parents=[-1, -1, 0, 1]))
    positions = len(PROMPTS[0]) + torch.tensor([0, 1, 1, 2, 2])
    tree = backend.forward_batch(
        [SequenceInput(torch.tensor([5, 6, 9, 7, 3]), prefilled(), positions=positions, tree_mask=mask)]
    )[0].logits
    for node, expected in [(0, a[0]), (1, a[1]), (3, a[2]), (2, b[1]), (4, b[2])]:
        assert torch.equal(tree[node], expected), f"tree node {node}"
    pool = backend.new_pool()
    first, second = prefilled(pool), prefilled(pool)
    beside = backend.forward_batch(
        [SequenceInput(torch.tensor([5, 6, 7]), first), SequenceInput(torch.tensor([1, 2]), second)]
    )[0].logits
    assert all(torch.equal(beside[i], a[i]) for i in range(3))


@pytest.mark.parametrize("mode", MODES)
def test_every_node_of_a_deep_tree_gets_the_logits_of_its_branch_fed_alone(quantized, mode):
    """Trees attend path by path (one call per root-to-leaf path): 14 nodes, five paths of up to six nodes,
    some crossing the key bucket at 64 positions, each node bitwise plain decoding of its own branch."""
    backend = quantized[mode][0].backend
    prompt = (torch.arange(3, 63) % backend.vocab_size).tolist()  # 60 tokens: a path of six ends in the next bucket
    parents = [-1, 0, 1, 2, 3, -1, 5, 6, 1, 8, 8, 10, 0, 12]
    draft = Draft([6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], parents=parents)
    assert_tree_nodes_get_their_branch_fed_alone(backend, [*prompt, 5], draft)


@pytest.mark.parametrize("mode", MODES)
def test_random_trees_across_a_key_bucket_decode_exactly_the_plain_output(quantized, mode):
    """End to end, where the node-by-node test above stops: random trees hiding the plain continuation, verified
    and compacted step after step across the 64-key bucket, after prompts of 52-63 tokens (so a lone deep path
    often reaches the next bucket, as long as the slot: its copy of the keys was once the slot itself, and the
    path was written into the cache; the old copy fails this test)."""
    target = quantized[mode][0]
    vocab = target.backend.vocab_size
    for length in range(52, 64):
        prompt = torch.randint(3, vocab, (length,), generator=torch.Generator().manual_seed(length)).tolist()
        plain, _ = run(target, create_drafter("none", target), prompt, max_new_tokens=24)
        drafter = RandomOracleTrees(target, plain, length, vocab, seed=length)
        tokens, outcome = run(target, drafter, prompt, max_new_tokens=24, num_draft_tokens=8)
        assert tokens == plain, f"after {length} prompt tokens"
        assert outcome.stats.mean_accepted_tokens > 2.0  # deep branches were found and kept


@pytest.mark.parametrize("packed", [pytest.param(True, marks=needs_bf16, id="onednn-bf16"), False], ids=str)
@pytest.mark.parametrize("layer_type", [Int8Linear, Int4Linear])
def test_a_block_copy_takes_free_calls_of_many_rows_only(layer_type, packed, monkeypatch):
    """int8 and int4 kernels cost about linearly in the rows, so a prompt (or a draft catching up) goes to a
    bf16 copy of the dequantized weight — oneDNN's bf16 layout, or a plain bf16 tensor multiplied in fp32
    slices where the CPU has no bf16 matmul; invariant calls (plain decoding, verification) never do."""
    monkeypatch.setattr(quantized_layers, "bf16_matmul_supported", lambda: packed)
    monkeypatch.setattr(quantized_layers, "DENSE_BLOCK_SLICE", 24)  # several slices, the last one partial
    linear = nn.Linear(128, 64)
    extra = {"group_size": 64} if layer_type is Int4Linear else {}
    layer, lean = layer_type(linear, tied=False, block_copy=True, **extra), layer_type(linear, tied=False, **extra)
    assert lean.block_weight is None and layer.block_weight.is_mkldnn == packed
    dense = layer.block_weight.to_dense() if packed else layer.block_weight
    torch.testing.assert_close(dense.float(), layer.dequantized(), rtol=0.01, atol=1e-3)
    least = quantized_layers._block_min_rows(layer.block_weight)
    assert least == (BLOCK_MIN_ROWS if packed else DENSE_BLOCK_MIN_ROWS)
    x = torch.randn(least + 4, 128)
    with torch.inference_mode():
        kernel = lean(x)
        assert torch.equal(layer(x), kernel)  # not free: the quantized kernel
        with free_row_calls():
            assert torch.equal(layer(x[: least - 1]), kernel[: least - 1])  # too few rows
            copied = layer(x)
    if packed:
        expected = quantized_layers._packed_bf16_call(layer.block_weight, x.bfloat16()).float() + linear.bias
    else:
        expected = x.bfloat16().float() @ dense.float().T + linear.bias
    torch.testing.assert_close(copied, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(copied, kernel, rtol=0.05, atol=0.05)


@needs_w4a8
def test_w4a8_prompts_go_through_the_kernel_with_no_block_copy():
    """The kernel multiplies many rows faster than oneDNN's bf16 matmul of the same weights, so the layer holds no
    second copy of its weights and rows no output depends on bitwise take the kernel too."""
    layer = W4A8Linear(nn.Linear(128, 64), tied=False)
    assert layer.block_weight is None
    x = torch.randn(DENSE_BLOCK_MIN_ROWS + 4, 128)
    with torch.inference_mode(), free_row_calls():
        assert torch.equal(layer(x), layer.matmul(x) + layer.bias)


@needs_w4a8
@pytest.mark.parametrize("out_features", [16, 40, 96])
def test_w4a8_blocks_round_trip_and_pad_the_last_block_of_16_channels(out_features):
    """Output channels sit 16 to a block; a layer of another width pads its last block with zero channels that the
    kernel computes and never writes."""
    torch.manual_seed(0)
    linear = nn.Linear(128, out_features)
    levels, scale, zero = quantized_layers.int4_levels(linear.weight.detach(), w4a8.GROUP)
    blocks = w4a8.pack_blocks(levels, scale, zero)
    assert blocks.shape == (-(-out_features // 16), 2 * w4a8.BLOCK_BYTES)
    q, scale_back, offset = w4a8.unpack_blocks(blocks, out_features)
    assert torch.equal(q, levels.long())
    assert torch.equal(scale_back, scale.to(torch.bfloat16).float())
    assert torch.equal(offset, zero.to(torch.bfloat16).float() - 8 * scale_back)
    layer = W4A8Linear(linear, tied=False)
    x = torch.randn(5, 128)
    with torch.inference_mode():
        assert torch.allclose(layer.matmul(x), reference_matmul(layer, x), atol=1e-5)


@needs_w4a8
@pytest.mark.slow  # builds the kernel a second time (about 45 s on two cores)
@pytest.mark.skipif(w4a8.best_isa() == "avx2", reason="this CPU has no VNNI: only the AVX2 build runs here")
def test_the_w4a8_builds_for_avx2_and_for_vnni_give_the_same_bits():
    """Only the integer dots change instruction (exact either way), so a CPU with VNNI decodes the same tokens
    as one without."""
    torch.manual_seed(0)
    blocks = w4a8.pack_blocks(*quantized_layers.int4_levels(nn.Linear(192, 96).weight.detach(), w4a8.GROUP))
    for rows in (1, 2, 3, 4, 5, 9):
        x = torch.randn(rows, 192)
        narrow = w4a8.kernel("avx2").w4a8_mm(x, blocks, 96)
        assert torch.equal(narrow, w4a8.kernel(w4a8.best_isa()).w4a8_mm(x, blocks, 96))


def agree_but_for_a_near_tie(model: nn.Module, prompt: list[int], ours: list[int], theirs: list[int]) -> bool:
    """Whether two greedy decodings of ``model`` agree, or first differ where its two best next tokens are one
    bf16 step apart (a full forward's logits): transformers' attention and ours may round a last bit apart
    (e.g. 5.0 against 4.97 on a random int4 model) and then break that tie differently."""
    at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    if at is None:
        return ours == theirs
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + ours[:at]])).logits[0, -1].float()
    top = torch.topk(logits, 2)
    best, second = top.values.tolist()
    one_step = 2.0 ** (math.floor(math.log2(abs(best))) - 7)  # bf16 keeps 8 significant bits
    return {ours[at], theirs[at]} <= set(top.indices.tolist()) and best - second <= one_step


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_long_prompts_prefill_through_the_block_copies_and_decoding_stays_lossless(quantized, mode, monkeypatch):
    """A prompt of many tokens and a draft model catching up on it take the bf16 copies; plain decoding,
    every drafter and transformers' own generate (given the same prompt kernel) still agree token for token."""
    target, draft = quantized[mode]
    model = target.backend.model
    assert model.get_output_embeddings().block_weight is None  # the head gives prompts one row of logits
    assert model.get_submodule("model.layers.0.mlp.down_proj").block_weight is not None
    calls = []
    exact = quantized_layers._block_call
    counting = lambda block, rows: calls.append(len(rows)) or exact(block, rows)
    monkeypatch.setattr(quantized_layers, "_block_call", counting)
    prompt = [(7 * i) % 50 + 3 for i in range(40)]  # past DENSE_BLOCK_MIN_ROWS too
    plain, _ = run(target, create_drafter("none", target), prompt, max_new_tokens=24)
    least = quantized_layers._block_min_rows(model.get_submodule("model.layers.0.mlp.down_proj").block_weight)
    assert calls and min(calls) >= least  # the prompt's forward, and only it
    with free_row_calls():
        assert agree_but_for_a_near_tie(model, prompt, plain, hf_greedy(target, prompt, 24))
    for drafter in (create_drafter("pld", target), create_drafter("draft-model", target, draft_model=draft)):
        calls.clear()
        assert run(target, drafter, prompt, max_new_tokens=24, num_draft_tokens=4)[0] == plain
        assert calls and min(calls) >= least


def test_generate_quantizes_target_and_draft_model(capsys, monkeypatch, tiny_dirs):
    loads = []
    real_load = loading.load_model

    def recording(name, **kwargs):
        loads.append((name, kwargs.get("quantize")))
        return real_load(name, **kwargs)

    monkeypatch.setattr(loading, "load_model", recording)
    target, draft = str(tiny_dirs["target"]), str(tiny_dirs["draft"])
    common = ["--model", target, "--max-new-tokens", "16", "--ignore-eos", "--json", "--quantize", "int8"]
    outputs = []
    for extra in (["--drafter", "none"], ["--drafter", "draft-model", "--draft-model", draft]):
        assert main(["generate", "w1 w2 w3 w1 w2", *common, *extra]) == 0
        outputs.append(json.loads(capsys.readouterr().out)["token_ids"])
    assert outputs[0] == outputs[1] and len(outputs[0]) == 16
    default = default_draft_quantization()  # int4 unless told (w4a8 on AVX2 or VNNI CPUs)
    assert loads == [(target, "int8"), (target, "int8"), (draft, default)]
    argv = ["generate", "w1", *common, "--drafter", "draft-model", "--draft-model", draft, "--quantize-draft", "none"]
    assert main(argv) == 0
    assert loads[-1] == (draft, "none")


def test_lean_weights_loads_target_and_draft_without_block_copies(capsys, monkeypatch, tiny_dirs):
    loaded = []
    real_load = loading.load_model
    monkeypatch.setattr(loading, "load_model", lambda name, **kw: loaded.append(real_load(name, **kw)) or loaded[-1])
    target, draft = str(tiny_dirs["target"]), str(tiny_dirs["draft"])
    argv = ["generate", "w1 w2", "--model", target, "--drafter", "draft-model", "--draft-model", draft]
    assert main([*argv, "--max-new-tokens", "4", "--quantize", "int8", "--lean-weights"]) == 0
    layers = [m for model in loaded for m in model.backend.model.modules() if isinstance(m, (Int8Linear, Int4Linear))]
    assert len(loaded) == 2 and layers and all(layer.block_weight is None for layer in layers)


def test_a_draft_model_is_int4_by_default_except_where_it_trains_or_off_the_cpu():
    default = default_draft_quantization()
    assert draft_quantization(None, "none") == draft_quantization(None, "bf16") == default
    assert draft_quantization("bf16", "none") == "bf16" and draft_quantization("none", "int4") == "none"
    assert draft_quantization(None, "int8", trains=True) == "none"  # adapt trains fp32 LoRA layers
    assert draft_quantization(None, "none", device="cuda:0") == "none"
    assert resolve_settings(methods="none,pld").quantize_draft is None  # no draft model: nothing recorded
    assert resolve_settings(methods="draft-model:m2").quantize_draft == default
    assert resolve_settings(methods="draft-model:m2:adapt=true").quantize_draft == "none"


@pytest.mark.parametrize(
    ("capability", "isa", "builds", "expected"),
    [
        ("AVX2", "avx2", True, "w4a8"),
        ("AVX2", "avx2", False, "int4"),
        ("AVX512", "avx2", True, "int4"),
        ("AVX512", "avx512vnni", True, "w4a8"),
        ("AVX512", "avx512vnni", False, "int4"),
    ],
)
def test_drafts_are_w4a8_on_avx2_or_vnni_cpus_that_build_its_kernel(monkeypatch, capability, isa, builds, expected):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(w4a8, "best_isa", lambda: isa)
    monkeypatch.setattr(w4a8, "unavailable_reason", lambda: None)
    monkeypatch.setattr(w4a8, "kernel_builds", lambda: builds)  # a compiler that fails counts as none
    assert default_draft_quantization() == expected


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "hi", "--quantize", "int3"],
        ["batch", "-", "--quantize", "fp8"],
        ["demo", "--quantize", "INT8"],
        ["serve", "--quantize", "int2"],
        ["generate", "hi", "--drafter", "draft-model", "--draft-model", "x", "--quantize-draft", "q"],
        ["bench", "forward-cost", "--quantize", "int16"],
    ],
)
def test_bad_quantize_value_is_a_one_line_error_before_any_load(capsys, monkeypatch, argv):
    from specdecode.bench import forward_cost  # binds load_model when imported: replaced there as well

    for module in (loading, forward_cost):
        monkeypatch.setattr(module, "load_model", lambda *a, **k: pytest.fail("nothing may be loaded"))
    monkeypatch.setattr("sys.stdin", type("Stdin", (), {"read": lambda self: '{"prompt": "hi"}'})())
    flag = "--quantize-draft" if "--quantize-draft" in argv else "--quantize"
    assert_one_line_error(capsys, argv, f"{flag} must be one of none, int8, int4, bf16")


def test_forward_cost_reports_the_quantization(capsys, tiny_dirs):
    argv = ["bench", "forward-cost", "--model", str(tiny_dirs["target"]), "--quantize", "int4", "--json"]
    assert main([*argv, "--max-new", "8", "--context-tokens", "16", "--repeats", "1"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["quantize"] == "int4" and result["ratio_8_1"] > 0


def test_bf16_on_a_cpu_without_its_matmul_is_a_one_line_error(monkeypatch):
    monkeypatch.setattr(quantize, "quantize_supported", lambda mode: mode != "bf16")
    with pytest.raises(SpecDecodeError, match="this CPU has no oneDNN bf16 matmul"):
        quantize_model(nn.Sequential(nn.Linear(64, 32)), "bf16")


def test_quantize_model_leaves_other_layers_alone():
    model = nn.Sequential(nn.Linear(64, 32), nn.Linear(48, 32), nn.Linear(64, 24))
    assert quantize_model(model, "none") == []
    assert quantize_model(model, "int4") == ["0"]  # 48 inputs fit no group size, 24 outputs no int4 block
    assert quantize_model(model, "int8") == ["1", "2"]  # a quantized layer is not quantized again


@needs_bf16
def test_a_bf16_layer_gives_a_row_the_same_bits_in_every_call(monkeypatch):
    """Whichever product the layer takes here (the bf16 panel kernel, or oneDNN's with calls cut as the probe says), a
    row's result is the same in every call of 1 to 70 rows; oneDNN's product whose rows depend on their neighbours in
    every call shape is called row by row."""
    layer = Bf16Linear(nn.Linear(96, 80), tied=False)
    x = torch.randn(70, 96)
    with torch.inference_mode():
        alone = torch.cat([layer(x[i : i + 1]) for i in range(70)])
        assert all(torch.equal(layer(x[:m]), alone[:m]) for m in (2, 5, 31, 32, 33, 64, 70))
    exact = quantized_layers._packed_bf16_call
    beside = lambda packed, rows: exact(packed, rows) + rows.sum().item()
    monkeypatch.setattr(quantized_layers, "_packed_bf16_call", beside)
    assert probe_row_split(onednn_bf16(96, 80), 96, 80) == RowSplit(pad_single=False, chunk=1)


def onednn_bf16(inputs: int, outputs: int) -> torch.Tensor:
    """A random bf16 weight in oneDNN's blocked layout, what a bf16 layer multiplies by where the panel kernel does not
    run."""
    return torch.ops.mkldnn._reorder_linear_weight(torch.randn(outputs, inputs).to(torch.bfloat16), None)


@pytest.mark.skipif(not cpu_kernels.bf16_panels_pay(), reason="no AVX512_BF16 here, or AMX (oneDNN's product runs)")
def test_the_bf16_panel_kernel_multiplies_each_row_alone_as_bf16_products_in_fp32():
    torch.manual_seed(5)
    weight = torch.randn(48, 160) * 0.1
    panels = cpu_kernels.pack_bf16_panels(weight)
    assert torch.equal(cpu_kernels.unpack_bf16_panels(panels), weight.to(torch.bfloat16))
    layer = Bf16Linear(nn.Linear(160, 48), tied=False)
    assert layer.bf16_panels is not None and layer.packed is None and layer.kernel_build.startswith("bf16 panels")
    rows = torch.randn(37, 160).to(torch.bfloat16)
    product = cpu_kernels.bf16_panel_linear(rows, panels)
    reference = rows.double() @ weight.to(torch.bfloat16).double().T
    assert product.dtype == torch.float32 and torch.allclose(product.double(), reference, rtol=0, atol=1e-5)
    for count in (*range(1, 14), 16, 19, 25, 37):  # every tile height, and rows cut into two and three blocks
        assert torch.equal(cpu_kernels.bf16_panel_linear(rows[:count], panels), product[:count])
    assert torch.equal(cpu_kernels.bf16_panel_linear(rows[5:6], panels), product[5:6])


def pair_chain_reference(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """bf16 ``rows`` times bf16 ``weight``.T as the bf16 panel kernel sums: each output one fp32 chain over the input
    pairs in order, the product at input 2k + 1 added before the one at 2k (a product of two bf16 numbers is exact)."""
    x, w = rows.float(), weight.float()
    sums = torch.zeros(x.shape[0], w.shape[0])
    for k in range(0, x.shape[1], 2):
        sums = sums + x[:, k + 1, None] * w[None, :, k + 1]
        sums = sums + x[:, k, None] * w[None, :, k]
    return sums


@pytest.mark.skipif(not cpu_kernels.bf16_panels_pay(), reason="no AVX512_BF16 here, or AMX (oneDNN's product runs)")
def test_the_widened_bf16_product_sums_the_pairs_in_the_kernels_order():
    torch.manual_seed(6)
    weight = (torch.randn(48, 96) * 0.1).to(torch.bfloat16)
    panels = cpu_kernels.pack_bf16_panels(weight)
    rows = torch.randn(25, 96).to(torch.bfloat16)
    widened = cpu_kernels.bf16_panel_linear(rows, panels, widened=True)
    assert torch.equal(widened, pair_chain_reference(rows, weight))
    for count in (1, 3, 4, 5, 12, 13, 25):  # below the widened product's fewest rows (the dot product runs), and above
        assert torch.equal(cpu_kernels.bf16_panel_linear(rows[:count], panels, widened=True), widened[:count])
    broken = pair_chain_reference(rows.flip(1), weight.flip(1))  # even before odd: another order, other bits
    assert not torch.equal(widened, broken)
    if cpu_kernels.bf16_widened_pays():  # chosen only where vdpbf16ps gives the same bits
        assert torch.equal(cpu_kernels.bf16_panel_linear(rows, panels, widened=False), widened)


@needs_bf16
@pytest.mark.parametrize(
    ("differs", "split"),
    [
        (lambda rows: rows.shape[0] > 12, RowSplit(pad_single=False, chunk=12)),
        (lambda rows: rows.shape[0] == 1, RowSplit(pad_single=True, chunk=32)),
        # a few rows in the tail of the input distribution, and only in two-row calls: every size sees every row
        (lambda rows: rows.shape[0] == 2 and bool((rows[:, 0] > 2.5).any()), RowSplit(pad_single=False, chunk=1)),
    ],
)
def test_the_bf16_probe_finds_the_call_sizes_whose_rows_differ(monkeypatch, differs, split):
    exact = quantized_layers._packed_bf16_call
    perturbed = lambda packed, rows: exact(packed, rows) + (1.0 if differs(rows) else 0.0)
    monkeypatch.setattr(quantized_layers, "_packed_bf16_call", perturbed)
    assert probe_row_split(onednn_bf16(96, 64), 96, 64) == split


@pytest.mark.real_model
@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_smollm2_quantized_prompt_lookup_equals_plain(mode):
    target = loading.load_model("smollm2-135m", quantize=mode)
    plain = SpeculativeGenerator.build(target, "none")
    lookup = SpeculativeGenerator.build(target, "pld")
    prompt = "Repeat this list exactly, then add two more fruits: apple, banana, cherry, date, elderberry, fig."
    expected = plain.generate(prompt, chat=True, max_new_tokens=32, ignore_eos=True).token_ids
    assert lookup.generate(prompt, chat=True, max_new_tokens=32, ignore_eos=True).token_ids == expected


@pytest.mark.parametrize("mode", MODES)
def test_a_draft_head_cut_from_a_quantized_lm_head_keeps_its_precision(quantized, mode):
    """VocabTrim's rows of a quantized head stay in that precision (an fp32 copy cost as much per token as
    the whole int4 head), and give the head's own logits on those rows; prompt rows come as a second block."""
    backend = quantized[mode][0].backend
    head = DraftHead(backend, 32).for_prompt([40, 3, 40, 70])
    assert head.ids.tolist() == [*range(32), 40, 70]
    assert type(head.blocks[0]) is type(backend.lm_head()) and len(head.blocks) == 2
    normed = torch.randn(2, backend.config.hidden_size, generator=torch.Generator().manual_seed(0))  # not flaky
    full = backend.lm_head()(normed)
    torch.testing.assert_close(head(normed), full[:, head.ids], rtol=0.05, atol=0.05)


def test_int4_rounding_a_slice_at_a_time_is_rounding_the_whole_matrix(monkeypatch):
    weight = 0.02 * torch.randn(37, 96, generator=torch.Generator().manual_seed(0))
    weight[3, :32] = 0.5  # a constant group: the smallest scale
    monkeypatch.setattr(quantized_layers, "ROUNDING_SLICE", 10**9)
    whole = quantized_layers.int4_levels(weight, 32)
    monkeypatch.setattr(quantized_layers, "ROUNDING_SLICE", 5 * 96)  # 5 rows a slice, the last one 2
    sliced = quantized_layers.int4_levels(weight, 32)
    assert all(torch.equal(a, b) for a, b in zip(whole, sliced, strict=True))
    assert whole[0].shape == (37, 96) and whole[1].shape == whole[2].shape == (37, 3)


def test_the_python_api_loads_a_quantized_target_and_refuses_an_unknown_precision_before_loading(tiny_dirs):
    import specdecode

    with pytest.raises(SpecDecodeError, match="quantize must be one of"):
        specdecode.load("no-such-model", quantize="int3")  # refused before the model is looked up
    generator = specdecode.load(str(tiny_dirs["target"]), drafter="pld", quantize="int8", max_new_tokens=6)
    assert any(isinstance(m, Int8Linear) for m in generator.target.backend.model.modules())
    plain = specdecode.load(str(tiny_dirs["target"]), drafter="none", quantize="int8", max_new_tokens=6)
    assert generator.generate("w1 w2 w1 w2").token_ids == plain.generate("w1 w2 w1 w2").token_ids


@needs_w4a8
def test_a_new_w4a8_kernel_is_timed_anew(monkeypatch):
    """The cost curves and ``--quantize auto``'s choice are keyed by the w4a8 kernel's instruction set and source: a
    model whose kernel changed (an upgrade) does not read the timings of the kernel before it."""
    from specdecode.models import cost

    model = nn.Sequential(W4A8Linear(nn.Linear(128, 64), tied=False))
    before = cost.machine_and_model_key(model, "settings")
    assert cost.machine_and_model_key(model, "settings") == before
    monkeypatch.setattr(w4a8, "source_digest", lambda: "another kernel")
    assert cost.machine_and_model_key(model, "settings") != before


@needs_w4a8
def test_w4a8_projections_whose_blocks_are_padded_are_not_fused_and_stay_exact():
    """Two 40-channel projections end in padded blocks: their blocks side by side would scramble the channels, so
    the written-out step keeps them apart (found by its probe) and gives each its own output."""
    from specdecode.models.draft_step import FusedProjection

    torch.manual_seed(0)
    layers = [W4A8Linear(nn.Linear(128, 40), tied=False), W4A8Linear(nn.Linear(128, 48), tied=False)]
    fused = FusedProjection(layers)
    assert not fused.fused
    x = torch.randn(1, 128)
    with torch.inference_mode():
        assert torch.equal(fused(x), torch.cat([layer(x) for layer in layers], dim=-1))
    whole = [W4A8Linear(nn.Linear(128, 32), tied=False), W4A8Linear(nn.Linear(128, 48), tied=False)]
    assert FusedProjection(whole).fused  # the control: whole blocks fuse
