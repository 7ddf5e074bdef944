"""``--quantize w4a8``: int4 weights times int8 activations, our own kernel, for AVX2 CPUs (VNNI where present).

Why: on AVX2-only CPUs torch's int4 CPU kernel (``_weight_int4pack_mm_for_cpu``) is bound by its arithmetic,
not by memory: its cost grows with every row, so int4 decoding spends most of its time in that kernel.
llama.cpp (and OpenVINO on CPUs) quantize the activations to int8 per block and multiply with integer dot
products; this kernel does the same with AVX2's ``maddubs`` and reads its weights near the memory's bandwidth,
well under the int4 kernel's time for one row and for 8 (``docs/results/avx2``, ``w4a8_layer_timing.txt``).
Its layout serves that bandwidth: one contiguous, prefetched run of weights per channel pair (one memory stream
per thread), and the lanes of each group's integer dots summed across before one conversion and one fma.

What it computes: the weights are :class:`~specdecode.models.quantized_layers.Int4Linear`'s (asymmetric int4,
min-max per group of 64 inputs, scale and zero rounded to bf16), ``w = q * scale + offset``; each row of
the input is quantized to int8 per group of 64 (scale ``max|x| / 127``, round to nearest), each group's
integer dot product is scaled in fp32 and the offsets multiply the group's exact fp32 sum.  It is a
different model from ``int4`` (the activations lose precision too), and lossless is defined the same
way: speculative greedy output equals plain greedy output of the same ``w4a8`` model, because the kernel
is row invariant, bitwise (see the C++ source).

Where the CPU has VNNI (AVX-512 VNNI with VL, or AVX-VNNI), each group's integer dots take one instruction per
four bytes (``vpdpbusd``) instead of AVX2's multiply, multiply-add and add: the same integers, so the same bits
(tested), and a forward is a few percent faster (``docs/results/w4a8-vnni-epyc``).

Built on first use with torch's C++ extension loader (about 45 s with two cores, once per instruction set; cached under
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
from specdecode.machine import cpu_flags
from specdecode.models.quantized_layers import QuantizedLinear, bf16_matmul_supported, int4_levels

#: Inputs per weight group and per activation group (the kernel's unit).
GROUP = 64
#: Bytes of one group of one channel pair in :func:`pack_blocks`' layout: 2 x 32 of nibbles, 4 bf16 numbers.
BLOCK_BYTES = 72
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


#: The instruction sets the kernel is built for, best first: the CPU flags (as Linux names them) each needs,
#: and the compiler flags that turn its code on (see ``group_dot`` in the C++ source).  VNNI multiplies and sums
#: four bytes per instruction, where AVX2 takes two multiplies and an addition for two.
ISA_BUILDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "avx512vnni": (("avx512_vnni", "avx512vl"), ("-mavx512vnni", "-mavx512vl")),
    "avxvnni": (("avx_vnni",), ("-mavxvnni",)),
    "avx2": ((), ()),
}


def best_isa() -> str:
    """The best of :data:`ISA_BUILDS` this CPU runs."""
    flags = cpu_flags()
    return next(isa for isa, (needs, _) in ISA_BUILDS.items() if all(flag in flags for flag in needs))


@functools.cache
def kernel(isa: str | None = None) -> ModuleType:
    """The compiled extension for ``isa`` (default: :func:`best_isa`), built once per machine, source and
    instruction set, then loaded from torch's cache.  Every build computes the same bits (the integer dots are
    exact); only their speed differs."""
    reason = unavailable_reason()
    if reason is not None:
        raise SpecDecodeError(f"--quantize w4a8: {reason}")
    isa = isa or best_isa()
    # The C++ extension loader (and the build tooling it imports) is needed only by the first w4a8 model, not by
    # every model load that imports this module.
    from torch.utils.cpp_extension import load

    try:
        return load(
            name=f"specdecode_w4a8_{isa}",
            sources=[str(SOURCE)],
            extra_cflags=["-O3", "-mavx2", "-mfma", *ISA_BUILDS[isa][1], "-fopenmp"],
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
    return linear.in_features % GROUP == 0 and linear.out_features % 2 == 0


def pack_blocks(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """Levels [N, K] in 0..15 and bf16 scales and zeros [N, K/64] (:func:`int4_levels`) → the kernel's layout,
    [N/2, K/64 * 72] uint8: per pair of output channels, its groups in order, each the two channels' 32 bytes
    of nibbles (byte j: level j low, level 32 + j high; one AVX2 load unpacks into 32 + 32 inputs) and then
    their scales and zeros' bf16 bits (scale a, scale b, zero a, zero b).  One contiguous run per pair is
    one memory stream per thread."""
    n = q.shape[0]
    if n % 2:
        raise ValueError("w4a8 packs output channels in pairs: out_features must be even")
    halves = q.to(torch.uint8).reshape(n, -1, 2, GROUP // 2)
    nibbles = (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(n // 2, 2, -1, GROUP // 2)
    levels = nibbles.transpose(1, 2).reshape(n // 2, -1, GROUP)  # [pairs, G, 64]
    floats = torch.stack([scale.to(torch.bfloat16), zero.to(torch.bfloat16)], dim=1)  # [N, 2, G]
    floats = floats.reshape(n // 2, 2, 2, -1).permute(0, 3, 2, 1).contiguous()  # [pairs, G, kind, channel]
    floats = floats.view(torch.uint8).reshape(n // 2, -1, 8)
    return torch.cat([levels, floats], dim=-1).reshape(n // 2, -1).contiguous()


def unpack_blocks(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of :func:`pack_blocks`: levels [N, K] int64, and fp32 scales and offsets [N, K/64] with
    ``w = q * scale + offset`` (``offset = zero - 8 * scale``, as the kernel computes it)."""
    pairs = blocks.shape[0]
    groups = blocks.reshape(pairs, -1, BLOCK_BYTES)
    nibbles = groups[..., :GROUP].reshape(pairs, -1, 2, GROUP // 2).transpose(1, 2).long()  # [pairs, 2, G, 32]
    levels = torch.cat([nibbles & 15, nibbles >> 4], dim=-1).reshape(2 * pairs, -1)
    floats = groups[..., GROUP:].contiguous().view(torch.bfloat16).float()  # [pairs, G, 4]
    floats = floats.reshape(pairs, -1, 2, 2).permute(0, 3, 2, 1).reshape(2 * pairs, 2, -1)  # [N, kind, G]
    scale, zero = floats[:, 0], floats[:, 1]
    return levels, scale, zero - 8 * scale


def reference_matmul(layer: W4A8Linear, rows: torch.Tensor) -> torch.Tensor:
    """What :meth:`W4A8Linear.matmul` computes, in plain torch (up to fp32 summation order): each group of 64
    inputs rounded to int8 steps of its ``max|x| / 127`` multiplies the levels, and the offsets multiply the
    group's exact sum."""
    groups = rows.float().reshape(rows.shape[0], -1, GROUP)
    step = groups.abs().amax(dim=-1, keepdim=True) / 127
    inverse = torch.where(step > 0, 1 / step, torch.zeros_like(step))
    rounded = torch.round(groups * inverse) * step  # [M, G, 64]
    q, scale, offset = unpack_blocks(layer.blocks)
    levels = q.float().reshape(layer.out_features, -1, GROUP)  # [N, G, 64]
    dots = torch.einsum("mgk,ngk->mng", rounded, levels)
    return (dots * scale).sum(-1) + groups.sum(-1) @ offset.T


class W4A8Linear(QuantizedLinear):
    """Int4 weights (as :class:`~specdecode.models.quantized_layers.Int4Linear` rounds them, groups of 64) multiplied
    by int8-quantized activations in :func:`kernel`; fp32 in, fp32 out.

    Buffer: ``blocks`` [out/2, in/64 * 72] uint8 (:func:`pack_blocks`).

    ``block_copy`` keeps a bf16 copy for prompts only where oneDNN's bf16 matmul runs (as int4 layers do
    there).  Without it the copy would be a plain bf16 tensor multiplied in fp32 slices, and this kernel is
    faster at every row count (``docs/results/avx2``); so prompts go through the kernel, as plain decoding
    does, and the model holds no second copy of its weights (3 GB for a 1.5B target)."""

    input_dtype = torch.float32
    channel_buffers = (("blocks", 0),)

    def __init__(self, linear: nn.Linear, *, tied: bool, block_copy: bool = False) -> None:
        super().__init__(linear, tied=tied)
        kernel()  # build (or load) it now: a missing compiler is a load-time error, not a mid-decode one
        self.register_buffer("blocks", pack_blocks(*int4_levels(linear.weight, GROUP)))
        if block_copy and bf16_matmul_supported():
            self.keep_block_weight(self.dequantized())

    @property
    def isa(self) -> str:
        """The instruction set its kernel runs (part of what the cost curves are keyed by)."""
        return best_isa()

    def dequantized(self) -> torch.Tensor:
        q, scale, offset = unpack_blocks(self.blocks)
        levels = q.float().reshape(self.out_features, -1, GROUP)
        dense = levels * scale[..., None] + offset[..., None]
        return dense.reshape(self.out_features, self.in_features)

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        return kernel().w4a8_mm(rows.float().contiguous(), self.blocks)
