"""``--quantize w4a8``: int4 weights times int8 activations, our own kernel, for AVX2 CPUs.

Why: on a 2-core AVX2-only AMD EPYC, torch's int4 CPU kernel (``_weight_int4pack_mm_for_cpu``) is bound by
its arithmetic, not by memory: a 1536→8960 layer took 1.1 ms for one row and 4.2 ms for 8 (its cost grows
with every row), so int4 decoding of ``qwen2.5-coder-1.5b`` spent 85% of its time in that kernel, and
llama.cpp decoded the same model twice as fast.  llama.cpp (and OpenVINO on CPUs) quantize the activations
to int8 per block and multiply with integer dot products; this kernel does the same with AVX2's
``maddubs``: the same layer takes 0.33 ms for one row and 1.8 ms for 8 (fastest of 30, the weights warm in
the cache; ``docs/results/avx2/w4a8_layer_timing.py``).

What it computes: the weights are :class:`~specdecode.models.quantized_layers.Int4Linear`'s (asymmetric int4,
min-max per group of 64 inputs, scale and zero rounded to bf16), ``w = q * scale + offset``; each row of
the input is quantized to int8 per group of 64 (scale ``max|x| / 127``, round to nearest), each group's
integer dot product is scaled in fp32 and the offsets multiply the group's exact fp32 sum.  It is a
different model from ``int4`` (the activations lose precision too), and lossless is defined the same
way: speculative greedy output equals plain greedy output of the same ``w4a8`` model, because the kernel
is row invariant, bitwise (see the C++ source).

Built on first use with torch's C++ extension loader (about 45 s with two cores; cached under
``$TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``): it needs a C++ compiler and an x86
CPU with AVX2 and FMA, and says so in one line where either is missing.
"""

from __future__ import annotations

import functools
import platform
import shutil
from pathlib import Path
from types import ModuleType

import torch
from torch import nn

from specdecode.errors import SpecDecodeError
from specdecode.models.quantized_layers import QuantizedLinear, int4_levels

#: Inputs per weight group and per activation group (the kernel's unit).
GROUP = 64
SOURCE = Path(__file__).with_name("kernels") / "w4a8.cpp"


def unavailable_reason() -> str | None:
    """Why the kernel cannot run here, or None when it can (it may still have to be built)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"it needs an x86 CPU with AVX2, this is {platform.machine()}"
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):  # torch's AVX2 level implies FMA
        return "this CPU lacks AVX2 or FMA"
    if not (shutil.which("c++") or shutil.which("g++")):
        return "it is compiled on first use and no C++ compiler (c++ or g++) is on the PATH"
    return None


@functools.cache
def kernel() -> ModuleType:
    """The compiled extension (built once per machine and source, then loaded from torch's cache)."""
    reason = unavailable_reason()
    if reason is not None:
        raise SpecDecodeError(f"--quantize w4a8: {reason}")
    from torch.utils.cpp_extension import load

    try:
        return load(
            name="specdecode_w4a8",
            sources=[str(SOURCE)],
            extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
        )
    except (OSError, RuntimeError, ImportError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SpecDecodeError(f"--quantize w4a8: building its kernel failed: {first}") from exc


def w4a8_available() -> bool:
    return unavailable_reason() is None


@functools.cache
def kernel_builds() -> bool:
    """Whether the kernel builds (or is built) here: what a default, unlike an explicit ``--quantize w4a8``,
    must check before choosing it, since a compiler can be present and still fail (no Python headers)."""
    try:
        kernel()
    except SpecDecodeError:
        return False
    return True


def w4a8_fits(linear: nn.Linear) -> bool:
    return linear.in_features % GROUP == 0


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """[N, K] levels 0..15 → [N, K/2] uint8 in the kernel's layout: byte j of group g holds level g*64 + j in
    its low nibble and level g*64 + 32 + j in its high one (one AVX2 load unpacks into 32 + 32 inputs)."""
    halves = q.to(torch.uint8).reshape(q.shape[0], -1, 2, GROUP // 2)
    return (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(q.shape[0], -1).contiguous()


def unpack_nibbles(nibbles: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack_nibbles`: [N, K] levels as int64."""
    groups = nibbles.reshape(nibbles.shape[0], -1, GROUP // 2).long()
    return torch.cat([groups & 15, groups >> 4], dim=-1).reshape(nibbles.shape[0], -1)


def reference_matmul(layer: W4A8Linear, rows: torch.Tensor) -> torch.Tensor:
    """What :meth:`W4A8Linear.matmul` computes, in plain torch (up to fp32 summation order): each group of 64
    inputs rounded to int8 steps of its ``max|x| / 127`` multiplies the levels, and the offsets multiply the
    group's exact sum."""
    groups = rows.float().reshape(rows.shape[0], -1, GROUP)
    step = groups.abs().amax(dim=-1, keepdim=True) / 127
    inverse = torch.where(step > 0, 1 / step, torch.zeros_like(step))
    rounded = torch.round(groups * inverse) * step  # [M, G, 64]
    levels = unpack_nibbles(layer.nibbles).float().reshape(layer.out_features, -1, GROUP)  # [N, G, 64]
    dots = torch.einsum("mgk,ngk->mng", rounded, levels)
    return (dots * layer.scales).sum(-1) + groups.sum(-1) @ layer.offsets.T


class W4A8Linear(QuantizedLinear):
    """Int4 weights (as :class:`~specdecode.models.quantized_layers.Int4Linear` rounds them, groups of 64) multiplied
    by int8-quantized activations in :func:`kernel`; fp32 in, fp32 out.

    Buffers: ``nibbles`` [out, in/2] uint8 (:func:`pack_nibbles`), ``scales`` and ``offsets`` [out, in/64]
    fp32 with ``w = q * scale + offset``.  Prompts and drafts go to the bf16 block copy from
    the same row count as int4 layers do."""

    input_dtype = torch.float32
    channel_buffers = (("nibbles", 0), ("scales", 0), ("offsets", 0))

    def __init__(self, linear: nn.Linear, *, tied: bool, block_copy: bool = False) -> None:
        super().__init__(linear, tied=tied)
        kernel()  # build (or load) it now: a missing compiler is a load-time error, not a mid-decode one
        q, scale, zero = int4_levels(linear.weight, GROUP)
        self.register_buffer("nibbles", pack_nibbles(q))
        self.register_buffer("scales", scale.float())
        self.register_buffer("offsets", zero.float() - 8 * scale.float())
        if block_copy:
            self.keep_block_weight(self.dequantized())

    def dequantized(self) -> torch.Tensor:
        levels = unpack_nibbles(self.nibbles).float().reshape(self.out_features, -1, GROUP)
        dense = levels * self.scales[..., None] + self.offsets[..., None]
        return dense.reshape(self.out_features, self.in_features)

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        return kernel().w4a8_mm(rows.float().contiguous(), self.nibbles, self.scales, self.offsets)
