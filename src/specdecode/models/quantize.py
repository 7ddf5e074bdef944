"""Weight-only quantization of a loaded model's linear layers on the CPU (``--quantize``): which modes exist,
which layers take them, and the draft models' default.  The layers themselves are in
:mod:`specdecode.models.quantized_layers` (``int8``, ``int4``, ``bf16``) and :mod:`specdecode.models.w4a8`.

Why: decoding one token on a CPU reads every weight once, so a forward costs about its weight bytes over
the memory bandwidth.  fp32 weights are 4 bytes each; int8 weights 1 byte (plus one scale per output
channel) and int4 half a byte (plus a scale and a zero per group of ``in_features``).

Lossless: quantization changes the model, not the decoding.  :func:`quantize_model` replaces the layers
once at load time, so plain decoding and speculative verification run the same quantized weights through
the same kernels; greedy speculative output equals plain greedy output *of the quantized model* (tested),
not of the fp32 one.  Every layer gives a row bitwise what it gives that row alone, which is what makes it
hold (see :mod:`specdecode.models.quantized_layers`).

Every decoder ``nn.Linear`` is quantized, and the LM head too (it is 15-21% of the weight bytes of the
registered models).  A head tied to the input embedding keeps the embedding in fp32 for the look-up and
gets a quantized copy for the matmul.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from specdecode.errors import SpecDecodeError
from specdecode.models import w4a8
from specdecode.models.quantized_layers import (
    Bf16Linear,
    Int4Linear,
    Int8Linear,
    QuantizedLinear,
    bf16_matmul_supported,
    weight_only_kernels_present,
)

#: The weight formats (a contract: scripts pass them to ``--quantize``).
QUANTIZE_MODES = ("none", "int8", "int4", "bf16", "w4a8")
#: ``--quantize auto``: the format this CPU decodes the model fastest in, timed
#: (:mod:`specdecode.models.auto_quantize`).
AUTO_QUANTIZE = "auto"
#: What ``--quantize`` and ``--quantize-draft`` take.
QUANTIZE_VALUES = (*QUANTIZE_MODES, AUTO_QUANTIZE)
#: int4 group sizes, preferred first: a layer takes the first one that divides its ``in_features``.
INT4_GROUP_SIZES = (64, 32)
#: ``_convert_weight_to_int4pack_for_cpu`` packs output channels in blocks of this many.
INT4_OUT_MULTIPLE = 16
#: ``_weight_int8pack_mm`` reads inputs in blocks of this many: torch 2.13 returned garbage for 8, 24 and 40 inputs
#: and crashed on 100 (the sizes probed), and was right for every multiple of 16 probed.
INT8_IN_MULTIPLE = 16


#: A draft model's weights when ``--quantize-draft`` is not given.  A draft's precision never changes the
#: output, and an int4 draft made speculative decoding faster than an fp32 or bf16 one, for fp32 and bf16 targets
#: alike (``docs/results/fp32-draft-int4-qwen2.5-coder-1.5b`` against ``fp32-draft-fp32-qwen2.5-coder-1.5b``,
#: ``peers-bf16-qwen2.5-coder-1.5b`` against ``bf16-draft-bf16-qwen2.5-coder-1.5b``).
DEFAULT_DRAFT_QUANTIZE = "int4"
#: The same where torch's CPU kernels are AVX2 code or the CPU has VNNI dot products (our ``w4a8`` kernel's
#: ``vpdpbusd`` path): there a draft token takes less time in w4a8 than in int4, for the 135M and the 0.5B draft
#: models alike (``docs/results/avx2``, ``docs/results/w4a8-vnni-epyc/draft_step_timing.txt``).
W4A8_DRAFT_QUANTIZE = "w4a8"


def default_draft_quantization() -> str:
    """:data:`W4A8_DRAFT_QUANTIZE` on a CPU where our kernel beat torch's int4 one (AVX2 code, or VNNI dot
    products) and builds, else :data:`DEFAULT_DRAFT_QUANTIZE` (AVX-512 without VNNI: not measured)."""
    w4a8_wins = torch.backends.cpu.get_cpu_capability() == "AVX2" or w4a8.best_isa() != "avx2"
    if w4a8_wins and quantize_supported(W4A8_DRAFT_QUANTIZE) and w4a8.kernel_builds():
        return W4A8_DRAFT_QUANTIZE
    return DEFAULT_DRAFT_QUANTIZE


def draft_quantization(given: str | None, target: str, *, device: object = None, trains: bool = False) -> str:
    """The draft model's weights: ``given`` (``--quantize-draft``) if any; else fp32 for a draft trained while it
    drafts (``adapt``: LoRA trains fp32 layers), the target's off the CPU (no quantized kernels there), and
    :func:`default_draft_quantization` where this torch has its kernel."""
    if given is not None:
        return check_quantize(given, "--quantize-draft")
    if trains:
        return "none"
    if not str(device or "cpu").startswith("cpu") or not quantize_supported(DEFAULT_DRAFT_QUANTIZE):
        return target
    return default_draft_quantization()


def check_quantize(mode: str, flag: str = "--quantize") -> str:
    """``mode`` if it is one of :data:`QUANTIZE_VALUES`, else a one-line :class:`SpecDecodeError` naming ``flag``."""
    if mode not in QUANTIZE_VALUES:
        raise SpecDecodeError(f"{flag} must be one of {', '.join(QUANTIZE_VALUES)}; got {mode!r}")
    return mode


def quantize_supported(mode: str) -> bool:
    """Whether this torch build (for ``w4a8``: this CPU and a C++ compiler) has the CPU kernel of ``mode``."""
    if mode == "w4a8":
        return w4a8.w4a8_available()
    if mode == "bf16":
        return bf16_matmul_supported()
    return weight_only_kernels_present()


def int4_group_size(linear: nn.Linear) -> int | None:
    """The int4 group size for ``linear``, or None when its shape fits no group (it then stays as it is)."""
    if linear.out_features % INT4_OUT_MULTIPLE:
        return None
    return next((g for g in INT4_GROUP_SIZES if linear.in_features % g == 0), None)


def int8_fits(linear: nn.Linear) -> bool:
    """Whether torch's int8 kernel takes ``linear``'s shape (:data:`INT8_IN_MULTIPLE`)."""
    return linear.in_features % INT8_IN_MULTIPLE == 0


def quantized_like(layer: nn.Module, linear: nn.Linear) -> QuantizedLinear | None:
    """``linear`` in the precision ``layer`` has (a draft head's rows copied from a quantized LM head);
    None when ``layer`` is not quantized or ``linear``'s shape does not fit it."""
    if isinstance(layer, Int8Linear):
        return Int8Linear(linear, tied=False) if int8_fits(linear) else None
    if isinstance(layer, Bf16Linear):
        return Bf16Linear(linear, tied=False)
    if isinstance(layer, w4a8.W4A8Linear):
        return w4a8.W4A8Linear(linear, tied=False) if w4a8.w4a8_fits(linear) else None
    if isinstance(layer, Int4Linear):
        group_size = int4_group_size(linear)
        return Int4Linear(linear, tied=False, group_size=group_size) if group_size else None
    return None


def quantize_model(model: nn.Module, mode: str, *, block_copies: bool = False) -> list[str]:
    """Replace every CPU ``nn.Linear`` of ``model`` (LM head included) by its ``mode`` quantized version.

    In place and for inference only; returns the names of the replaced layers.  ``none`` changes nothing.
    ``block_copies``: int8 and int4 layers also keep a bf16 copy of their weight for prompts and drafts
    (:attr:`QuantizedLinear.block_weight`), except the LM head: prompts and drafts ask it for the logits of
    one row (a 152k-token head's copy would hold 270-470 MB for nothing).
    Layers a format cannot take (int4: ``in_features`` not a multiple of 32, ``out_features`` not of 16; ``w4a8``:
    ``in_features`` not a multiple of 64; int8: not of 16) keep their weights; so do subclasses of ``nn.Linear``
    (LoRA and the like) and layers off the CPU.
    """
    if check_quantize(mode) == AUTO_QUANTIZE:
        raise ValueError("quantize_model takes a format; load_model resolves auto to one")
    if mode == "none":
        return []
    if not quantize_supported(mode):
        if mode == "bf16" and torch.backends.mkldnn.is_available():
            raise SpecDecodeError(
                "--quantize bf16: this CPU has no oneDNN bf16 matmul (it needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT);"
                " int8 and int4 run on it"
            )
        if mode == "w4a8":
            w4a8.kernel()  # raises the one-line reason
        raise SpecDecodeError(f"--quantize {mode}: this torch build has no CPU kernel for it")
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    replaced = []
    for name, linear in [(n, m) for n, m in model.named_modules() if n and type(m) is nn.Linear]:
        if linear.weight.device.type != "cpu":
            continue
        tied = uses[id(linear.weight)] > 1
        copy = block_copies and linear is not head
        if mode == "int8":
            if not int8_fits(linear):
                continue
            module: QuantizedLinear = Int8Linear(linear, tied=tied, block_copy=copy)
        elif mode == "bf16":
            module = Bf16Linear(linear, tied=tied)
        elif mode == "w4a8":
            if not w4a8.w4a8_fits(linear):
                continue
            module = w4a8.W4A8Linear(linear, tied=tied)
        else:
            group_size = int4_group_size(linear)
            if group_size is None:
                continue
            module = Int4Linear(linear, tied=tied, group_size=group_size, block_copy=copy)
        model.set_submodule(name, module)
        replaced.append(name)
    return replaced
