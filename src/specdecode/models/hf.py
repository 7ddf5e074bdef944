"""Generic backend: any Hugging Face ``AutoModelForCausalLM`` whose attention goes through transformers'
attention interface (Llama/SmolLM2, Qwen2, Gemma3, Mistral, Phi3, ...), batched the way vLLM does it.

**Ragged batches, flattened.**  A batched forward concatenates every sequence's new tokens into one
row of ``T = sum(n_i)`` tokens with their own positions and runs the model's own modules on it: the
linear layers, norms, rotary embeddings and LM head see ``T`` rows and never a padding row.  Only
attention is per sequence: the model's attention modules are pointed at :func:`ragged_attention`
(registered with transformers' ``AttentionInterface``), which writes each sequence's new keys and values
into that sequence's slot of a :class:`SlotPool` and attends from its queries to its own slot only —
its cached positions plus its new tokens under its own causal or tree mask (and sliding window).  So no
sequence can see another, there is no padding to mask, and a sequence's attention is the very same
computation whether it runs alone or in a batch of eight.  Called by transformers itself (``generate``),
the function falls back to transformers' SDPA attention, so the wrapped model keeps working as before.

**The cache.**  Per layer one tensor ``[slots, kv_heads, capacity, head_dim]`` for keys and one for
values, grown by doubling; a sequence's cache is a slot and a length.  Cropping is setting the length;
compacting a verified tree gathers the accepted path within the slot.  Writes beyond the length are
allowed (they are overwritten by the next forward), which is what lets self-speculative drafts append
their positions with layers skipped and crop them away again: a skipped layer writes nothing, and every
position the verification reads was written by the full model.

**Self-speculation** (``skip_layers`` / ``exit_layer``, :class:`LayerwiseExecution`) runs the model's own
forward over only the executed decoder layers (``model.model.layers`` is swapped for them for that one
call; modules keep their ``layer_idx``).  Exiting at layer L is running layers 0..L-1 only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

from specdecode.models.base import CausalLM, ForwardOutput, KVCache, KVPool, LayerwiseExecution, SequenceInput

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
        for seq in batch.sequences:  # a slice copy each: cheaper than one scatter for the batch sizes we run
            end = seq.past + seq.rows.stop - seq.rows.start
            stored_keys[seq.slot, :, seq.past : end] = keys[0, :, seq.rows]
            stored_values[seq.slot, :, seq.past : end] = values[0, :, seq.rows]
        return stored_keys, stored_values

    @torch.inference_mode()
    def move(self, slot: int, start: int, source_columns: torch.Tensor) -> None:
        """Columns ``source_columns`` of ``slot`` (ascending, all >= start) become ``start, start + 1, ...``."""
        target = slice(start, start + len(source_columns))
        for stored in self.layers.values():
            for tensor in stored:
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


@dataclass
class _Sequence:
    slot: int
    rows: slice  # its new tokens among the flattened batch
    past: int  # cached positions before this forward
    positions: torch.Tensor  # [n] positions of its new tokens
    tree_mask: torch.Tensor | None


@dataclass
class RaggedBatch:
    """Where each sequence's tokens are in the flattened batch and what each may attend to; built once per
    forward, read by every layer's attention."""

    sequences: list[_Sequence]
    _masks: dict[tuple[int, int | None, int], torch.Tensor | None] = field(default_factory=dict)

    def mask(self, index: int, window: int | None, groups: int) -> torch.Tensor | str | None:
        """[groups * n, past + n] bool: what sequence ``index``'s query rows (``groups`` query heads per key
        head stacked, see :func:`ragged_attention`) may attend to; None when everything is visible, ``CAUSAL``
        for a plain causal block with nothing cached (a prompt), which SDPA computes faster without a mask."""
        key = (index, window, groups)
        if key not in self._masks:
            self._masks[key] = self._build_mask(self.sequences[index], window, groups)
        return self._masks[key]

    @staticmethod
    def _build_mask(seq: _Sequence, window: int | None, groups: int) -> torch.Tensor | str | None:
        n = len(seq.positions)
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


