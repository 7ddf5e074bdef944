"""Generic backend: any Hugging Face ``AutoModelForCausalLM``, with a croppable ``DynamicCache``.

This is the path every model takes unless a faster architecture-specific backend claims it.

Self-speculation (``skip_layers`` / ``exit_layer``) runs the model's own forward — embedding scaling,
rotary tables, sliding-window masks, final norm, LM head and logit softcapping stay the model's — with
the chosen decoder layers (``model.model.layers``, as in Llama/SmolLM2, Qwen2, Gemma3, Mistral, Phi3)
turned into pass-throughs for that one call.  Exiting at layer L is skipping layers L..N-1.

How the KV cache stays exact: a ``DynamicCache`` builds the attention mask from one sequence length,
so every layer must hold the same number of positions.  A skipped layer therefore appends zero
*placeholder* keys/values for its new positions.  They are never read by the call that wrote them (the
layer does not run), and a layer that runs later would read them, so whoever mixes layer subsets on one
cache must crop them first: the self-speculative drafters keep their own cache and recompute any
position whose entries were written under an incompatible layer subset
(:mod:`specdecode.drafters._self_draft`), while the target's verification cache never sees a skipped
layer.  Non-skipped layers write their true keys/values for the hidden states they received; for an
early exit these equal the full model's exactly, since layers below L depend only on layers below L.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

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
        self._layers_return_tuple: bool | None = None  # probed on first use of skip_layers / exit_layer

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
        exit_hidden: list[torch.Tensor] = []
        with self._bypassed(skipped), self._capture_exit(exit_hidden, exit_layer is not None and output_hidden):
            out = self.model(
                input_ids=tokens.view(1, n),
                position_ids=positions.view(1, n),
                cache_position=slots,
                attention_mask=attention_mask,
                past_key_values=cache.inner,
                use_cache=True,
                logits_to_keep=keep,
                output_hidden_states=output_hidden and exit_layer is None,
            )
        hidden = None
        if output_hidden:
            hidden = exit_hidden[0][0] if exit_layer is not None else out.hidden_states[-1][0]
        return ForwardOutput(logits=out.logits[0].float(), hidden=hidden)

    def exit_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's own output stage — final norm, LM head, final logit softcapping (Gemma) — applied to
        [n, d] residual-stream states, e.g. an early exit's ``hidden`` after a trained adapter.  Not under
        ``inference_mode``, so adapters can be trained through it."""
        logits = self.model.get_output_embeddings()(self._decoder().norm(hidden))
        softcap = getattr(self.config, "final_logit_softcapping", None)
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        return logits.float()

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
    def _bypassed(self, skipped: frozenset[int]) -> Iterator[None]:
        """Shadow ``forward`` of the skipped layer instances for the duration of one call (the modules,
        their names and hooks stay where they are)."""
        if not skipped:
            yield
            return
        layers = self._decoder().layers
        as_tuple = self._probe_layer_output()
        for i in skipped:
            layers[i].forward = partial(self._bypass, layers[i], as_tuple)
        try:
            yield
        finally:
            for i in skipped:
                del layers[i].forward

    def _bypass(self, layer: nn.Module, as_tuple: bool, hidden_states: torch.Tensor, *args, **kwargs):
        """A skipped layer: hidden states pass through; its cache gets placeholders so lengths agree."""
        cache = kwargs.get("past_key_values")
        if cache is not None:
            attn = layer.self_attn
            kv_heads = getattr(self.config, "num_key_value_heads", None) or self.config.num_attention_heads
            batch, n = hidden_states.shape[:2]
            placeholder = hidden_states.new_zeros(batch, kv_heads, n, attn.head_dim)
            cache.update(placeholder, placeholder, attn.layer_idx)
        return (hidden_states,) if as_tuple else hidden_states

    def _probe_layer_output(self) -> bool:
        """Decoder layers return a tensor (Llama, Qwen2) or a tuple (Gemma3): one real 1-token call tells."""
        if self._layers_return_tuple is None:
            seen: list[bool] = []
            first = self._decoder().layers[0]
            hook = first.register_forward_hook(lambda module, args, out: seen.append(isinstance(out, tuple)))
            try:
                with torch.inference_mode():
                    one = torch.zeros(1, 1, dtype=torch.long)
                    self.model(input_ids=one, past_key_values=DynamicCache(), use_cache=True, logits_to_keep=1)
            finally:
                hook.remove()
            self._layers_return_tuple = seen[0]
        return self._layers_return_tuple

    @contextmanager
    def _capture_exit(self, sink: list[torch.Tensor], active: bool) -> Iterator[None]:
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
