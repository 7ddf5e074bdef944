"""A draft model's one-token forward written out, for Llama-shaped models with weight-only quantized layers.

Why: a draft model makes its tokens one forward at a time, and a small model's one-token forward on a CPU is mostly
the Python and dispatch around its kernels (transformers' modules, their hooks, a dtype round trip around every
quantized layer), which this step saves (``docs/results/avx2``, ``draft_step_timing*.txt``). Written out as in
gpt-fast's model: the query, key and value projections are one call of a fused weight, and so are the gate and up
projections (vLLM's ``QKVParallelLinear`` and ``MergedColumnParallelLinear``); norms are ``F.rms_norm``; the new key
and value go straight into the sequence's slot of the pool (:class:`~specdecode.models.ragged.SlotPool`) and one
call of the modules' attention kernel (:mod:`specdecode.models.attention_kernel`; SDPA where it is not built) attends
to it.

Only drafts go through it (:meth:`HFCausalLM.draft_logits`): its logits differ from the modules' in the last
bits (another norm kernel, another rounding order), which cannot change the output — the target verifies
every draft token with its own forward.  The fused weights share the layers' packed storage (the layers'
own weights become views of it), so nothing is held twice but the small scales.  A w4a8 target's written-out
forward (:mod:`specdecode.models.target_step`) multiplies through the same fused projections.

It takes models whose ``model_type`` is in :data:`LEAN_MODEL_TYPES`, with SiLU MLPs, no sliding window and
every decoder projection an int4, int8 or w4a8 layer (:mod:`specdecode.models.quantized_layers`, how draft models load
by default); any other model keeps its modules (:func:`build_draft_step` returns None).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specdecode.models.attention_kernel import kernel_attends
from specdecode.models.base import apply_rotary
from specdecode.models.quantized_layers import Int4Linear, Int8Linear, QuantizedLinear
from specdecode.models.ragged import RaggedBatch, SequenceSlice, SlotCache, attend_with_kernel
from specdecode.models.w4a8 import W4A8Linear

#: transformers' ``model_type`` of the decoders laid out as Llama's (pre-norm RMSNorm scaled by its weight,
#: rotary embedding by halves, grouped-query attention, gated SiLU MLP).
LEAN_MODEL_TYPES = ("llama", "qwen2", "mistral")


class FusedProjection:
    """Several quantized projections of one input in one kernel call, where their packed weights concatenate
    (:meth:`QuantizedLinear.fused`).

    Whether they do is checked once, bitwise, on a random row: torch's int4 CPU layout packs output channels
    in blocks, so parts whose sizes are not whole blocks (tiny test models) come out scrambled; those keep one
    call each.  Fused, the layers' own weights become views of the fused one."""

    def __init__(self, layers: list[QuantizedLinear]) -> None:
        self.layers = layers
        self.sizes = [layer.out_features for layer in layers]
        biases = [layer.bias for layer in layers]
        self.bias = None  # Qwen2's query, key and value have biases; Llama's projections none
        if any(bias is not None for bias in biases):
            parts = [bias if bias is not None else torch.zeros(size) for bias, size in zip(biases, self.sizes)]
            self.bias = torch.cat(parts).detach()
        self.layer: QuantizedLinear | None = layers[0].fused(layers)
        probe = torch.randn(1, layers[0].in_features, generator=torch.Generator().manual_seed(0))
        probe = probe.to(layers[0].input_dtype)
        expected = torch.cat([layer.matmul(probe) for layer in layers], dim=-1)
        if not torch.equal(self.layer.matmul(probe), expected):
            self.layer = None  # the layers keep their own weights; no second copy
            return
        for name, dim in self.layer.channel_buffers:
            if dim == 0:  # rows of the fused buffer: contiguous views (w4a8 keeps a row per channel pair)
                sizes = [getattr(layer, name).shape[0] for layer in layers]
                for layer, part in zip(layers, getattr(self.layer, name).split(sizes)):
                    setattr(layer, name, part)

    @property
    def fused(self) -> bool:
        return self.layer is not None

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        """[1, in] rows in the layers' input dtype → [1, sum of sizes] fp32, biases added."""
        if self.layer is None:
            return torch.cat([_project(layer, rows) for layer in self.layers], dim=-1)
        out = self.layer.matmul(rows).float()
        return out + self.bias if self.bias is not None else out


def _project(layer: QuantizedLinear, rows: torch.Tensor) -> torch.Tensor:
    out = layer.matmul(rows).float()
    return out + layer.bias if layer.bias is not None else out


@dataclass
class _Layer:
    attention_norm: torch.Tensor
    qkv: FusedProjection
    output: QuantizedLinear
    mlp_norm: torch.Tensor
    gate_up: FusedProjection
    down: QuantizedLinear