class _RaggedCacheView:
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
    heads, kv_heads, dim = query.shape[1], key.shape[1], query.shape[3]
    groups = heads // kv_heads
    outputs = []
    for index, seq in enumerate(ragged.sequences):
        n = seq.rows.stop - seq.rows.start
        end = seq.past + n
        keys, values = key[seq.slot : seq.slot + 1, :, :end], value[seq.slot : seq.slot + 1, :, :end]
        mask = ragged.mask(index, sliding_window, groups)
        if mask is CAUSAL:
            out = nn.functional.scaled_dot_product_attention(
                query[:, :, seq.rows], keys, values, is_causal=True, scale=scaling, enable_gqa=groups > 1
            )
        else:
            q = query[:, :, seq.rows].reshape(1, kv_heads, groups * n, dim)
            out = nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scaling)
        outputs.append(out.view(1, heads, n, dim))
    out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)
    return out.transpose(1, 2), None


AttentionInterface.register(ATTENTION, ragged_attention)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)  # transformers' own paths build standard SDPA masks


def _config_max_context(config) -> int:
    for attr in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return 2048


def _eos_ids(model: PreTrainedModel) -> tuple[int, ...]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


class HFCausalLM(CausalLM, LayerwiseExecution):
    def __init__(self, model: PreTrainedModel, name: str) -> None:
        self.model = model.eval()
        self.name = name
        config = model.get_text_config() if hasattr(model, "get_text_config") else model.config
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.max_context = _config_max_context(config)
        self.num_layers = int(config.num_hidden_layers)
        self.hidden_size = int(config.hidden_size)
        self.eos_token_ids = _eos_ids(model)
        first = next(model.parameters())
        self.dtype = first.dtype
        self.device = first.device
        self.config = config
        for each in {id(model.config): model.config, id(config): config}.values():
            each._attn_implementation = ATTENTION

    def new_pool(self) -> SlotPool:
        return SlotPool(self.device)

    def forward_batch(self, inputs: list[SequenceInput]) -> list[ForwardOutput]:
        return self._run(inputs)

    @torch.inference_mode()
    def forward_layers(
        self,
        tokens: torch.Tensor,
        cache: KVCache,
        *,
        skip_layers: frozenset[int] = frozenset(),
        exit_layer: int | None = None,
        output_hidden: bool = False,
        logits_rows: torch.Tensor | slice | None = None,
    ) -> ForwardOutput:
        skipped = self._skipped_layers(skip_layers, exit_layer)
        # With layers skipped or an exit given, ``hidden`` is the residual stream before the final norm.
        capture = output_hidden and (bool(skipped) or exit_layer is not None)
        residual: list[torch.Tensor] = []
        with self._capture_residual(residual, capture), self._executing_only(skipped):
            out = self._run([SequenceInput(tokens, cache, logits_rows=logits_rows)], output_hidden and not capture)[0]
        if capture:
            out.hidden = residual[0][0]
        return out

    @torch.inference_mode()
    def _run(self, inputs: list[SequenceInput], output_hidden: bool = False) -> list[ForwardOutput]:
        pools = {id(item.cache.pool) for item in inputs if isinstance(item.cache, SlotCache)}
        if len(pools) != 1 or not all(isinstance(item.cache, SlotCache) for item in inputs):
            raise ValueError("a batched forward needs the caches of one pool of this backend")
        pool: SlotPool = inputs[0].cache.pool
        device = self.device
        sequences, tokens, positions, logit_rows = [], [], [], []
        start = 0
        for item in inputs:
            n = int(item.tokens.shape[0])
            past = item.cache.length
            pos = (
                item.positions.to(device) if item.positions is not None else torch.arange(past, past + n, device=device)
            )
            sequences.append(_Sequence(item.cache.slot, slice(start, start + n), past, pos, item.tree_mask))
            tokens.append(item.tokens.to(device))
            positions.append(pos)
            wanted = torch.arange(n, device=device)
            logit_rows.append(wanted[item.logits_rows] if item.logits_rows is not None else wanted)
            start += n
        pool.reserve(pool.slots, max(s.past + s.rows.stop - s.rows.start for s in sequences))
        batch = RaggedBatch(sequences)
        every_row = all(item.logits_rows is None for item in inputs)
        rows = 0 if every_row else torch.cat([r + s.rows.start for r, s in zip(logit_rows, sequences)])
        out = self.model(
            input_ids=torch.cat(tokens).view(1, -1),
            position_ids=torch.cat(positions).view(1, -1),
            cache_position=torch.arange(start, device=device),
            attention_mask=_NO_MASK,
            past_key_values=_RaggedCacheView(pool, batch),
            use_cache=True,
            logits_to_keep=rows,
            output_hidden_states=output_hidden,
            ragged=batch,
        )
        for item, seq in zip(inputs, sequences):
            pool.lengths[item.cache.slot] = seq.past + seq.rows.stop - seq.rows.start
        logits = out.logits[0].float()
        hidden = out.hidden_states[-1][0] if output_hidden else None
        outputs, offset = [], 0
        for seq, wanted in zip(sequences, logit_rows):
            count = len(wanted)
            outputs.append(
                ForwardOutput(
                    logits=logits[offset : offset + count], hidden=hidden[seq.rows] if hidden is not None else None
                )
            )
            offset += count
        return outputs

    # -- the output stage ----------------------------------------------------------------------------
    def exit_logits(
        self, hidden: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor] | None = None
    ) -> torch.Tensor:
        """Not under ``inference_mode``, so adapters can be trained through it."""
        return self.head_logits(self._decoder().norm(hidden), head)

    def head_logits(
        self, normed: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor] | None = None
    ) -> torch.Tensor:
        """The output stage after the final norm: LM head (or ``head``) and final logit softcapping."""
        logits = (head or self.lm_head())(normed)
        softcap = getattr(self.config, "final_logit_softcapping", None)
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        return logits.float()

    def lm_head(self) -> nn.Module:
        return self.model.get_output_embeddings()

    def output_weight(self) -> torch.Tensor:
        weight = self.lm_head().weight.detach()
        return weight.to_dense() if weight.is_mkldnn else weight

    def head_fraction(self) -> float:
        head = self.lm_head().weight.numel()
        # Buffers too: the CPU fast path keeps prepacked weights as buffers, not parameters.
        stack = self._decoder().layers
        layers = sum(t.numel() for t in (*stack.parameters(), *stack.buffers()))
        return head / (head + layers)

    # -- self-speculation --------------------------------------------------------------------------
    def _decoder(self) -> nn.Module:
        decoder = getattr(self.model, "model", None)
        layers = getattr(decoder, "layers", None)
        if not isinstance(layers, nn.ModuleList) or len(layers) != self.num_layers or not hasattr(decoder, "norm"):
            raise NotImplementedError(
                f"{type(self.model).__name__} keeps no model.layers / model.norm: cannot skip or exit layers"
            )
        return decoder

    def _skipped_layers(self, skip_layers: frozenset[int], exit_layer: int | None) -> frozenset[int]:
        if exit_layer is not None and not 1 <= exit_layer <= self.num_layers:
            raise ValueError(f"exit_layer must be in 1..{self.num_layers}, got {exit_layer}")
        if any(not 0 <= i < self.num_layers for i in skip_layers):
            raise ValueError(f"skip_layers must be in 0..{self.num_layers - 1}, got {sorted(skip_layers)}")
        tail = range(exit_layer, self.num_layers) if exit_layer is not None else ()
        return frozenset(skip_layers).union(tail)

    @contextmanager
    def _executing_only(self, skipped: frozenset[int]) -> Iterator[None]:
        """Swap the decoder's layer list for the executed layers for the duration of one call (the modules,
        their names, hooks and ``layer_idx`` stay what they are)."""
        if not skipped:
            yield
            return
        decoder = self._decoder()
        layers = decoder.layers
        decoder.layers = nn.ModuleList([layer for i, layer in enumerate(layers) if i not in skipped])
        try:
            yield
        finally:
            decoder.layers = layers

    @contextmanager
    def _capture_residual(self, sink: list[torch.Tensor], active: bool) -> Iterator[None]:
        """Record the residual stream entering the final norm (= the exit layer's output on an exit)."""
        if not active:
            yield
            return
        hook = self._decoder().norm.register_forward_pre_hook(lambda m, args: sink.append(args[0]))
        try:
            yield
        finally:
            hook.remove()


#: A 4D placeholder: transformers returns a 4D attention mask as it is instead of building one (the ragged
#: attention builds its own per sequence).
_NO_MASK = torch.empty(1, 1, 0, 0)
