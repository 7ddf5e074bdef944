"""Ragged batches over a slot pool: the KV storage and the attention behind the transformers backend.

A batched forward concatenates every sequence's new tokens into one row; the model's own modules (linear
layers, norms, rotary embeddings, LM head) see those ``T`` rows and never a padding row.  Only attention
is per sequence: :func:`ragged_attention`, registered with transformers' ``AttentionInterface``, writes
each sequence's new keys and values into that sequence's slot of a :class:`SlotPool` and attends from its
queries to its own slot only — its cached positions plus its new tokens under its own causal or tree mask
(and sliding window).  So no sequence can see another, there is no padding to mask, and a sequence's
attention is the very same computation whether it runs alone or in a batch.  Called by transformers
itself (``generate``), the function falls back to transformers' SDPA attention.

On a CPU, one call of the attention kernel (:mod:`specdecode.models.attention_kernel`) per layer attends every
sequence's new tokens, each row on its own, and one call writes every sequence's new keys and values: rows are batch
and row invariant by construction, so speculative verification gives each row bitwise what plain decoding gives it.
A prompt's chunk of more rows keeps an SDPA call of its own, which depends on the chunk and its slot only.

Where the kernel is not built (a GPU, no C++ compiler), each sequence attends in an SDPA call of its own, and for a
model whose other layers are batch invariant (weight-only quantized, :mod:`specdecode.models.quantize`)
``RaggedBatch.row_invariant`` makes attention invariant too: every token that continues a sequence attends in its
own SDPA call, the one a one-token forward makes.  A prompt's chunk keeps one call per sequence: plain and
speculative decoding, alone or in a batch, feed it alike (``SequenceInput.invariant`` false), as does a draft model's
forward.

The pool keeps, per layer, one tensor ``[slots, kv_heads, capacity, head_dim]`` for keys and one for
values, grown by doubling; a sequence's cache is a slot and a length.  Cropping is setting the length;
compacting a verified tree gathers the accepted path within the slot.  Writes beyond the length are
allowed (the next forward overwrites them), which is what lets self-speculative drafts append their
positions with layers skipped and crop them away again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

from specdecode.models.attention_kernel import FEW_ROWS, chunk_attention_op, kernel_attends, ragged_attention_op
from specdecode.models.base import KVCache, KVPool
from specdecode.models.cpu_kernels import cpu_kernels_built
from specdecode.models.row_attention import (
    BUCKET,
    TreePlan,
    attend_chain_in_buckets,
    batches_are_row_invariant,
    bucket_call,
    bucket_end,
    buckets_are_row_invariant,
    one_row_attention,
)

ATTENTION = "specdecode_ragged"
CAUSAL = "causal"  # RaggedBatch.mask: a causal block over nothing cached


class SlotPool(KVPool):
    """Keys and values of up to ``slots`` sequences, each in its own slot; grows on demand."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> (keys, values)
        self.slots = 0
        self.capacity = 0
        self.free: list[int] = []
        self.lengths: dict[int, int] = {}  # slot -> length, for slots in use

    @property
    def active(self) -> int:
        return len(self.lengths)

    def allocate(self) -> SlotCache:
        if not self.free:
            self._grow(max(1, 2 * self.slots), self.capacity)
        slot = self.free.pop()
        self.lengths[slot] = 0
        return SlotCache(self, slot)

    def release(self, slot: int) -> None:
        if self.lengths.pop(slot, None) is not None:
            self.free.append(slot)

    def reserve(self, slots: int, length: int) -> None:
        """Room for ``slots`` sequences of ``length`` positions (grown by doubling, so that growing often
        costs little in all)."""
        if slots > self.slots or length > self.capacity:
            grown_slots = self.slots if slots <= self.slots else max(slots, 2 * self.slots)
            grown_capacity = self.capacity if length <= self.capacity else max(length, 2 * self.capacity, 64)
            self._grow(grown_slots, grown_capacity)

    @torch.inference_mode()
    def _grow(self, slots: int, capacity: int) -> None:
        # A whole number of buckets: a row-invariant call covers its bucket's columns (models.row_attention).
        capacity = -(-capacity // BUCKET) * BUCKET
        for layer, pair in self.layers.items():
            grown = []
            for old in pair:
                new = old.new_zeros((slots, old.shape[1], capacity, old.shape[3]))
                new[: old.shape[0], :, : old.shape[2]] = old
                grown.append(new)
            self.layers[layer] = (grown[0], grown[1])
        self.free.extend(range(slots - 1, self.slots - 1, -1))
        self.slots, self.capacity = slots, capacity

    def write(
        self, layer: int, keys: torch.Tensor, values: torch.Tensor, batch: RaggedBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store [1, kv_heads, T, d] new keys/values at each sequence's slot and positions; the layer's storage."""
        if layer not in self.layers:
            shape = (self.slots, keys.shape[1], self.capacity, keys.shape[3])
            self.layers[layer] = (keys.new_zeros(shape), values.new_zeros(shape))
        stored_keys, stored_values = self.layers[layer]
        # One call for every sequence where the CPU kernels are built (they copy rows whose last dimension is dense).
        dense_rows = keys.stride(-1) == values.stride(-1) == 1
        if keys.device.type == "cpu" and dense_rows and cpu_kernels_built():
            torch.ops.specdecode_attention.write_slots(
                stored_keys, stored_values, keys[0], values[0], batch.kernel_plan.slots
            )
            return stored_keys, stored_values
        for seq in batch.sequences:  # a slice copy each: cheaper than one scatter for the batch sizes we run
            stored_keys[seq.slot, :, seq.past : seq.end] = keys[0, :, seq.rows]
            stored_values[seq.slot, :, seq.past : seq.end] = values[0, :, seq.rows]
        return stored_keys, stored_values

    @torch.inference_mode()
    def copy_prefix(self, source: int, slot: int, length: int) -> None:
        """Positions ``[0, length)`` of slot ``source`` become ``slot``'s (every layer's keys and values)."""
        for stored in self.layers.values():
            for tensor in stored:
                tensor[slot, :, :length] = tensor[source, :, :length]
        self.lengths[slot] = length

    @torch.inference_mode()
    def move(self, slot: int, start: int, source_columns: torch.Tensor) -> None:
        """Columns ``source_columns`` of ``slot`` (ascending, all >= start) become ``start, start + 1, ...``."""
        storage = [tensor for stored in self.layers.values() for tensor in stored]
        if self.device.type == "cpu" and cpu_kernels_built():  # one call for every layer (the storage is contiguous)
            torch.ops.specdecode_attention.move_columns(storage, slot, start, source_columns)
            return
        target = slice(start, start + len(source_columns))
        for tensor in storage:
            tensor[slot, :, target] = tensor[slot, :, source_columns]


class SlotCache(KVCache):
    """One sequence's cache: a slot of a :class:`SlotPool` and how many of its positions are valid."""

    def __init__(self, pool: SlotPool, slot: int) -> None:
        self.pool = pool
        self.slot = slot

    @property
    def length(self) -> int:
        return self.pool.lengths[self.slot]

    def crop(self, length: int) -> None:
        self.pool.lengths[self.slot] = min(self.length, max(0, length))

    def _gather(self, start: int, offsets: list[int]) -> None:
        columns = torch.tensor(offsets, dtype=torch.long, device=self.pool.device) + start
        self.pool.move(self.slot, start, columns)
        self.pool.lengths[self.slot] = start + len(offsets)

    def release(self) -> None:
        self.pool.release(self.slot)

    def adopt_prefix(self, source: KVCache, length: int) -> bool:
        if not isinstance(source, SlotCache) or source.pool is not self.pool or self.length or length > source.length:
            return False
        self.pool.copy_prefix(source.slot, self.slot, length)
        return True


@dataclass
class SequenceSlice:
    """One sequence's part of a ragged forward: its slot, its rows among the flattened tokens, what it held."""

    slot: int
    rows: slice  # its new tokens among the flattened batch
    past: int  # cached positions before this forward
    positions: torch.Tensor  # [n] positions of its new tokens
    tree_mask: torch.Tensor | None
    invariant: bool = True  # False: no row invariance needed (SequenceInput.invariant)

    @property
    def new(self) -> int:
        """How many new tokens it brings."""
        return self.rows.stop - self.rows.start

    @property
    def end(self) -> int:
        """Its cache length after this forward."""
        return self.past + self.new

    @cached_property
    def branches(self) -> list[torch.Tensor]:
        """Per new token of a tree, the new tokens it sees — its ancestors and itself, in order; found once per
        forward, read by every layer's row-by-row attention."""
        assert self.tree_mask is not None, "a chain has no branches"
        return [torch.nonzero(row).flatten() for row in self.tree_mask]

    def tree_plan(self, groups: int) -> TreePlan:
        """A tree's batched bucket calls (:class:`TreePlan`), planned on the first layer that asks."""
        plan = self.__dict__.get("_tree_plan")
        if plan is None or plan.groups != groups:
            plan = self.__dict__["_tree_plan"] = TreePlan(self._paths(), self.past, groups)
        return plan

    def _paths(self) -> list[tuple[list[int], int]]:
        """A tree's root-to-leaf paths (each a leaf's branch), with how many of each path's nodes the paths
        before it cover (always a head of the path: covered nodes are closed under ancestors)."""
        branches = [branch.tolist() for branch in self.branches]
        inner = {node for branch in branches for node in branch[:-1]}
        covered: set[int] = set()
        out = []
        for leaf, branch in enumerate(branches):
            if leaf not in inner:
                out.append((branch, sum(node in covered for node in branch)))
                covered.update(branch)
        return out


@dataclass
class KernelPlan:
    """What the attention kernel (:mod:`specdecode.models.attention_kernel`) reads for one forward: its sequences'
    ``meta`` rows (slot, first row, rows, cached length, tree mask offset or -1), their tree masks flattened into
    ``masks``, every row's position, the sequences left to SDPA (a prompt's chunk of many rows), and every
    sequence's row of the same kind in ``slots`` (where its new keys and values are written)."""

    meta: torch.Tensor
    masks: torch.Tensor
    positions: torch.Tensor
    others: list[int]
    slots: torch.Tensor

    @staticmethod
    def of(sequences: list[SequenceSlice]) -> KernelPlan:
        meta, masks, others, offset = [], [], [], 0
        slots = [[seq.slot, seq.rows.start, seq.new, seq.past, -1] for seq in sequences]
        for index, seq in enumerate(sequences):
            if not seq.invariant and seq.new > FEW_ROWS:
                others.append(index)
                continue
            mask_offset = -1
            if seq.tree_mask is not None:
                mask_offset = offset
                masks.append(seq.tree_mask.to(device="cpu", dtype=torch.bool).flatten())
                offset += seq.new * seq.new
            meta.append([seq.slot, seq.rows.start, seq.new, seq.past, mask_offset])
        positions = torch.cat([seq.positions.to("cpu", torch.long) for seq in sequences]).contiguous()
        return KernelPlan(
            torch.tensor(meta, dtype=torch.long).view(-1, 5),
            torch.cat(masks) if masks else torch.empty(0, dtype=torch.bool),
            positions,
            others,
            torch.tensor(slots, dtype=torch.long),
        )


@dataclass
class RaggedBatch:
    """Where each sequence's tokens are in the flattened batch and what each may attend to; built once per
    forward, read by every layer's attention."""

    sequences: list[SequenceSlice]
    #: Attend row by row (see :func:`ragged_attention`), for a model whose other layers are batch invariant.
    row_invariant: bool = False
    _masks: dict[tuple[int, int | None, int], torch.Tensor | None] = field(default_factory=dict)

    @cached_property
    def kernel_plan(self) -> KernelPlan:
        """The attention kernel's reading of this batch, built once per forward for every layer."""
        return KernelPlan.of(self.sequences)

    def mask(self, index: int, window: int | None, groups: int) -> torch.Tensor | str | None:
        """[groups * n, past + n] bool: what sequence ``index``'s query rows (``groups`` query heads per key
        head stacked, see :func:`ragged_attention`) may attend to; None when everything is visible, ``CAUSAL``
        for a plain causal block with nothing cached (a prompt), which SDPA computes faster without a mask."""
        key = (index, window, groups)
        if key not in self._masks:
            self._masks[key] = self._build_mask(self.sequences[index], window, groups)
        return self._masks[key]

    @staticmethod
    def _build_mask(seq: SequenceSlice, window: int | None, groups: int) -> torch.Tensor | str | None:
        n = seq.new
        device = seq.positions.device
        if seq.past == 0 and seq.tree_mask is None and n > 1 and (window is None or window >= n):
            return CAUSAL
        if seq.tree_mask is not None:
            new = seq.tree_mask.to(device=device, dtype=torch.bool)
        else:
            new = torch.ones(n, n, dtype=torch.bool, device=device).tril()
        allowed = torch.cat([torch.ones(n, seq.past, dtype=torch.bool, device=device), new], dim=1)
        if window is not None:
            # Cached column c holds position c (caches only ever keep accepted chains); new column j holds
            # positions[j].  A query at p sees keys at positions p - window < k <= p.
            key_positions = torch.cat([torch.arange(seq.past, device=device), seq.positions])
            allowed &= key_positions[None, :] > seq.positions[:, None] - window
        if bool(allowed.all()):
            return None
        return allowed.repeat(groups, 1) if groups > 1 else allowed


class RaggedCacheView:
    """What transformers' attention modules see as ``past_key_values`` during a ragged forward."""

    def __init__(self, pool: SlotPool, batch: RaggedBatch) -> None:
        self.pool = pool
        self.batch = batch

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, cache_kwargs=None):
        return self.pool.write(layer_idx, keys, values, self.batch)


