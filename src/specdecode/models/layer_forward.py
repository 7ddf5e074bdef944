"""A Llama-shaped decoder layer's forward in a dozen calls, for fp32 and quantized models on the CPU fast path.

Why: around its seven products and its attention, a layer of transformers' modules makes some forty small torch calls
and a dozen module calls, each a few microseconds however few its rows: a one-token forward of a 135M model on a
2-core EPYC took 17.9 ms that way and 16.0 ms written out, and the serving workload one request at a time ran about 10%
faster (``docs/results/layer-ops-smollm2-135m``); bf16 on a Xeon with AMX, 29.3 ms and 25.7 ms, and 13% faster
(``docs/results/layer-ops-amx-smollm2-135m``).  Where every projection of a layer is a panel
:class:`~specdecode.models.fastpath.PackedLinear` or a quantized layer (bf16 on the bf16 panel kernel or in oneDNN's
layout, int8, int4; not w4a8, whose target step, :mod:`specdecode.models.target_step`, reproduces the modules' bits),
:func:`install_layer_forward` gives the layer a forward that multiplies through its projections directly and does the
norms, the rotary embedding and the gated activation in one call each (``kernels/layer_ops.cpp``); the attention is the
model's own attention function, called as transformers calls it.  Quantized projections multiply bf16 rows: a norm
writes its rows in bf16 for the projections that read them, the gate and up products stay bf16 through the activation
into the down projection, the query and key products are rotated as they come (bf16 read, fp32 written) and the
attention's and the MLP's outputs are added to the residual as they come.  That leaves two conversions a layer (the
value to fp32 for the cache, the attention's output to bf16) of the fourteen the projections' own ``forward`` calls
make, and conversions cost more the more rows a forward has (``docs/results/layer-ops-amx-smollm2-135m``, second
run); each number is the same as through the conversions (a bf16 number is exact in fp32; the norm rounds as torch).

Numerics: the layer computes what transformers' does up to rounding (tests compare them), and it is the layer's only
forward from then on, alone or in a batch, for plain decoding and every drafter's verification alike, so outputs stay
equal.  Each of its kernels computes a row on its own, and a quantized projection is batch invariant as the engine
calls it with transformers' forward too, so a row gets the same bits alone as in any batch (what the engine's batch
invariance needs, :mod:`specdecode.models.ragged`).  With gradients enabled (training through the model)
or once a projection is replaced (an adapter wraps it), the layer takes transformers' forward.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from specdecode.models.cpu_kernels import cpu_kernels_built
from specdecode.models.fastpath import PackedLinear, apply_cpu_fast_path
from specdecode.models.quantized_layers import QuantizedLinear
from specdecode.models.w4a8 import W4A8Linear

#: transformers' decoder layers whose forward :class:`LayerForward` reproduces: pre-norm RMSNorm, rotary attention with
#: ``rotate_half``, a SiLU-gated MLP (Qwen2's also hands its sliding window to the attention function).
LAYERS = {"LlamaDecoderLayer", "Qwen2DecoderLayer"}
NORMS = {"LlamaRMSNorm", "Qwen2RMSNorm"}
#: A layer's seven projections, as (module, attribute), in the order :class:`LayerForward` unpacks them.
PROJECTIONS = tuple(("self_attn", name) for name in ("q_proj", "k_proj", "v_proj", "o_proj")) + tuple(
    ("mlp", name) for name in ("gate_proj", "up_proj", "down_proj")
)


def apply_cpu_fast_path_with_layers(model: nn.Module) -> None:
    """The CPU fast path as a load applies it: every fp32 linear packed (:func:`apply_cpu_fast_path`), then each decoder
    layer that takes it given its written-out forward."""
    apply_cpu_fast_path(model)
    install_layer_forward(model)


def install_layer_forward(model: nn.Module) -> int:
    """Give every decoder layer of ``model`` that :func:`takes_layer_forward` a :class:`LayerForward`; how many."""
    layers = _decoder_layers(model)
    for layer in layers:
        if takes_layer_forward(layer):
            layer.forward = LayerForward(layer)
    return sum(isinstance(layer.__dict__.get("forward"), LayerForward) for layer in layers)


def remove_layer_forward(model: nn.Module) -> None:
    """Every decoder layer back on transformers' forward."""
    for layer in _decoder_layers(model):
        if isinstance(layer.__dict__.get("forward"), LayerForward):
            del layer.forward


