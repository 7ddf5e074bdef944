"""A faster CPU execution path for an already-loaded transformers model: fp32 linears with their weights packed once.

Speculative decoding only pays when a forward over k new tokens costs about as much as over one.  The default fp32
``F.linear`` (MKL sgemm on a plain row-major weight) costs roughly 2-3x more for 8 rows than for 1 on small CPUs.
:class:`PackedLinear` packs each weight once, in one of two layouts:

- **Panels** (where our CPU kernels are built for AVX-512 or AVX2, :func:`specdecode.models.cpu_kernels.panels_pay`,
  and the output size is a multiple of 16): 16 output channels interleaved per input step, multiplied by
  ``kernels/panel_linear.cpp`` for any number of rows.  It reads a decoding step's few rows' weights near the memory's
  bandwidth and runs a prompt's chunk near the vector units' peak, faster than oneDNN's prepacked product at 1 to 256
  rows on a 2-core EPYC at AVX-512 and at AVX2 (``docs/results/panel-linear-smollm2-135m``).  Numerics: each output is
  one multiply-add chain over the inputs in order, so a row gets the same bits alone as in any batch and at any width:
  batched decoding, drafts and verification all compute a token's row exactly as plain decoding does.
- **oneDNN's blocked layout** (``mkldnn._reorder_linear_weight``, multiplied with ``mkldnn._linear_pointwise``)
  elsewhere: nearly the same cost for 1 to 16 rows.  It rounds differently from MKL (~1e-6 relative),
  deterministically, and is batch invariant for 2 or more rows, but a 1-row call takes a different kernel for larger
  inner sizes, so a row computed alone can differ in the last bits from the same row in a wider call: fp32 logits
  then differ by ~1e-6 between widths, too little to flip a greedy choice in practice (every fp32 equality test
  holds); the quantized layers, whose bf16 steps would make it matter, are row invariant
  (:mod:`specdecode.models.quantized_layers`).  oneDNN has a fixed cost per call, and for one to three rows it reads
  a small model's weights well below the memory's bandwidth, so each such layer whose weight has at most
  ``DENSE_COPY_MAX`` elements also keeps a dense copy for calls of up to ``DENSE_ROWS`` rows (MKL's product); which is
  faster depends on the CPU (MKL on a dense copy made a whole one-token forward faster on an AVX-512 Xeon with AMX and
  slower on an AVX-512 AMD EPYC, ``docs/results/quick-epyc-fastpath-r7``), so once per machine and model
  :func:`specdecode.models.cost.tune_fast_path` times whole forwards of 1 to ``DENSE_ROWS`` new tokens both ways and
  keeps the copies only for the row counts where they won (:func:`use_dense_rows`), freeing them where they never do.

The swap is done in place and is inference-only (the packed weight has no gradient, and packed weights are not in
``state_dict``).  :func:`remove_cpu_fast_path` turns the packed modules back into ordinary ``nn.Linear`` with bitwise
the original weights, e.g. before saving.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import nn

from specdecode.models.cpu_kernels import PANEL, pack_panels, panel_linear, panels_pay, unpack_panels


def fast_path_supported() -> bool:
    """Whether this torch build can run the oneDNN prepacked linear (CPU build with mkldnn ops)."""
    ops = torch.ops.mkldnn
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
    )


#: Calls with at most this many rows use the dense copy, where one is kept, unless :func:`use_dense_rows` says
#: fewer (the CPU's timing, :func:`specdecode.models.cost.tune_fast_path`).
DENSE_ROWS = 3
#: Weights with at most this many elements keep a dense copy beside the packed one.
DENSE_COPY_MAX = 4 * 2**20


class PackedLinear(nn.Module):
    """Drop-in replacement for an fp32 CPU ``nn.Linear`` whose weight is packed once (see the module docstring).

    ``weight`` stays readable for code that inspects shapes (e.g. ``get_output_embeddings()``): it is the original
    parameter when that is shared with another module (tied embeddings, kept anyway, so ``state_dict`` keys do not
    change); otherwise, so the dense weight can be freed, a tensor of the same shape and dtype without the values (on
    the ``meta`` device for panels, oneDNN's packed tensor itself otherwise): :meth:`dense_weight` gives them.
    """

    def __init__(self, linear: nn.Linear, *, tied: bool) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach()
        self.panels = panels_pay() and self.out_features % PANEL == 0
        packed = pack_panels(weight) if self.panels else torch.ops.mkldnn._reorder_linear_weight(weight, None)
        self.register_buffer("packed", packed, persistent=False)
        self.bias = linear.bias
        self.tied = tied
        if tied:
            self.weight = linear.weight
        else:
            self.weight = torch.empty(weight.shape, dtype=weight.dtype, device="meta") if self.panels else self.packed
        small = not self.panels and weight.numel() <= DENSE_COPY_MAX and not tied
        self.dense_rows = DENSE_ROWS if small else 0
        self.register_buffer("dense", weight if small else None, persistent=False)

    def dense_weight(self) -> torch.Tensor:
        """The weight's values, [out, in] (a copy unless tied)."""
        if self.tied:
            return self.weight.detach()
        return unpack_panels(self.packed) if self.panels else self.packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.detach()
        if torch.is_grad_enabled() and x.requires_grad:
            # The packed kernels have no autograd: training something *through* this layer (e.g. a draft adapter
            # under the LM head) takes the dense path so gradients are right.
            return nn.functional.linear(x, self.dense_weight(), bias)
        if self.panels:
            return panel_linear(x, self.packed, bias)
        if self.dense is not None and x.numel() <= self.dense_rows * self.in_features:
            return nn.functional.linear(x, self.dense, bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")

    def to_linear(self) -> nn.Linear:
        """An ordinary ``nn.Linear`` with the same weights (shared with the tied module if tied)."""
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        linear.weight = self.weight if self.tied else nn.Parameter(self.dense_weight())
        linear.bias = self.bias
        return linear

    def extra_repr(self) -> str:
        layout = "panels" if self.panels else f"onednn, dense_rows={self.dense_rows}"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"tied={self.tied}, {layout}"
        )


@dataclass
class FastPathReport:
    """What :func:`apply_cpu_fast_path` did, for logs and ``--verbose`` output."""

    replaced: list[str] = field(default_factory=list)  # qualified names of packed linears
    tied: list[str] = field(default_factory=list)  # packed linears whose weight is shared (kept dense too)
    skipped: dict[str, str] = field(default_factory=dict)  # name -> reason it kept the default path
    packed_bytes: int = 0

    def summary(self) -> str:
        text = f"packed {len(self.replaced)} linear layers ({self.packed_bytes / 2**20:.0f} MiB)"
        if self.tied:
            text += f", {len(self.tied)} tied ({', '.join(self.tied)})"
        if self.skipped:
            text += f", skipped {len(self.skipped)}"
        return text


def _skip_reason(linear: nn.Linear) -> str | None:
    weight = linear.weight
    if weight.device.type != "cpu":
        return f"on {weight.device.type}"
    if weight.dtype != torch.float32:
        return f"dtype {weight.dtype}"
    if linear.bias is not None and linear.bias.dtype != torch.float32:
        return f"bias dtype {linear.bias.dtype}"
    return None


def apply_cpu_fast_path(model: nn.Module) -> FastPathReport:
    """Replace every fp32 CPU ``nn.Linear`` in ``model`` (LM head included) by a :class:`PackedLinear`.

    Subclasses of ``nn.Linear`` (quantised, LoRA, ...) and other layer types are left alone.  A weight
    shared with another module (tied input embedding) stays a dense parameter of that module, so the
    embedding keeps working and ``model.parameters()`` is unchanged for it.
    """
    if not fast_path_supported():
        raise RuntimeError("this torch build has no oneDNN linear ops (mkldnn); the CPU fast path needs them")
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    report = FastPathReport()
    targets = [(name, module) for name, module in model.named_modules() if name and type(module) is nn.Linear]
    for name, linear in targets:
        reason = _skip_reason(linear)
        if reason is not None:
            report.skipped[name] = reason
            continue
        tied = uses[id(linear.weight)] > 1
        packed = PackedLinear(linear, tied=tied)
        model.set_submodule(name, packed)
        report.replaced.append(name)
        report.packed_bytes += linear.weight.numel() * linear.weight.element_size()
        if tied:
            report.tied.append(name)
    return report


def dense_copies(model: nn.Module) -> list[PackedLinear]:
    """The packed layers of ``model`` that keep a dense copy (what :func:`use_dense_rows` switches)."""
    return [m for m in model.modules() if isinstance(m, PackedLinear) and m.dense is not None]


def use_dense_rows(model: nn.Module, rows: int) -> None:
    """Calls of at most ``rows`` rows (0 to ``DENSE_ROWS``) use the dense copies; with 0 they are freed (the
    packed weight holds the values)."""
    for module in dense_copies(model):
        module.dense_rows = rows
        if rows == 0:
            module.dense = None


def remove_cpu_fast_path(model: nn.Module) -> int:
    """Undo :func:`apply_cpu_fast_path`: turn every :class:`PackedLinear` back into ``nn.Linear``.

    Returns how many layers were restored.  The restored weights are bitwise the originals.
    """
    packed = [(name, module) for name, module in model.named_modules() if isinstance(module, PackedLinear)]
    for name, module in packed:
        model.set_submodule(name, module.to_linear())
    return len(packed)
