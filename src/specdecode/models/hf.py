"""Generic backend: any Hugging Face ``AutoModelForCausalLM``, with a croppable ``DynamicCache``.

This is the path every model takes unless a faster architecture-specific backend claims it.

Self-speculation (``skip_layers`` / ``exit_layer``) runs the model's own forward — embedding scaling,
rotary tables, sliding-window masks, final norm, LM head and logit softcapping stay the model's — over
only the decoder layers that execute (``model.model.layers``, as in Llama/SmolLM2, Qwen2, Gemma3,
Mistral, Phi3, is swapped for the list of executed layers for that one call).  Exiting at layer L is
running layers 0..L-1 only; a skipped layer costs nothing, not even a Python call.

How the KV cache stays exact: every layer keeps its own slot in the ``DynamicCache`` (attention modules
keep their ``layer_idx``), and a skipped layer simply writes nothing, so its slot is *shorter* than
those of the layers that ran. The attention mask is built from layer 0's length (layer 0 always runs:
an exit is at least 1 and the layer-skip search never skips it), so a layer may only run when its slot
holds every earlier position: whoever mixes layer subsets on one cache must crop first. The
self-speculative drafters append their draft positions to the target's verification cache with layers
skipped and crop them away again before verification (:mod:`specdecode.drafters._self_draft`), so every
position the verification reads was written by the full model. Executed layers write their true
keys/values for the hidden states they received; for an early exit these equal the full model's
exactly, since layers below L depend only on layers below L.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn
from transformers import DynamicCache, PreTrainedModel

from specdecode.models.base import CausalLM, ForwardOutput, KVCache


class HFCache(KVCache):
    def __init__(self) -> None:
        self.inner = DynamicCache()

    @property
    def length(self) -> int:
        return int(self.inner.get_seq_length())

    def crop(self, length: int) -> None:
        if length < self.length:
            self.inner.crop(length)

    def _gather(self, start: int, offsets: list[int]) -> None:
        index = torch.tensor(offsets, dtype=torch.long) + start
        for layer in self.inner.layers:
            layer.keys = torch.cat([layer.keys[..., :start, :], layer.keys.index_select(-2, index)], dim=-2)
            layer.values = torch.cat([layer.values[..., :start, :], layer.values.index_select(-2, index)], dim=-2)


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


class HFCausalLM(CausalLM):
    def __init__(self, model: PreTrainedModel, name: str) -> None:
        self.model = model.eval()
        self.name = name
        config = model.get_text_config() if hasattr(model, "get_text_config") else model.config
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.max_context = _config_max_context(config)
        self.num_layers = int(config.num_hidden_layers)
        self.eos_token_ids = _eos_ids(model)
        self.dtype = next(model.parameters()).dtype
        self.config = config

    def new_cache(self) -> HFCache:
        return HFCache()

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        cache: KVCache,
        *,
        positions: torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
        logits_rows: torch.Tensor | slice | None = None,
        output_hidden: bool = False,
        skip_layers: frozenset[int] = frozenset(),
        exit_layer: int | None = None,
    ) -> ForwardOutput:
        assert isinstance(cache, HFCache)
        n = int(tokens.shape[0])
        past = cache.length
        slots = torch.arange(past, past + n)
        if positions is None:
            positions = slots
        attention_mask = None
        if tree_mask is not None:
            attention_mask = self._tree_attention_mask(tree_mask, past)
        if logits_rows is None:
            keep: int | torch.Tensor = 0  # transformers: 0 means every row
        elif isinstance(logits_rows, slice):
            keep = torch.arange(n)[logits_rows]
        else:
            keep = logits_rows
        skipped = self._skipped_layers(skip_layers, exit_layer)
        # With layers skipped or an exit given, ``hidden`` is the residual stream before the final norm.
        capture = output_hidden and (bool(skipped) or exit_layer is not None)
        residual: list[torch.Tensor] = []
        with self._capture_residual(residual, capture), self._executing_only(skipped):
            out = self.model(
                input_ids=tokens.view(1, n),
                position_ids=positions.view(1, n),
                cache_position=slots,
                attention_mask=attention_mask,
                past_key_values=cache.inner,
                use_cache=True,
                logits_to_keep=keep,
                output_hidden_states=output_hidden and not capture,
            )
        hidden = None
        if output_hidden:
            hidden = residual[0][0] if capture else out.hidden_states[-1][0]
        return ForwardOutput(logits=out.logits[0].float(), hidden=hidden)

    def exit_logits(
        self, hidden: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor] | None = None
    ) -> torch.Tensor:
        """The model's own output stage — final norm, LM head, final logit softcapping (Gemma) — applied to
        [n, d] residual-stream states, e.g. an early exit's ``hidden`` after a trained adapter.  ``head``
        replaces the LM head (e.g. a restricted-vocabulary head for cheap drafts).  Not under
        ``inference_mode``, so adapters can be trained through it."""
        return self.head_logits(self._decoder().norm(hidden), head)

    def head_logits(
        self, normed: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor] | None = None
    ) -> torch.Tensor:
        """The output stage after the final norm: LM head (or ``head``) and final logit softcapping."""
        logits = (head or self.model.get_output_embeddings())(normed)
        softcap = getattr(self.config, "final_logit_softcapping", None)
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        return logits.float()

    def output_weight(self) -> torch.Tensor:
        """The LM head's [vocab, d] weight as a dense tensor (the CPU fast path may hold it prepacked)."""
        head = self.model.get_output_embeddings()
        weight = head.weight.detach()
        return weight.to_dense() if weight.is_mkldnn else weight

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
        if any(not 1 <= i < self.num_layers for i in skip_layers):
            # Layer 0 always runs: the cache length and the attention mask are read from its slot.
            raise ValueError(f"skip_layers must be in 1..{self.num_layers - 1}, got {sorted(skip_layers)}")
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

    def _tree_attention_mask(self, tree_mask: torch.Tensor, past: int) -> torch.Tensor:
        """[n, n] bool among new tokens → [1, 1, n, past + n] additive mask (0 = attend)."""
        n = tree_mask.shape[0]
        allowed = torch.cat([torch.ones(n, past, dtype=torch.bool), tree_mask.bool()], dim=1)
        mask = torch.zeros(n, past + n, dtype=self.dtype)
        mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)
        return mask.view(1, 1, n, past + n)