def takes_layer_forward(layer: nn.Module) -> bool:
    """Whether ``layer`` is one of :data:`LAYERS` with fp32 RMSNorms, a SiLU MLP and every projection in panels or
    quantized, the CPU kernels built."""
    if type(layer).__name__ not in LAYERS or not cpu_kernels_built():
        return False
    norms = (getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None))
    if not all(type(norm).__name__ in NORMS and norm.weight.dtype == torch.float32 for norm in norms):
        return False
    config = layer.self_attn.config
    if getattr(config, "hidden_act", None) not in ("silu", "swish"):
        return False
    head_dim = layer.self_attn.head_dim
    width = norms[0].weight.numel()
    if head_dim % 32 or width % 16 or config.intermediate_size % 16:  # the kernels' whole vectors
        return False
    return all(_takes(_module(layer, path)) for path in PROJECTIONS)


def every_layer_written_out(model: nn.Module) -> bool:
    """Whether every decoder layer of ``model`` has its :class:`LayerForward`, intact, every projection computing
    each row on its own in any call (panels), and full attention (no sliding window): each of its rows is then computed
    on its own, up to the attention function."""
    layers = _decoder_layers(model)
    forwards = [layer.__dict__.get("forward") for layer in layers]
    return (
        bool(layers)
        and all(isinstance(forward, LayerForward) and forward.intact() for forward in forwards)
        and all(_rows_alone(projection) for forward in forwards for projection in forward.projections)
        and all(getattr(layer.self_attn, "sliding_window", None) is None for layer in layers)
    )


class LayerForward:
    """The forward of one decoder layer (see the module docstring); transformers' own where it does not apply."""

    def __init__(self, layer: nn.Module) -> None:
        self.layer = layer
        self.projections = tuple(_module(layer, path) for path in PROJECTIONS)
        # (parent's name, parent, projection's name, projection) for intact(), read through the modules' own dicts.
        self._owners = tuple(
            (parent, getattr(layer, parent), name, projection)
            for (parent, name), projection in zip(PROJECTIONS, self.projections)
        )
        q_proj, k_proj, v_proj, _, gate_proj, up_proj, _ = self.projections
        # What each norm writes: the dtype every projection reading it multiplies, so none converts its rows.
        self.attention_rows = _common_input_dtype((q_proj, k_proj, v_proj))
        self.mlp_rows = _common_input_dtype((gate_proj, up_proj))

    def intact(self) -> bool:
        """No projection replaced since (an adapter wrapping one, the fast path removed), nor the module holding it.
        Asked of every layer in every forward, so the modules' dicts are read directly: through ``nn.Module``'s
        attribute lookup the fourteen reads took about 2% of a one-token forward of SmolLM2-135M."""
        modules = self.layer._modules
        for parent_name, parent, name, projection in self._owners:
            if modules.get(parent_name) is not parent or parent._modules.get(name) is not projection:
                return False
        return True

    def __call__(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values=None,
        use_cache: bool | None = False,
        cache_position: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs,
    ) -> torch.Tensor:
        layer = self.layer
        implementation = layer.self_attn.config._attn_implementation
        plain = position_embeddings is not None and implementation != "eager" and hidden_states.dtype == torch.float32
        if torch.is_grad_enabled() or not plain or not self.intact():
            return type(layer).forward(  # transformers' own
                layer,
                hidden_states,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=past_key_values,
                use_cache=use_cache,
                cache_position=cache_position,
                position_embeddings=position_embeddings,
                **kwargs,
            )
        attention = layer.self_attn
        q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj = self.projections
        batch, count, width = hidden_states.shape
        rows, dim = batch * count, attention.head_dim
        residual = hidden_states.reshape(rows, width).contiguous()
        normed = _norm(residual, layer.input_layernorm, self.attention_rows)
        query, key, value = _products((q_proj, k_proj, v_proj), normed)
        cos, sin = position_embeddings
        cos_rows = cos.expand(batch, count, dim).reshape(rows, dim).contiguous()
        sin_rows = sin.expand(batch, count, dim).reshape(rows, dim).contiguous()
        query, key = _rotate(query, cos_rows, sin_rows, dim), _rotate(key, cos_rows, sin_rows, dim)
        value = value.float()
        query = query.view(batch, count, -1, dim).transpose(1, 2)
        key = key.view(batch, count, -1, dim).transpose(1, 2)
        value = value.view(batch, count, -1, dim).transpose(1, 2)
        if past_key_values is not None:
            cache_kwargs = {"sin": sin, "cos": cos, "cache_position": cache_position}
            key, value = past_key_values.update(key, value, attention.layer_idx, cache_kwargs)
        if hasattr(attention, "sliding_window"):  # Qwen2's attention hands it on
            kwargs["sliding_window"] = attention.sliding_window
        attended, _ = ALL_ATTENTION_FUNCTIONS[implementation](
            attention,
            query,
            key,
            value,
            attention_mask,
            dropout=0.0,
            scaling=attention.scaling,
            position_ids=position_ids,
            use_cache=use_cache,
            **kwargs,
        )
        # A product is added in the dtype it comes in: fp32 + bf16 is the sum of its fp32 copy, without the copy.
        hidden = residual + _products((o_proj,), attended.reshape(rows, -1).contiguous())[0]
        normed = _norm(hidden, layer.post_attention_layernorm, self.mlp_rows)
        gate, up = _products((gate_proj, up_proj), normed)
        activated = torch.empty(gate.shape, dtype=_input_dtype(down_proj))
        torch.ops.specdecode_layer.silu_mul(gate, up, activated)
        hidden = hidden + _products((down_proj,), activated)[0]
        return hidden.view(batch, count, width)