def ragged_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    ragged: RaggedBatch | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention of each sequence's queries to its own slot.  ``query`` [1, heads, T, d]; ``key``/``value``
    the layer's slot storage [slots, kv_heads, capacity, d].  Returns [1, T, heads, d].

    Grouped-query attention without copying keys: the ``groups`` query heads that share a key head are
    stacked along the query axis ([1, kv_heads, groups * n, d]), so one SDPA call per sequence reads the
    slot's keys in place."""
    if ragged is None:  # transformers' own code paths (generate, ...): its standard SDPA attention
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            sliding_window=sliding_window,
            **kwargs,
        )
    if getattr(module.config, "attn_logit_softcapping", None):
        raise NotImplementedError("attention logit softcapping is not supported by the ragged attention")
    if kernel_attends(query):
        return attend_with_kernel(query, key, value, ragged, scaling, sliding_window), None
    heads, kv_heads, dim = query.shape[1], key.shape[1], query.shape[3]
    groups = heads // kv_heads
    outputs = []
    for index, seq in enumerate(ragged.sequences):
        if ragged.row_invariant and seq.invariant:
            bucketed = (
                sliding_window is None
                and query.device.type == "cpu"
                and buckets_are_row_invariant(kv_heads, groups, dim, query.dtype)
            )
            if bucketed and seq.tree_mask is None:
                slot = slice(seq.slot, seq.slot + 1)
                outputs.append(attend_chain_in_buckets(query, key[slot], value[slot], seq.rows, seq.past, scaling))
            elif bucketed and batches_are_row_invariant(kv_heads, groups, dim, query.dtype):
                plan = seq.tree_plan(groups)
                outputs.append(plan.attend(query[0, :, seq.rows], key[seq.slot], value[seq.slot], scaling))
            else:
                outputs.append(_attend_row_by_row(query, key, value, seq, scaling, sliding_window, bucketed))
            continue
        outputs.append(_sdpa(query, key, value, ragged, index, scaling, sliding_window))
    out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)
    return out.transpose(1, 2), None


