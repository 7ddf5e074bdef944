"""Module surgery for LoRA on a transformers backend (what ``draft-model adapt=true`` trains): a copy of a loaded
model that shares its weights, and the linear layers of its last decoder layers made adaptable.  Kept with
the backends so that drafters never import the transformers backend themselves."""

from __future__ import annotations

import copy
from typing import Any

from torch import nn

from specdecode.errors import SpecDecodeError
from specdecode.models.fastpath import PackedLinear
from specdecode.models.hf import HFCausalLM
from specdecode.models.loading import LoadedModel
from specdecode.models.quantized_layers import QuantizedLinear


def shared_copy(loaded: LoadedModel) -> LoadedModel:
    """A new module tree for ``loaded``'s model whose tensors are the originals' (parameters as new,
    frozen Parameter objects on the same storage): adapting it never changes the original.  A plain
    ``deepcopy`` would copy every weight, and cannot copy oneDNN-packed ones at all."""
    model = loaded.backend.model
    memo: dict[int, Any] = {}
    for tensor in model.parameters(recurse=True):
        memo[id(tensor)] = nn.Parameter(tensor.detach(), requires_grad=False)
    for tensor in model.buffers(recurse=True):
        memo[id(tensor)] = tensor
    twin = copy.deepcopy(model, memo)
    return LoadedModel(name=loaded.name, backend=HFCausalLM(twin, loaded.name), tokenizer=loaded.tokenizer)


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