def _products(projections: tuple[nn.Module, ...], rows: torch.Tensor) -> list[torch.Tensor]:
    """Each projection of ``rows`` with its bias, all in one dtype: the one their kernels give where they agree (bf16
    for quantized layers, which read one conversion of the rows between them), else fp32."""
    converted: dict[torch.dtype, torch.Tensor] = {}
    outs = []
    for projection in projections:
        if isinstance(projection, QuantizedLinear):
            dtype = projection.input_dtype
            if dtype not in converted:
                converted[dtype] = rows.to(dtype).contiguous()
            out = projection.product(converted[dtype])
            outs.append(out if projection.bias is None else out.float() + projection.bias)
        else:
            outs.append(projection.forward(rows.float()))
    if len({out.dtype for out in outs}) > 1:
        outs = [out.float() for out in outs]
    return outs


def _rotate(rows: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dim: int) -> torch.Tensor:
    """``rows``' heads rotated, in fp32: in place where they are fp32, else read as they are (a quantized layer's bf16
    product) and written to a new fp32 tensor."""
    out = rows if rows.dtype == torch.float32 else torch.empty(rows.shape)
    torch.ops.specdecode_layer.rotate_rows(rows, cos, sin, dim, out)
    return out


def _input_dtype(projection: nn.Module) -> torch.dtype:
    """The dtype ``projection`` multiplies: bf16 for a quantized layer's kernel, fp32 for panels."""
    return projection.input_dtype if isinstance(projection, QuantizedLinear) else torch.float32


def _common_input_dtype(projections: tuple[nn.Module, ...]) -> torch.dtype:
    """The dtype all of ``projections`` multiply (bf16 for quantized layers), fp32 where they differ."""
    dtypes = {_input_dtype(projection) for projection in projections}
    return dtypes.pop() if len(dtypes) == 1 else torch.float32


def _norm(rows: torch.Tensor, norm: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """The norm of fp32 ``rows``, computed in fp32, written in ``dtype`` (fp32, or bf16 rounded as torch rounds)."""
    out = torch.empty(rows.shape, dtype=dtype)
    torch.ops.specdecode_layer.rms_norm_rows(rows, norm.weight.detach(), norm.variance_epsilon, out)
    return out


def _takes(module: nn.Module | None) -> bool:
    """A projection the written-out forward multiplies through: fp32 panels, or a quantized layer but w4a8's (the
    w4a8 target step computes a sequence's rows as transformers' modules do, and the batched forward must agree)."""
    if isinstance(module, QuantizedLinear):
        return type(module) is not W4A8Linear
    return type(module) is PackedLinear and module.panels


def _rows_alone(module: nn.Module) -> bool:
    """A projection whose product computes each row on its own in any call: fp32 panels, or a quantized layer that
    says so (bf16 panels)."""
    if isinstance(module, QuantizedLinear):
        return module.rows_alone
    return type(module) is PackedLinear and module.panels


def _module(layer: nn.Module, path: tuple[str, str]) -> nn.Module | None:
    parent = getattr(layer, path[0], None)
    return getattr(parent, path[1], None)


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    decoder = getattr(model, "model", None)
    layers = getattr(decoder, "layers", None)
    return list(layers) if isinstance(layers, nn.ModuleList) else []
