"""Generic backend: any Hugging Face ``AutoModelForCausalLM`` whose attention goes through transformers'
attention interface (Llama/SmolLM2, Qwen2, Gemma3, Mistral, Phi3, ...), batched the way vLLM does it.

A batched forward is one call of the model's own forward over the flattened tokens of every sequence,
with their own positions; attention is per sequence, over that sequence's slot of the cache pool
(:mod:`specdecode.models.ragged`), so linear layers never see padding and no sequence sees another.

**Self-speculation** (``skip_layers`` / ``exit_layer``, :class:`LayerwiseExecution`) runs the model's own
forward over only the executed decoder layers (``model.model.layers`` is swapped for them for that one
call; modules keep their ``layer_idx``).  Exiting at layer L is running layers 0..L-1 only; a skipped layer
writes nothing into the cache.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from functools import cached_property

import torch
from torch import nn
from transformers import PreTrainedModel

from specdecode.models.attention_kernel import FEW_ROWS, chunk_kernel_fits
from specdecode.models.base import (
    CausalLM,
    DecoderShape,
    ForwardOutput,
    HiddenStates,
    KVCache,
    LayerwiseExecution,
    SequenceInput,
)
from specdecode.models.draft_step import DraftStep, build_draft_step
from specdecode.models.fastpath import PackedLinear
from specdecode.models.greedy_head import GreedyHead, greedy_head_applies
from specdecode.models.layer_forward import every_layer_written_out
from specdecode.models.quantized_layers import QuantizedLinear, free_row_spans
from specdecode.models.ragged import ATTENTION, RaggedBatch, RaggedCacheView, SequenceSlice, SlotCache, SlotPool
from specdecode.models.target_step import TargetStep, takes_target_step
from specdecode.threads import GOVERNOR


def shared_weights_copy(model: nn.Module) -> nn.Module:
    """A new module tree for ``model`` whose tensors are the originals' (parameters as new, frozen Parameter objects
    on the same storage, buffers shared): replacing or training its modules never changes the original.  A plain
    ``deepcopy`` would copy every weight, and cannot copy oneDNN-packed ones at all."""
    memo: dict[int, object] = {id(p): nn.Parameter(p.detach(), requires_grad=False) for p in model.parameters()}
    memo.update((id(buffer), buffer) for buffer in model.buffers())
    return copy.deepcopy(model, memo)


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


class HFCausalLM(CausalLM, LayerwiseExecution, HiddenStates):
    def __init__(self, model: PreTrainedModel, name: str) -> None:
        self.model = model.eval()
        self.name = name
        config = model.get_text_config() if hasattr(model, "get_text_config") else model.config
        head = model.get_output_embeddings()
        # out_features where the layer has it: a quantized head's ``weight`` dequantizes the whole matrix
        # (seconds for a 152k-row vocabulary on a CPU) just to be measured.
        self.vocab_size = int(getattr(head, "out_features", None) or head.weight.shape[0])
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
        # Quantized layers are batch invariant and round their input to bf16: attention must be invariant
        # too, or a verification forward breaks bf16-step near-ties unlike plain decoding (RaggedBatch).
        self.row_invariant_attention = any(isinstance(m, QuantizedLinear) for m in model.modules())
        self._greedy: tuple[nn.Module, GreedyHead | None] | None = None

    def new_pool(self) -> SlotPool:
        return SlotPool(self.device)

    def rows_read_alone(self) -> int | None:
        """Where every decoder layer is written out (:mod:`specdecode.models.layer_forward`: panel products and kernels
        that compute a row on its own) and a prompt chunk of more than ``FEW_ROWS`` tokens attends in the chunk kernel,
        whose rows depend on their query and the keys and values they see only: chunks of that many tokens.  (Fewer
        attend in the ragged kernel, which adds in another order.)"""
        written_out = every_layer_written_out(self.model)  # a Llama- or Qwen2-shaped decoder: decoder_shape() holds
        if written_out and chunk_kernel_fits(self.device, self.dtype, self.decoder_shape().head_dim):
            return FEW_ROWS + 1
        return None

    def draft_logits(
        self,
        tokens: torch.Tensor,
        cache: KVCache,
        head: Callable[[torch.Tensor], torch.Tensor] | None = None,
        first_row: int = -1,
    ) -> torch.Tensor:
        """One token through the written-out step (:mod:`specdecode.models.draft_step`) where it takes this
        model; several (a draft catching up with the context) through the modules.  ``head``: VocabTrim's rows
        in place of the LM head, on either route (while a trimmed head sent one-token drafts through the
        modules, VocabTrim cost more than it saved)."""
        if len(tokens) == 1 and self._draft_step is not None and isinstance(cache, SlotCache):
            GOVERNOR.before_forward()
            logits = self._draft_step(int(tokens[0]), cache, head)
            if logits is not None:
                return logits[None]
        if head is None:
            return super().draft_logits(tokens, cache, first_row=first_row)
        final = self.forward(
            tokens, cache, logits_rows=tokens.new_empty(0), hidden_layers=(self.num_layers,), invariant=False
        ).hidden[first_row:]
        return self.head_logits(final, head)

    def prepare_drafting(self) -> None:
        self._draft_step  # noqa: B018 - building it is the point

    @cached_property
    def _draft_step(self) -> DraftStep | None:
        """Built on the first draft, or by :meth:`prepare_drafting` (it fuses projections): a target never
        drafting never pays for it."""
        return build_draft_step(self.model, self.config)

    @cached_property
    def _target_step(self) -> TargetStep | None:
        """Built on the first forward it could take: the written-out step for w4a8 models whose modules' forward
        it reproduces bitwise (:mod:`specdecode.models.target_step`)."""
        if not self.row_invariant_attention or self._draft_step is None or not takes_target_step(self._draft_step):
            return None
        return TargetStep(self.model, self._draft_step)

    def forward_batch(self, inputs: list[SequenceInput]) -> list[ForwardOutput]:
        if len(inputs) == 1:
            item = inputs[0]
            plain = not item.hidden_layers  # a chain or a tree, nothing captured
            if plain and item.invariant and isinstance(item.cache, SlotCache) and self._target_step is not None:
                GOVERNOR.before_forward()
                rows = _logit_rows(item, self.device)
                logits = self._target_step(item.tokens, item.cache, rows, item.positions, item.tree_mask)
                if logits is not None:
                    return [ForwardOutput(logits=logits)]
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
        final = (self.num_layers,) if output_hidden and not capture else ()
        with self._capture_residual(residual, capture), self._executing_only(skipped):
            out = self._run([SequenceInput(tokens, cache, logits_rows=logits_rows, hidden_layers=final)])[0]
        if capture:
            out.hidden = residual[0][0]
        return out

    def decoder_shape(self) -> DecoderShape:
        config = self.config
        heads = int(config.num_attention_heads)
        return DecoderShape(
            hidden_size=self.hidden_size,
            num_heads=heads,
            num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(config, "head_dim", None) or self.hidden_size // heads),
            intermediate_size=int(config.intermediate_size),
            rms_norm_eps=float(getattr(config, "rms_norm_eps", 1e-6)),
            rope_theta=float(getattr(config, "rope_theta", 10000.0)),
        )

    @torch.inference_mode()
    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._decoder().norm(hidden.to(self.device))

    @torch.inference_mode()
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model.get_input_embeddings()(tokens.to(self.device))

    @torch.inference_mode()
    def _run(self, inputs: list[SequenceInput]) -> list[ForwardOutput]:
        GOVERNOR.before_forward()  # as many threads as the CPUs other processes leave us (specdecode.threads)
        pools = {id(item.cache.pool) for item in inputs if isinstance(item.cache, SlotCache)}
        if len(pools) != 1 or not all(isinstance(item.cache, SlotCache) for item in inputs):
            raise ValueError("a batched forward needs the caches of one pool of this backend")
        pool: SlotPool = inputs[0].cache.pool
        device = self.device
        sequences, tokens, positions, logit_rows = [], [], [], []
        greedy_head = self._greedy_head() if any(item.choices_only for item in inputs) else None
        chooses = [greedy_head is not None and item.choices_only for item in inputs]
        start = 0
        for item in inputs:
            n = int(item.tokens.shape[0])
            past = item.cache.length
            pos = (
                item.positions.to(device) if item.positions is not None else torch.arange(past, past + n, device=device)
            )
            sequences.append(
                SequenceSlice(item.cache.slot, slice(start, start + n), past, pos, item.tree_mask, item.invariant)
            )
            tokens.append(item.tokens.to(device))
            positions.append(pos)
            logit_rows.append(_logit_rows(item, device))
            start += n
        pool.reserve(pool.slots, max(seq.end for seq in sequences))
        batch = RaggedBatch(sequences, row_invariant=self.row_invariant_attention)
        every_row = not any(chooses) and all(item.logits_rows is None for item in inputs)
        head_rows = [_NO_ROWS if choose else rows for rows, choose in zip(logit_rows, chooses)]
        rows = 0 if every_row else torch.cat([r + s.rows.start for r, s in zip(head_rows, sequences)])
        captured: dict[int, torch.Tensor] = {}
        layers = {i for item in inputs for i in item.hidden_layers} | ({self.num_layers} if any(chooses) else set())
        # Rows that need no invariance (a prompt's chunks, read alike alone or in a batch; drafts) take the fast
        # kernels, each sequence's in calls of its own, so that they never depend on what shares the forward.
        free = [(seq.rows.start, seq.rows.stop) for seq in sequences if not seq.invariant]
        with (
            self._capture_layers(layers, captured),
            free_row_spans(start, free) if free else nullcontext(),
        ):
            out = self.model(
                input_ids=torch.cat(tokens).view(1, -1),
                position_ids=torch.cat(positions).view(1, -1),
                cache_position=torch.arange(start, device=device),
                attention_mask=_NO_MASK,
                past_key_values=RaggedCacheView(pool, batch),
                use_cache=True,
                logits_to_keep=rows,
                ragged=batch,
            )
        for item, seq in zip(inputs, sequences):
            pool.lengths[item.cache.slot] = seq.end
        logits = out.logits[0].float()
        choices = None
        if any(chooses):  # one call for every sequence's rows: each call reads the whole head
            chosen = [rows + seq.rows.start for rows, seq, choose in zip(logit_rows, sequences, chooses) if choose]
            choices = greedy_head(captured[self.num_layers][0, torch.cat(chosen)])
        outputs, offset, chosen_offset = [], 0, 0
        for item, seq, wanted, choose in zip(inputs, sequences, logit_rows, chooses):
            hidden = None
            if item.hidden_layers:
                hidden = torch.cat([captured[i][0, seq.rows] for i in item.hidden_layers], dim=-1)
            count = len(wanted)
            if choose:
                mine = choices[chosen_offset : chosen_offset + count]
                outputs.append(ForwardOutput(logits=logits[:0], hidden=hidden, choices=mine))
                chosen_offset += count
                continue
            outputs.append(ForwardOutput(logits=logits[offset : offset + count], hidden=hidden))
            offset += count
        return outputs

    def _greedy_head(self) -> GreedyHead | None:
        """The LM head's greedy choices without its logits (:mod:`specdecode.models.greedy_head`), where the head is
        an fp32 panel product this CPU can screen in bf16 and the model's logits are the head's output itself; built
        on first use, again if the head is replaced."""
        head = self.lm_head()
        if self._greedy is None or self._greedy[0] is not head:
            greedy = None
            if greedy_head_applies(self.model):
                greedy = GreedyHead(head.packed)
            self._greedy = (head, greedy)
        return self._greedy[1]

    @contextmanager
    def _capture_layers(self, layers: set[int], sink: dict[int, torch.Tensor]) -> Iterator[None]:
        """Record hidden states during one forward (numbering as in :class:`HiddenStates`): the input of
        decoder layer i, or for ``num_layers`` the final norm's output.  Hooks see the whole flattened batch, and
        only this thread's calls (a drafter may run the same modules in a thread of its own meanwhile)."""
        if not layers:
            yield
            return
        if any(not 0 <= i <= self.num_layers for i in layers):
            raise ValueError(f"hidden layers must be in 0..{self.num_layers}, got {sorted(layers)}")
        decoder = self._decoder()
        owner = threading.get_ident()

        def entering(index: int):
            def hook(module, args, kwargs):
                if threading.get_ident() == owner:
                    sink[index] = args[0] if args else kwargs["hidden_states"]

            return hook

        def final(module, args, output):
            if threading.get_ident() == owner:
                sink[self.num_layers] = output

        hooks = [
            decoder.layers[i].register_forward_pre_hook(entering(i), with_kwargs=True)
            for i in layers
            if i < self.num_layers
        ]
        if self.num_layers in layers:
            hooks.append(decoder.norm.register_forward_hook(final))
        try:
            yield
        finally:
            for hook in hooks:
                hook.remove()

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
        head = self.lm_head()
        return head.dense_weight() if isinstance(head, PackedLinear) else head.weight.detach()

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


def _logit_rows(item: SequenceInput, device: torch.device) -> torch.Tensor:
    """The indices, among ``item``'s new tokens, of the rows whose logits it asks for."""
    every = torch.arange(int(item.tokens.shape[0]), device=device)
    return every[item.logits_rows] if item.logits_rows is not None else every


#: A 4D placeholder: transformers returns a 4D attention mask as it is instead of building one (the ragged
#: attention builds its own per sequence).
_NO_MASK = torch.empty(1, 1, 0, 0)
_NO_ROWS = torch.empty(0, dtype=torch.long)
