"""Generic backend: any Hugging Face ``AutoModelForCausalLM``, with a croppable ``DynamicCache``.

This is the path every model takes unless a faster architecture-specific backend claims it.
"""

from __future__ import annotations

import torch
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
        if skip_layers or exit_layer is not None:
            raise NotImplementedError("the generic transformers backend cannot skip or exit layers")
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
        out = self.model(
            input_ids=tokens.view(1, n),
            position_ids=positions.view(1, n),
            cache_position=slots,
            attention_mask=attention_mask,
            past_key_values=cache.inner,
            use_cache=True,
            logits_to_keep=keep,
            output_hidden_states=output_hidden,
        )
        hidden = out.hidden_states[-1][0] if output_hidden else None
        return ForwardOutput(logits=out.logits[0].float(), hidden=hidden)

    def _tree_attention_mask(self, tree_mask: torch.Tensor, past: int) -> torch.Tensor:
        """[n, n] bool among new tokens → [1, 1, n, past + n] additive mask (0 = attend)."""
        n = tree_mask.shape[0]
        allowed = torch.cat([torch.ones(n, past, dtype=torch.bool), tree_mask.bool()], dim=1)
        mask = torch.zeros(n, past + n, dtype=self.dtype)
        mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)
        return mask.view(1, 1, n, past + n)
