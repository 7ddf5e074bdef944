"""Each row's greedy choice from an fp32 LM head without its whole fp32 product (``kernels/greedy_head.cpp``).

Why: a greedy decision reads the index of a row's largest logit and nothing else, and the LM head is the widest
product of a small model's step (``smollm2-135m``: 49,152 x 576, a fifth of each row's multiply-adds and of a
decoding step's weight bytes).  The kernel computes the row in bf16 first (half the bytes, twice the products per
instruction), keeps the tokens whose bf16 logit is within a proven bound of the largest, and computes only those
again with the panel product's own fp32 tile: the choice is bitwise the full fp32 logits' argmax (the first on a tie,
as ``torch.argmax``), with the same weights, so plain decoding, verification and every drafter keep their outputs.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from specdecode.models.cpu_kernels import PANEL, bf16_widened_pays, cpu_kernels_built, panel_linear, unpack_panels
from specdecode.models.fastpath import PackedLinear

#: bf16's unit roundoff (8 significant bits, rounding to nearest).
BF16_ROUNDOFF = 2.0**-9
#: fp32's smallest normal number: bf16's dot product flushes smaller inputs and products to zero.
SMALLEST_NORMAL = 2.0**-126
#: Relative margin on norms and bounds computed in floating point, so that each is rounded up.
ROUND_UP = 1 + 2.0**-20
#: The kernel's own fp32 sums of a logit and its bound, each within 2^-24 of its operands' magnitudes (a bf16 logit is
#: at most about |x| |w_i|): added to the bound's scale, so that rounding them cannot move a bound inwards.
BOUND_ARITHMETIC = 2.0**-22


#: transformers' models whose logits are their LM head's output itself (no softcap, no scaling after it), tested.
PLAIN_HEAD_MODELS = frozenset({"LlamaForCausalLM", "Qwen2ForCausalLM"})


def greedy_head_applies(model: nn.Module) -> bool:
    """Whether greedy verification of ``model`` takes its choices through the greedy head: its logits are its LM
    head's output, the head an fp32 panel product without a bias, and this CPU runs the kernel."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return (
        type(model).__name__ in PLAIN_HEAD_MODELS
        and isinstance(head, PackedLinear)
        and head.panels
        and head.bias is None
        and greedy_head_supported()
    )


def greedy_head_supported() -> bool:
    """Whether this CPU has AVX512_BF16 (the kernel's dot product) and our kernels are built."""
    return (
        torch.backends.cpu.get_cpu_capability() == "AVX512"
        and torch.cpu._is_avx512_bf16_supported()
        and cpu_kernels_built()
    )


class GreedyHead:
    """The greedy choices of the rows of an LM head packed as panels (:class:`~specdecode.models.fastpath.PackedLinear`
    with ``panels``), bitwise ``head(x).argmax(-1)``."""

    def __init__(self, panels: torch.Tensor) -> None:
        count, inner, _ = panels.shape
        if inner % 2:
            raise ValueError("the greedy head takes an even number of inputs")
        weight = unpack_panels(panels)
        rounded = weight.to(torch.bfloat16)
        if not torch.isfinite(rounded).all():
            raise ValueError("the LM head's weights do not fit bf16")
        self.panels = panels
        # [P, in / 2, 16] pairs: step k of panel p holds channel c's weights at inputs 2k and 2k + 1 side by side.
        pairs = rounded.view(count, PANEL, inner // 2, 2).permute(0, 2, 1, 3).contiguous()
        self.panels_bf16 = pairs.view(torch.int32).view(count, inner // 2, PANEL)
        self.norms = (weight.double().norm(dim=1) * ROUND_UP).float()
        self.largest_norm = float(self.norms.max())
        self.inner = inner
        # The kernel's bound, |bf16 logit - fp32 logit| <= scale |x| |w_i| + floor (kernels/greedy_head.cpp).
        sum_bound = inner * 2.0**-24 / (1 - inner * 2.0**-24)
        roundoff = BF16_ROUNDOFF
        self.scale = (2 * roundoff + roundoff**2 + sum_bound * (1 + roundoff) ** 2 + sum_bound) * ROUND_UP
        self.scale += BOUND_ARITHMETIC

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """[rows] int64: ``argmax`` of each row of ``x [rows, in] @ weight.T`` in fp32."""
        rows = x.reshape(-1, self.inner).float().contiguous()
        if not bool(torch.isfinite(rows).all()):  # the bound is for finite inputs: the full product decides
            return panel_linear(rows, self.panels, None).argmax(-1)
        choices = torch.empty(rows.shape[0], dtype=torch.long)
        norms = rows.double().norm(dim=1)
        # Inputs and products bf16 flushes to zero: each below the smallest normal number.
        floor = SMALLEST_NORMAL * (math.sqrt(self.inner) * (float(norms.max()) + self.largest_norm) + self.inner)
        torch.ops.specdecode_greedy_head.greedy_head(
            rows,
            rows.to(torch.bfloat16).view(torch.int32),
            self.panels,
            self.panels_bf16,
            self.norms,
            (norms * ROUND_UP).float(),
            self.scale,
            floor * 2,
            bf16_widened_pays(),
            choices,
        )
        return choices
