"""The target's row-invariant forward of one sequence's chain, written out, for w4a8 models.

Why: with w4a8 weights, a 1.5B target's one-token step on a CPU spends a large part of its time outside its matmuls,
in the modules around them (transformers' decoder, the quantized layers' dtype round trips, three query / key /
value calls and two gate / up calls that each quantize the same input), which the written-out draft step
(:mod:`specdecode.models.draft_step`) saves.  But a draft step may differ from the modules in the last bits, a
target step may not: plain decoding and verification of every drafter, solo and batched, must give each row the same
logits.

So this step computes exactly what the modules compute, operation for operation: the models' own norm,
embedding, rotary and output-projection modules; fused query / key / value and gate / up projections
(:class:`~specdecode.models.draft_step.FusedProjection`, shared with the draft step), which agree bitwise
with the separate layers because the w4a8 kernel computes each pair of output channels on its own, for any
rows; the keys and values written where :meth:`SlotPool.write` writes them; and the very attention function
of the modules' path (:func:`~specdecode.models.ragged.ragged_attention`, row invariant).  Tests compare its
logits with the modules' bitwise.  It takes one sequence's chain or tree (positions and an ancestor mask, as
the modules take them) with every row invariant and nothing captured; anything else (prompts, batches,
hidden states, skipped layers) goes through the modules.  Trees matter as much as chains: the cost model
prices every verification by the curve measured on chains, and a tree through the modules costs more than
that curve says, enough to make tree drafters lose (``docs/results/avx2``: trees through the target step).
"""

from __future__ import annotations

import torch
from torch import nn

from specdecode.models.base import apply_rotary
from specdecode.models.draft_step import DraftStep
from specdecode.models.ragged import RaggedBatch, SequenceSlice, SlotCache, ragged_attention
from specdecode.models.w4a8 import W4A8Linear


class TargetStep:
    """A chain or tree of new tokens through a Llama-shaped w4a8 model on top of a :class:`SlotCache`."""

    def __init__(self, model: nn.Module, draft_step: DraftStep) -> None:
        decoder = model.model
        self.embed = decoder.embed_tokens
        self.rotary = decoder.rotary_emb
        self.norm = decoder.norm
        self.head = model.get_output_embeddings()
        self.modules = list(decoder.layers)
        self.fused = draft_step.layers  # the fused projections, one set for both steps
        self.heads, self.kv_heads, self.head_dim = draft_step.heads, draft_step.kv_heads, draft_step.head_dim

    @torch.inference_mode()
    def __call__(
        self,
        tokens: torch.Tensor,
        cache: SlotCache,
        logits_rows: torch.Tensor,
        positions: torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """[len(logits_rows), vocab] fp32 logits of ``tokens`` fed at ``cache.length`` (which grows by as many);
        a tree's tokens at their ``positions`` (default: in a row), each seeing the rows ``tree_mask`` allows
        (:class:`~specdecode.models.base.SequenceInput`).  None (nothing done) while the pool holds no layer
        yet (a forward through the modules creates them)."""
        pool, slot, past = cache.pool, cache.slot, cache.length
        if len(pool.layers) != len(self.modules):
            return None
        count = int(tokens.shape[0])
        pool.reserve(pool.slots, past + count)
        if positions is None:
            positions = torch.arange(past, past + count, device=pool.device)
        positions = positions.to(pool.device)
        batch = RaggedBatch([SequenceSlice(slot, slice(0, count), past, positions, tree_mask)], row_invariant=True)
        hidden = self.embed(tokens.to(pool.device).view(1, count))
        cos, sin = self.rotary(hidden, positions.view(1, count))
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        width = hidden.shape[-1]
        for index, (module, fused) in enumerate(zip(self.modules, self.fused)):
            attention, mlp = module.self_attn, module.mlp
            normed = module.input_layernorm(hidden).reshape(count, width)
            query, key, value = fused.qkv(normed).split(fused.qkv.sizes, dim=-1)
            query = apply_rotary(query.contiguous().view(1, count, heads, dim).transpose(1, 2), cos, sin)
            key = apply_rotary(key.contiguous().view(1, count, kv_heads, dim).transpose(1, 2), cos, sin)
            keys, values = pool.layers[index]
            keys[slot, :, past : past + count] = key[0]
            values[slot, :, past : past + count] = value.contiguous().view(count, kv_heads, dim).transpose(0, 1)
            attended, _ = ragged_attention(
                attention, query, keys, values, None, scaling=attention.scaling, ragged=batch
            )
            hidden = hidden + attention.o_proj(attended.reshape(1, count, heads * dim).contiguous())
            normed = module.post_attention_layernorm(hidden).reshape(count, width)
            gate, up = fused.gate_up(normed).split(fused.gate_up.sizes, dim=-1)
            product = mlp.act_fn(gate.contiguous().view(1, count, -1)) * up.contiguous().view(1, count, -1)
            hidden = hidden + mlp.down_proj(product)
        pool.lengths[slot] = past + count
        return self.head(self.norm(hidden)[:, logits_rows])[0].float()


def takes_target_step(draft_step: DraftStep) -> bool:
    """Whether the model behind ``draft_step`` has w4a8 projections, the kernel whose fused calls agree bitwise
    with the separate ones for any rows (torch's int4 and int8 kernels are not known to).  A draft step exists
    only where every decoder projection is of one kind (:func:`~specdecode.models.draft_step.build_draft_step`),
    so one layer tells."""
    return type(draft_step.layers[0].down) is W4A8Linear
