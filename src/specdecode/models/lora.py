"""Module surgery for LoRA on a transformers backend (what ``draft-model adapt=true`` trains): a copy of a loaded
model that shares its weights, and the linear layers of its last decoder layers made adaptable.  Kept with
the backends so that drafters never import the transformers backend themselves."""

from __future__ import annotations

from torch import nn

from specdecode.errors import SpecDecodeError
from specdecode.models.fastpath import PackedLinear
from specdecode.models.hf import HFCausalLM, shared_weights_copy
from specdecode.models.loading import LoadedModel
from specdecode.models.quantized_layers import QuantizedLinear


def shared_copy(loaded: LoadedModel) -> LoadedModel:
    """A copy of ``loaded`` whose tensors are the originals' (:func:`~specdecode.models.hf.shared_weights_copy`):
    adapting it never changes the original."""
    twin = shared_weights_copy(loaded.backend.model)
    return LoadedModel(loaded.name, HFCausalLM(twin, loaded.name), loaded.tokenizer, quantize=loaded.quantize)


def lora_targets(model: nn.Module, num_layers: int, last: int) -> list[str]:
    """The linear layers of the ``last`` decoder layers (of ``num_layers``), each made a plain fp32 ``nn.Linear``
    (peft's LoRA wraps those), and a quantized LM head made one too."""
    first = max(0, num_layers - last)
    names = []
    for name, module in list(model.named_modules()):
        parts = name.split(".")
        if "layers" not in parts or parts.index("layers") + 1 >= len(parts) - 1:
            continue
        index = parts[parts.index("layers") + 1]
        if not index.isdigit() or int(index) < first:
            continue
        if isinstance(module, (PackedLinear, QuantizedLinear)):
            model.set_submodule(name, module.to_linear())
        elif type(module) is not nn.Linear:
            continue
        model.get_submodule(name).weight.requires_grad_(False)
        names.append(name)
    if not names:
        raise SpecDecodeError(f"adapt found no linear layer to adapt in {type(model).__name__}")
    head = model.get_output_embeddings()
    if isinstance(head, QuantizedLinear):  # the gradient flows back through it, and its kernel has none
        model.set_output_embeddings(head.to_linear())
        model.get_output_embeddings().weight.requires_grad_(False)
    # The layers below the adapted ones keep their quantized kernels: nothing below them trains.
    return names