def _sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    ragged: RaggedBatch,
    index: int,
    scaling: float | None,
    sliding_window: int | None,
) -> torch.Tensor:
    """Sequence ``index``'s attention in one SDPA call; [1, heads, n, d]."""
    heads, kv_heads, dim = query.shape[1], key.shape[1], query.shape[3]
    groups = heads // kv_heads
    seq = ragged.sequences[index]
    n, end = seq.new, seq.end
    keys, values = key[seq.slot : seq.slot + 1, :, :end], value[seq.slot : seq.slot + 1, :, :end]
    mask = ragged.mask(index, sliding_window, groups)
    if mask is CAUSAL:
        out = nn.functional.scaled_dot_product_attention(
            query[:, :, seq.rows], keys, values, is_causal=True, scale=scaling, enable_gqa=groups > 1
        )
    else:
        q = query[:, :, seq.rows].reshape(1, kv_heads, groups * n, dim)
        out = nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scaling)
    return out.view(1, heads, n, dim)


def attend_with_kernel(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    ragged: RaggedBatch,
    scaling: float | None,
    sliding_window: int | None,
) -> torch.Tensor:
    """Every sequence's attention: the kernel's one call for all but a prompt's long chunk, the chunk kernel's call
    (or SDPA) for each of those; [1, T, heads, d]."""
    heads, rows, dim = query.shape[1], query.shape[2], query.shape[3]
    plan = ragged.kernel_plan
    out = query.new_empty(rows, heads, dim)
    scale = dim**-0.5 if scaling is None else scaling
    if len(plan.meta):
        q = query[0] if query.stride(3) == 1 else query[0].contiguous()
        ragged_attention_op()(q, key, value, plan.meta, plan.masks, plan.positions, scale, sliding_window or 0, out)
    chunk_op = chunk_attention_op(query, sliding_window)
    for index in plan.others:
        seq = ragged.sequences[index]
        if chunk_op is not None and seq.tree_mask is None:
            chunk_op(query[0, :, seq.rows], key, value, seq.slot, seq.past, scale, out[seq.rows])
        else:
            out[seq.rows] = _sdpa(query, key, value, ragged, index, scaling, sliding_window)[0].transpose(0, 1)
    return out.unsqueeze(0)