class DraftStep:
    """One token through a Llama-shaped model, on top of a :class:`SlotCache`: the next token's logits."""

    def __init__(self, model: nn.Module, config) -> None:
        decoder = model.model
        self.embed = decoder.embed_tokens
        self.rotary = decoder.rotary_emb
        self.norm = decoder.norm.weight
        self.head = model.get_output_embeddings()
        self.eps = float(config.rms_norm_eps)
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or self.heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.heads)
        self.input_dtype = decoder.layers[0].self_attn.q_proj.input_dtype  # what the quantized kernels take
        self.layers = []
        for layer in decoder.layers:
            attention, mlp = layer.self_attn, layer.mlp
            self.layers.append(
                _Layer(
                    attention_norm=layer.input_layernorm.weight,
                    qkv=FusedProjection([attention.q_proj, attention.k_proj, attention.v_proj]),
                    output=attention.o_proj,
                    mlp_norm=layer.post_attention_layernorm.weight,
                    gate_up=FusedProjection([mlp.gate_proj, mlp.up_proj]),
                    down=mlp.down_proj,
                )
            )

    @torch.inference_mode()
    def __call__(
        self, token: int, cache: SlotCache, head: Callable[[torch.Tensor], torch.Tensor] | None = None
    ) -> torch.Tensor | None:
        """[vocab] fp32 logits after ``token`` fed at ``cache.length``, which grows by one, through ``head`` if
        given (VocabTrim's rows) instead of the LM head; None (nothing done) while the pool holds no layer yet
        (a forward through the modules creates its storage)."""
        pool, slot, position = cache.pool, cache.slot, cache.length
        if len(pool.layers) != len(self.layers):
            return None
        pool.reserve(pool.slots, position + 1)
        hidden = self.embed(torch.tensor([token], device=pool.device))
        cos, sin = self.rotary(hidden[None], torch.tensor([[position]], device=pool.device))
        cos, sin = cos[0], sin[0]
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        width = hidden.shape[-1]
        # The modules' attention where its kernel is built: an activation-quantized model (w4a8) turns the last bits
        # of another attention into whole quantization steps.
        kernel = kernel_attends(pool.layers[0][0])
        if kernel:
            batch = RaggedBatch([SequenceSlice(slot, slice(0, 1), position, torch.tensor([position]), None)])
        for index, layer in enumerate(self.layers):
            normed = F.rms_norm(hidden, (width,), layer.attention_norm, self.eps).to(self.input_dtype)
            query, key, value = layer.qkv(normed).split(layer.qkv.sizes, dim=-1)
            query = apply_rotary(query.view(heads, dim), cos, sin)
            keys, values = pool.layers[index]
            keys[slot, :, position] = apply_rotary(key.view(kv_heads, dim), cos, sin)
            values[slot, :, position] = value.view(kv_heads, dim)
            if kernel:
                attended = attend_with_kernel(query.view(1, heads, 1, dim), keys, values, batch, None, None)
            else:  # the query heads sharing a key head stacked along the query axis (as in ragged_attention)
                attended = F.scaled_dot_product_attention(
                    query.view(1, kv_heads, heads // kv_heads, dim),
                    keys[slot : slot + 1, :, : position + 1],
                    values[slot : slot + 1, :, : position + 1],
                )
            hidden = hidden + _project(layer.output, attended.reshape(1, heads * dim).to(self.input_dtype))
            normed = F.rms_norm(hidden, (width,), layer.mlp_norm, self.eps).to(self.input_dtype)
            gate, up = layer.gate_up(normed).split(layer.gate_up.sizes, dim=-1)
            hidden = hidden + _project(layer.down, (F.silu(gate) * up).to(self.input_dtype))
        pool.lengths[slot] = position + 1
        return (head or self.head)(F.rms_norm(hidden, (width,), self.norm, self.eps))[0].float()


def build_draft_step(model: nn.Module, config) -> DraftStep | None:
    """The written-out step for ``model``, or None when it is not one this module takes (see the module doc)."""
    if getattr(config, "model_type", None) not in LEAN_MODEL_TYPES or getattr(config, "hidden_act", None) != "silu":
        return None
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return None
    decoder = getattr(model, "model", None)
    needed = ("embed_tokens", "rotary_emb", "norm", "layers")
    if decoder is None or not all(hasattr(decoder, name) for name in needed):
        return None
    kinds = set()
    for layer in decoder.layers:
        attention, mlp = layer.self_attn, layer.mlp
        projections = (attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj)
        projections += (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        kinds |= {type(p) for p in projections}
    if len(kinds) != 1 or not kinds <= {Int4Linear, Int8Linear, W4A8Linear}:
        return None  # fp32 or bf16 layers, LoRA wrappers, layers int4 could not take: the modules run
    return DraftStep(model, config)
