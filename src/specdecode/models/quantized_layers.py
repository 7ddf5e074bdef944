"""The quantized linear layers behind ``--quantize`` (:mod:`specdecode.models.quantize` chooses and installs
them): ``int8``, ``int4`` and ``bf16`` here, ``w4a8`` in :mod:`specdecode.models.w4a8`.

Which kernels: torch's own CPU weight-only matmuls, ``aten._weight_int8pack_mm`` (what gpt-fast uses) and
``aten._weight_int4pack_mm_for_cpu``, fed bf16 activations: with fp32 activations both take a slow path, slower than
the fp32 oneDNN layer they replace and growing with every row of a call; with bf16 ones they are the fastest of the
kernels compared in ``docs/results/quantize-kernels``.  So a quantized layer rounds its input to bf16 and its output
comes back as bf16 values in fp32; the rest of the model (embedding, norms, attention, residual stream) stays fp32.
``torchao``'s CPU weight-only paths call the same int4 op, or dequantize the int8 weight on every call (eager mode),
so it brings no kernel of its own here.

Batch invariance: both kernels are batch invariant (measured bitwise, 1 to 64 rows, 1 and 2 threads), and
the backend then attends row by row (:mod:`specdecode.models.ragged`): a token's logits do not depend on
how many tokens share the forward, bitwise, which the fp32 path cannot promise.  Bitwise matters here: the
logits come in bf16 steps, so near-ties are common and a last-bit difference in a verification forward
would break one differently from plain decoding.

``bf16`` keeps 2 bytes per weight, in oneDNN's blocked layout, multiplied on bf16 activations (AMX where the CPU has
it, :class:`Bf16Linear`).  It reads twice the bytes of int8, but its cost hardly grows with the rows of a call,
where the int8 and int4 kernels' cost grows with every row (``docs/results/quantize-kernels``): verifying a draft
costs about what one plain token does, which is what speculation needs.  Its kernel is not batch invariant for every
call shape, so each layer probes, once, how its calls must be cut to be (:func:`probe_row_split`).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from torch import nn

from specdecode.models.cpu_kernels import (
    PANEL,
    bf16_panel_linear,
    bf16_panels_pay,
    bf16_widened_pays,
    pack_bf16_panels,
    unpack_bf16_panels,
)

#: What the kernels compute in: their inputs, outputs, scales and zeros (see the module doc for why).
COMPUTE_DTYPE = torch.bfloat16


#: From this many rows on, a call of an int8 or int4 layer in which no row needs invariance
#: (:func:`free_row_calls`) goes to the layer's bf16 copy, when it keeps one.  Both kernels cost about
#: linearly in the rows (they loop over them), oneDNN's bf16 one hardly grows
#: (``docs/results/quantize-kernels/block-rows.md``).
BLOCK_MIN_ROWS = 8
#: The same threshold where the CPU has no oneDNN bf16 matmul (AVX2 only) and the copy is a plain bf16 tensor
#: multiplied in fp32 slices (:func:`_dense_block_call`): under 32 rows the slices' conversion costs more than
#: the int4 kernel saves (``docs/results/avx2``: the copies' kernel).
DENSE_BLOCK_MIN_ROWS = 32
#: Output channels converted to fp32 at a time by :func:`_dense_block_call`: a slice stays in cache, where
#: converting the whole weight at once costs more, and slicing even beats a resident fp32 copy
#: (``docs/results/avx2``: the copies' kernel).
DENSE_BLOCK_SLICE = 512


def bf16_matmul_supported() -> bool:
    """Whether oneDNN's bf16 matmul runs here (AVX-512 BW/VL/DQ or AVX-NE-CONVERT; not on AVX2-only CPUs)."""
    mkldnn = torch.ops.mkldnn
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(mkldnn, "_linear_pointwise")
        and bool(mkldnn._is_mkldnn_bf16_supported())
    )


def weight_only_kernels_present() -> bool:
    """Whether this torch build has the int8 and int4 CPU kernels."""
    aten = torch.ops.aten
    return all(
        hasattr(aten, op)
        for op in ("_weight_int8pack_mm", "_weight_int4pack_mm_for_cpu", "_convert_weight_to_int4pack_for_cpu")
    )