def _attend_row_by_row(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    seq: SequenceSlice,
    scaling: float | None,
    sliding_window: int | None,
    bucketed: bool,
) -> torch.Tensor:
    """Each new token of ``seq`` attended exactly as if it were fed alone after the keys it may see: the call
    of a one-token forward of plain decoding (``bucketed``: the bucket-shaped one of
    :mod:`specdecode.models.row_attention`), on the same shapes and values.  Returns [1, heads, n, d].

    Why: SDPA is not batch invariant (a row's result depends in the last bits on how many query rows share
    the call), and a quantized model rounds every layer's input to bf16, so those last bits can move a logit
    by a whole bf16 step and break a near-tie differently from plain decoding.  A chain row sees the slot's
    prefix up to itself.  A tree row must see the cache and then its ancestors in order, as plain decoding of
    its branch would have cached them: the branch is written into the columns after the cache for its call
    (a few columns; the cache itself is never copied), and the tree's own layout is put back at the end."""
    heads, kv_heads, dim = query.shape[1], key.shape[1], query.shape[3]
    groups = heads // kv_heads
    slot, past, n = seq.slot, seq.past, seq.new
    new_columns = slice(past, past + n)
    if seq.tree_mask is not None:
        tree_keys, tree_values = key[slot, :, new_columns].clone(), value[slot, :, new_columns].clone()
    rows = []
    for row in range(n):
        seen = past + row + 1
        if seq.tree_mask is not None:
            branch = seq.branches[row]
            seen = past + len(branch)
            key[slot, :, past:seen], value[slot, :, past:seen] = tree_keys[:, branch], tree_values[:, branch]
        mask = None  # a lone token sees every key before it, unless a sliding window cuts the oldest off
        if sliding_window is not None:
            alone = SequenceSlice(slot, slice(0, 1), seen - 1, seq.positions[row : row + 1], None)
            mask = RaggedBatch._build_mask(alone, sliding_window, groups)
        q = query[:, :, seq.rows.start + row].reshape(1, kv_heads, groups, dim).contiguous()
        if bucketed:
            out = bucket_call(q, key[slot : slot + 1], value[slot : slot + 1], [seen], bucket_end(seen - 1), scaling)
        else:
            out = one_row_attention(q, key[slot : slot + 1, :, :seen], value[slot : slot + 1, :, :seen], mask, scaling)
        rows.append(out.view(1, heads, 1, dim))
    if seq.tree_mask is not None:
        key[slot, :, new_columns], value[slot, :, new_columns] = tree_keys, tree_values
    return torch.cat(rows, dim=2)


AttentionInterface.register(ATTENTION, ragged_attention)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)  # transformers' own paths build standard SDPA masks