class QuantizedLinear(nn.Module):
    """What int8 and int4 layers share: the shapes, the bias, and a dense view of the weight.

    ``block_weight``, when kept, is the dequantized weight in bf16, in oneDNN's layout, for calls of many
    rows where no row needs invariance (:data:`BLOCK_MIN_ROWS`): a long prompt then costs a layer a small
    fraction of what the int4 kernel takes, for two more bytes per weight held in memory.  A CPU without
    oneDNN's bf16 matmul (AVX2 only) keeps it as a plain bf16 tensor, multiplied in fp32 slices from
    :data:`DENSE_BLOCK_MIN_ROWS` rows on (still faster than int4 for a long prompt there).

    ``weight`` is read by code that inspects shapes or copies rows of the LM head for a draft head
    (``HFCausalLM.output_weight``).  A tied head answers with the fp32 embedding it was quantized from
    (no copy, so checks against a head trained on the fp32 target still hold); an untied one with its
    dequantized weight, computed on each read.
    """

    #: What :meth:`matmul` takes: the kernels below want bf16 rows (see the module doc).
    input_dtype = COMPUTE_DTYPE
    #: The buffers :meth:`matmul` reads, each with the dimension along which it lists output channels: layers
    #: of one input concatenate along it into one (:meth:`fused`).  Empty: this kind does not fuse.
    channel_buffers: tuple[tuple[str, int], ...] = ()

    def __init__(self, linear: nn.Linear, *, tied: bool) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.bias = linear.bias
        self.register_buffer("tied_weight", linear.weight.detach() if tied else None, persistent=False)
        self.register_buffer("block_weight", None, persistent=False)

    def keep_block_weight(self, dense: torch.Tensor) -> None:
        """Keep ``dense`` (the [out, in] weight this layer's kernel multiplies by) for many-row free calls: in
        oneDNN's bf16 layout where the CPU has its bf16 matmul, else as a plain bf16 tensor."""
        weight = dense.to(COMPUTE_DTYPE).contiguous()
        self.block_weight = torch.ops.mkldnn._reorder_linear_weight(weight, None) if bf16_matmul_supported() else weight

    @property
    def weight(self) -> torch.Tensor:
        return self.tied_weight if self.tied_weight is not None else self.dequantized()

    def dequantized(self) -> torch.Tensor:
        """The [out_features, in_features] weight this layer multiplies by, as a dense fp32 tensor."""
        raise NotImplementedError

    def to_linear(self) -> nn.Linear:
        """An ordinary fp32 ``nn.Linear`` multiplying by this layer's weight (a tied layer's: the shared one), as
        :meth:`PackedLinear.to_linear <specdecode.models.fastpath.PackedLinear.to_linear>` gives: what LoRA wraps
        and what a gradient flows back through, where the kernel has no backward."""
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        linear.weight = nn.Parameter(self.weight.detach().float())
        linear.bias = self.bias
        return linear

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        """[m, in_features] → [m, out_features] in :data:`COMPUTE_DTYPE`, without the bias."""
        raise NotImplementedError

    def fused(self, layers: list[QuantizedLinear]) -> QuantizedLinear:
        """A layer of this kind whose :meth:`matmul` gives ``layers``' outputs side by side, in one kernel call
        (no bias, no block copy).  Whether the kernel's packed layout allows it is the caller's to check: torch's
        int4 layout packs output channels in blocks, and parts that are not whole blocks come out scrambled."""
        if not self.channel_buffers:
            raise TypeError(f"{type(self).__name__} layers do not fuse")
        fused = copy.copy(self)
        # Dicts of its own (a shallow copy shares them): its bias and buffers are set, the layers' stay theirs.
        fused._parameters = {**self._parameters, "bias": None}
        fused._buffers = {"tied_weight": None, "block_weight": None}
        for name, dim in self.channel_buffers:
            fused._buffers[name] = torch.cat([getattr(layer, name) for layer in layers], dim)
        fused.out_features = sum(layer.out_features for layer in layers)
        return fused

    @property
    def rows_alone(self) -> bool:
        """Whether every call computes each row on its own, free rows as the others (:meth:`free_matmul` is
        :meth:`matmul`, no block copy): a forward is then one call, whatever rows need invariance."""
        return False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.product(x.reshape(-1, self.in_features)).to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` [m, in_features] times the weight, without the bias, in the dtype the kernel gives (bf16 but for
        w4a8's fp32; fp32 where one call mixes rows free of batch invariance with others): what :meth:`forward`
        converts back to its input's dtype.  Rows already in :attr:`input_dtype` are not copied, so several layers
        of one input convert it once (:mod:`specdecode.models.layer_forward`)."""
        spans = () if self.rows_alone else _free_spans(rows.shape[0])
        if spans == ((0, rows.shape[0]),):
            return self._free_call(rows)
        if not spans:
            return self.matmul(rows.to(self.input_dtype).contiguous())
        return self._mixed_call(rows, spans)

    def _free_call(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows no output depends on bitwise, in one call: the block copy from enough rows on, else the kernel."""
        block = self.block_weight
        if block is not None and rows.shape[0] >= _block_min_rows(block):
            return _block_call(block, rows.to(COMPUTE_DTYPE).contiguous())
        return self.free_matmul(rows.to(self.input_dtype).contiguous())

    def _mixed_call(self, rows: torch.Tensor, spans: tuple[tuple[int, int], ...]) -> torch.Tensor:
        """Each free span in a call of its own, exactly as it would be multiplied alone, and the other rows
        together through the batch invariant kernel."""
        free = torch.zeros(rows.shape[0], dtype=torch.bool)
        out = None
        for start, stop in spans:
            part = self._free_call(rows[start:stop]).float()
            out = out if out is not None else part.new_empty(rows.shape[0], self.out_features)
            out[start:stop] = part
            free[start:stop] = True
        fixed = torch.nonzero(~free).flatten()
        if len(fixed):
            out[fixed] = self.matmul(rows[fixed].to(self.input_dtype).contiguous()).float()
        return out

    def free_matmul(self, rows: torch.Tensor) -> torch.Tensor:
        """:meth:`matmul` for rows that need no batch invariance: a kind whose invariant calls cost more says how."""
        return self.matmul(rows)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"tied={self.tied_weight is not None}"
        )


class Int8Linear(QuantizedLinear):
    """Symmetric int8 per output channel: ``w[o, i] ≈ q[o, i] * scale[o]`` with ``q`` in -127..127.

    One scale per row is what ``_weight_int8pack_mm`` takes; symmetric (no zero point) because decoder
    weights are centred on zero, and -128 is left out so that ``q`` and ``-q`` are both representable.
    ``q`` is rounded against the scale as stored (bf16), not as computed.
    """

    channel_buffers = (("qweight", 0), ("scales", 0))

    def __init__(self, linear: nn.Linear, *, tied: bool, block_copy: bool = False) -> None:
        super().__init__(linear, tied=tied)
        weight = linear.weight.detach().float()
        scale = (weight.abs().amax(dim=1) / 127).clamp(min=torch.finfo(COMPUTE_DTYPE).tiny).to(COMPUTE_DTYPE)
        q = torch.round(weight / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
        self.register_buffer("qweight", q)
        self.register_buffer("scales", scale)
        if block_copy:
            self.keep_block_weight(self.dequantized())

    def dequantized(self) -> torch.Tensor:
        return self.qweight.float() * self.scales.float()[:, None]

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(rows, self.qweight, self.scales)


#: Elements of a weight rounded at a time by :func:`int4_levels`: a slice's temporaries stay in the CPU's
#: caches, which computes the same result faster than rounding the whole matrix at once.
ROUNDING_SLICE = 1 << 18


def int4_levels(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight`` [out, in] rounded as :class:`Int4Linear` (and ``w4a8``) store it: levels [out, in] int32 in
    0..15, and per group of ``group_size`` inputs a scale and a zero [out, in / group_size] in bf16, with
    ``w ≈ (q - 8) * scale + zero``; ``q`` is rounded against the scale and zero as stored.  Rows are
    independent, so they are rounded a slice at a time."""
    rows = max(1, ROUNDING_SLICE // weight.shape[1])
    slices = [_int4_levels_of(weight[i : i + rows], group_size) for i in range(0, weight.shape[0], rows)]
    levels, scale, zero = (torch.cat(parts) for parts in zip(*slices))
    return levels, scale, zero


def _int4_levels_of(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups = weight.detach().float().reshape(weight.shape[0], -1, group_size)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = ((high - low) / 15).clamp(min=torch.finfo(COMPUTE_DTYPE).tiny).to(COMPUTE_DTYPE)
    zero = (low + 8 * scale.float()).to(COMPUTE_DTYPE)
    levels = (groups - zero.float()[..., None]) / scale.float()[..., None] + 8
    return torch.round(levels).clamp(0, 15).to(torch.int32).reshape(weight.shape), scale, zero


class Int4Linear(QuantizedLinear):
    """Asymmetric int4 per group of ``group_size`` inputs: ``w ≈ (q - 8) * scale + zero``, ``q`` in 0..15.

    The min-max range of each group maps onto 0..15 (a zero per group keeps the range's full 16 levels,
    which matters at 4 bits); ``zero`` is the value of the middle level 8, the convention of
    ``_weight_int4pack_mm_for_cpu``, whose packed layout ``_convert_weight_to_int4pack_for_cpu`` makes.
    ``q`` is rounded against the scale and zero as stored (bf16), not as computed.
    """

    channel_buffers = (("qweight", 0), ("scales_zeros", 1))

    def __init__(self, linear: nn.Linear, *, tied: bool, group_size: int, block_copy: bool = False) -> None:
        super().__init__(linear, tied=tied)
        self.group_size = group_size
        q, scale, zero = int4_levels(linear.weight, group_size)
        self.register_buffer("qweight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
        # [in_features // group_size, out_features, 2]: (scale, zero) per group and output channel.
        self.register_buffer("scales_zeros", torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous())
        if block_copy:  # from q directly: dequantized() multiplies an identity, far slower for big layers
            groups = q.reshape(self.out_features, -1, group_size)
            dense = (groups - 8) * scale.float()[..., None] + zero.float()[..., None]
            self.keep_block_weight(dense.reshape(q.shape))

    def dequantized(self) -> torch.Tensor:
        # The kernel is linear in its input: multiplying the identity reads the weight back (as bf16 values).
        eye = torch.eye(self.in_features, dtype=COMPUTE_DTYPE)
        return self.matmul(eye).T.float().contiguous()

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.qweight, self.group_size, self.scales_zeros)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, group_size={self.group_size}"


@dataclass(frozen=True)
class RowSplit:
    """How calls to one bf16 layer are cut so that a row's result never depends on the rows beside it.

    oneDNN picks its kernel and blocking from the call's shape: on an AVX-512 CPU with AMX, a call of 2 to 32
    rows gives every row bitwise what a call of that row alone gives, except that one-row calls with 8,960
    inputs (Qwen2.5-1.5B's down projection) take another kernel, and calls of more than 32 rows another
    blocking.  So a one-row call may be sent as two rows (the row twice) and longer calls are cut."""

    pad_single: bool  # a one-row call is sent as the row twice
    chunk: int  # calls of more rows are cut into calls of at most this many (1: row by row)


#: The most rows a cut call carries: from 33 rows on, oneDNN's kernel takes another blocking on AMX CPUs.
MAX_CHUNK = 32
#: Outputs the probe compares for each call size.  Where one-row and many-row calls sum in different orders,
#: the bf16 result hides most of the difference, so only a few outputs differ, and how many the probe sees
#: grows with rows x out_features: without AMX (AVX-512 bf16), SmolLM2's down projection (576 outputs) can pass
#: a probe of 32 rows (18k outputs) and still differ on real activations.  What the probe costs per layer
#: shape: ``docs/results/bf16-probe-epyc``.
PROBE_OUTPUTS = 1 << 19
#: Bounds on the probe's rows: at least one call of every size, and a narrow layer's probe stays short.
PROBE_MIN_ROWS, PROBE_MAX_ROWS = MAX_CHUNK, 1024

#: The probed split per (in_features, out_features, threads).
_SPLITS: dict[tuple[int, int, int], RowSplit] = {}
#: Set while rows of a forward need no batch invariance: None for every row of every call
#: (:func:`free_row_calls`), else the forward's row count and its free spans (:func:`free_row_spans`).
_FREE_ROWS: ContextVar[tuple[int | None, tuple[tuple[int, int], ...]] | None] = ContextVar("free_rows", default=None)


@contextmanager
def free_row_calls() -> Iterator[None]:
    """Within, layers take their fastest kernel for the call's rows, whether or not it is batch invariant.

    For forwards no output depends on bitwise: a draft model's forwards.  bf16 layers then multiply all rows in
    one uncut call (cut into 32-row calls, a 500-token prompt would read every weight 16 times), and int8 and int4
    layers with a :attr:`QuantizedLinear.block_weight` use it from :data:`BLOCK_MIN_ROWS` rows on."""
    token = _FREE_ROWS.set((None, ()))
    try:
        yield
    finally:
        _FREE_ROWS.reset(token)


@contextmanager
def free_row_spans(rows: int, spans: list[tuple[int, int]]) -> Iterator[None]:
    """Within, a call over the forward's ``rows`` rows multiplies each of ``spans`` (start, stop) in a call of its
    own, as :func:`free_row_calls` would multiply it alone, and the other rows through the batch invariant kernel;
    a call over other rows (the LM head's kept rows) is batch invariant throughout.

    For a forward where some sequences need no invariance: a prompt's chunk, whose rows must come out the same
    whether it is read alone or beside other sequences' verification (a span's call depends on its own rows
    only), and which takes the fast kernels all the same."""
    token = _FREE_ROWS.set((rows, tuple(spans)))
    try:
        yield
    finally:
        _FREE_ROWS.reset(token)


def _free_spans(rows: int) -> tuple[tuple[int, int], ...]:
    """The spans of a call of ``rows`` rows that need no batch invariance (see :func:`free_row_spans`)."""
    free = _FREE_ROWS.get()
    if free is None:
        return ()
    forward_rows, spans = free
    if forward_rows is None:
        return ((0, rows),) if rows else ()
    return spans if forward_rows == rows else ()


def _packed_bf16_call(packed: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(rows, packed, None, "none", [], "")


def _block_min_rows(block: torch.Tensor) -> int:
    return BLOCK_MIN_ROWS if block.is_mkldnn else DENSE_BLOCK_MIN_ROWS


def _block_call(block: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """[m, in] bf16 rows times a layer's block copy (:attr:`QuantizedLinear.block_weight`), either kind."""
    return _packed_bf16_call(block, rows) if block.is_mkldnn else _dense_block_call(block, rows)


def _dense_block_call(weight: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """[m, in] rows times a plain bf16 [out, in] weight, in fp32, :data:`DENSE_BLOCK_SLICE` output channels at a
    time converted into one reused buffer: the CPU has no bf16 matmul, and fp32 products of many rows beat the
    int4 and int8 kernels, which loop over the rows."""
    rows = rows.float()
    out = rows.new_empty(rows.shape[0], weight.shape[0])
    buffer = rows.new_empty(min(DENSE_BLOCK_SLICE, weight.shape[0]), weight.shape[1])
    for start in range(0, weight.shape[0], DENSE_BLOCK_SLICE):
        part = weight[start : start + DENSE_BLOCK_SLICE]
        converted = buffer[: part.shape[0]]
        converted.copy_(part)
        torch.mm(rows, converted.T, out=out[:, start : start + part.shape[0]])
    return out


def _split_call(packed: torch.Tensor, rows: torch.Tensor, split: RowSplit) -> torch.Tensor:
    if rows.shape[0] > split.chunk:
        return torch.cat([_split_call(packed, part, split) for part in rows.split(split.chunk)])
    if rows.shape[0] == 1 and split.pad_single:
        return _packed_bf16_call(packed, rows.expand(2, -1).contiguous())[:1]
    return _packed_bf16_call(packed, rows)


def probe_row_split(packed: torch.Tensor, in_features: int, out_features: int) -> RowSplit:
    """The cheapest :class:`RowSplit` under which ``packed``'s calls are batch invariant, bitwise: random rows,
    each alone against the same row in calls of every size from 2 up, every size checked on all the rows.
    The kernel's reduction order does not depend on the values, but whether a different order shows in a bf16
    result does, so the rows are as many as :data:`PROBE_OUTPUTS` asks; with no call size that passes, calls go
    row by row (chunk 1), which is invariant by construction."""
    count = min(max(-(-PROBE_OUTPUTS // out_features), PROBE_MIN_ROWS), PROBE_MAX_ROWS)
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(count, in_features, generator=generator).to(COMPUTE_DTYPE)
    for pad_single in (False, True):
        alone = RowSplit(pad_single, 1)
        reference = torch.cat([_split_call(packed, rows[i : i + 1], alone) for i in range(count)])
        chunk = _invariant_call_rows(packed, rows, reference)
        if chunk > 1:
            return RowSplit(pad_single, chunk)
    return RowSplit(False, 1)


def _invariant_call_rows(packed: torch.Tensor, rows: torch.Tensor, reference: torch.Tensor) -> int:
    """The largest m up to :data:`MAX_CHUNK` such that calls of 2 to m rows give each row its ``reference``
    (its result alone); for each size the rows are cut into consecutive calls of that size."""
    for m in range(2, MAX_CHUNK + 1):
        for start in range(0, len(rows) - m + 1, m):
            if not torch.equal(_packed_bf16_call(packed, rows[start : start + m]), reference[start : start + m]):
                return m - 1
    return MAX_CHUNK


class Bf16Linear(QuantizedLinear):
    """A bf16 weight multiplied on bf16 activations.

    Where the CPU has AVX512_BF16 and no AMX (:func:`~specdecode.models.cpu_kernels.bf16_panels_pay`), the weight is
    packed as panels of 16 output channels and every call goes through our kernel (``kernels/bf16_panel_linear.cpp``),
    whose rows get the same bits in any call: a prompt's chunk and a verification's rows alike.  Elsewhere it is in
    oneDNN's blocked layout (AMX where the CPU has it), its calls cut as :class:`RowSplit` says, so that verification
    rows get bitwise what plain decoding's one-row calls get; the probe runs on a layer's first call, once per weight
    shape and thread count (:data:`_SPLITS`), since the kernel choice depends on nothing else."""

    def __init__(self, linear: nn.Linear, *, tied: bool) -> None:
        super().__init__(linear, tied=tied)
        weight = linear.weight.detach().to(COMPUTE_DTYPE)
        panels = bf16_panels_pay() and self.out_features % PANEL == 0 and self.in_features % 2 == 0
        self.register_buffer("bf16_panels", pack_bf16_panels(weight) if panels else None, persistent=False)
        onednn = None if panels else torch.ops.mkldnn._reorder_linear_weight(weight, None)
        self.register_buffer("packed", onednn, persistent=False)

    @property
    def kernel_build(self) -> str:
        """Which product the layer runs (part of what the cost curves are keyed by)."""
        if self.bf16_panels is None:
            return "onednn bf16"
        return "bf16 panels, widened" if bf16_widened_pays() else "bf16 panels"

    @property
    def rows_alone(self) -> bool:
        return self.bf16_panels is not None

    @property
    def split(self) -> RowSplit:
        key = (self.in_features, self.out_features, torch.get_num_threads())
        if key not in _SPLITS:
            _SPLITS[key] = probe_row_split(self.packed, self.in_features, self.out_features)
        return _SPLITS[key]

    def dequantized(self) -> torch.Tensor:
        dense = unpack_bf16_panels(self.bf16_panels) if self.bf16_panels is not None else self.packed.to_dense()
        return dense.float()

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        if self.bf16_panels is not None:
            return bf16_panel_linear(rows, self.bf16_panels)
        return _split_call(self.packed, rows, self.split)

    def free_matmul(self, rows: torch.Tensor) -> torch.Tensor:
        return self.matmul(rows) if self.rows_alone else _packed_bf16_call(self.packed, rows)
