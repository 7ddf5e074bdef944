"""``--quantize w4a8``: int4 weights times int8 activations, our own kernel, for AVX2 CPUs (VNNI where present).

Why: on AVX2-only CPUs torch's int4 CPU kernel (``_weight_int4pack_mm_for_cpu``) is bound by its arithmetic,
not by memory: its cost grows with every row, so int4 decoding spends most of its time in that kernel.
llama.cpp (and OpenVINO on CPUs) quantize the activations to int8 per block and multiply with integer dot
products; this kernel does the same (``vpdpbusd`` where the CPU has VNNI, AVX2's ``maddubs`` where not).
Its layout puts 16 output channels in the lanes of a vector: one instruction multiplies the 16 channels' levels
by 4 inputs broadcast to every lane, a channel's dot never needs a sum across lanes, and the unpacked levels of a
group serve every row of a call.  Each block of 16 channels is one contiguous, prefetched run of weights (one
memory stream per thread).  On a 2-core EPYC (AVX-512 VNNI) it multiplies 32 to 128 rows at 610-710 GMAC/s,
1.4-1.9x oneDNN's bf16 matmul of the same weights, and so prompts go through it too: the model holds no bf16 copy
of its weights; a one-row call waits on memory (``docs/results/w4a8-lanes-epyc-qwen2.5-coder-1.5b``).

What it computes: the weights are :class:`~specdecode.models.quantized_layers.Int4Linear`'s (asymmetric int4,
min-max per group of 64 inputs, scale and zero rounded to bf16), ``w = q * scale + offset``; each row of
the input is quantized to int8 per group of 64 (scale ``max|x| / 127``, round to nearest), each group's
integer dot product is scaled in fp32 and the offsets multiply the group's exact fp32 sum.  It is a
different model from ``int4`` (the activations lose precision too), and lossless is defined the same
way: speculative greedy output equals plain greedy output of the same ``w4a8`` model, because the kernel
is row invariant, bitwise (see the C++ source).

Where the CPU has VNNI (AVX-512 VNNI, in 512-bit vectors, or AVX-VNNI), each group's integer dots take one
instruction per four bytes (``vpdpbusd``) instead of AVX2's multiply, multiply-add and add: the same integers,
so the same bits (tested).

Built on first use with torch's C++ extension loader (about 45 s with two cores, once per instruction set; cached under
``$TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``): it needs a C++ compiler and an x86
CPU with AVX2 and FMA, and says so in one line where either is missing.
"""

from __future__ import annotations

import functools
import hashlib
import platform
import shutil
from pathlib import Path
from types import ModuleType

import torch
from torch import nn

from specdecode.errors import SpecDecodeError
from specdecode.machine import cpu_flags
from specdecode.models.quantized_layers import QuantizedLinear, int4_levels

#: Inputs per weight group and per activation group (the kernel's unit).
GROUP = 64
#: Output channels per block of :func:`pack_blocks`' layout: the lanes of one AVX-512 vector of int32.
LANES = 16
#: Bytes of one group of one block in that layout: 16 x 64 levels in nibbles, then 16 bf16 scales and 16 zeros.
BLOCK_BYTES = 576
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
#: and the compiler flags that turn its code on (see ``dots`` in the C++ source).  VNNI multiplies and sums
#: four bytes per instruction, where AVX2 takes five instructions for two such sums.
ISA_BUILDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "avx512vnni": (
        ("avx512_vnni", "avx512vl", "avx512bw", "avx512f"),
        ("-mavx512vnni", "-mavx512vl", "-mavx512bw", "-mavx512f"),
    ),
    "avxvnni": (("avx_vnni",), ("-mavxvnni",)),
    "avx2": ((), ()),
}


def best_isa() -> str:
    """The best of :data:`ISA_BUILDS` this CPU runs."""
    flags = cpu_flags()
    return next(isa for isa, (needs, _) in ISA_BUILDS.items() if all(flag in flags for flag in needs))


@functools.cache
def source_digest() -> str:
    """The first 12 hex digits of the kernel source's SHA-256."""
    return hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]


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
    return linear.in_features % GROUP == 0


def pack_blocks(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """Levels [N, K] in 0..15 and bf16 scales and zeros [N, K/64] (:func:`int4_levels`) → the kernel's layout,
    [ceil(N/16), K/64 * 576] uint8: per block of 16 output channels (the last one padded with zero channels),
    its groups in order, each 8 rows of 64 bytes of nibbles and then the 16 channels' scales and zeros' bf16
    bits.  Row j holds 4 bytes per channel (channel c at bytes 4c..4c+3, the lanes of a vector); byte b
    carries the level of input 4j + b in its low nibble and that of input 32 + 4j + b in its high one, so one
    load unpacks into the levels that multiply two broadcast runs of 4 inputs.  One contiguous run per block
    is one memory stream per thread."""
    n, k = q.shape
    padded = -n % LANES
    if padded:
        q = torch.cat([q, q.new_zeros(padded, k)])
        scale = torch.cat([scale, scale.new_zeros(padded, scale.shape[1])])
        zero = torch.cat([zero, zero.new_zeros(padded, zero.shape[1])])
    blocks = (n + padded) // LANES
    levels = q.to(torch.uint8).reshape(blocks, LANES, -1, 2, 8, 4)  # [block, channel, G, half, j, byte]
    nibbles = levels[:, :, :, 0] | (levels[:, :, :, 1] << 4)  # [block, channel, G, j, byte]
    nibbles = nibbles.permute(0, 2, 3, 1, 4).reshape(blocks, -1, 8 * LANES * 4)  # [block, G, j, channel, byte]
    floats = torch.stack([scale.to(torch.bfloat16), zero.to(torch.bfloat16)], dim=1)  # [N, kind, G]
    floats = floats.reshape(blocks, LANES, 2, -1).permute(0, 3, 2, 1).contiguous()  # [block, G, kind, channel]
    floats = floats.view(torch.uint8).reshape(blocks, -1, 4 * LANES)
    return torch.cat([nibbles, floats], dim=-1).reshape(blocks, -1).contiguous()


def unpack_blocks(blocks: torch.Tensor, out_features: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of :func:`pack_blocks`: levels [N, K] int64, and fp32 scales and offsets [N, K/64] with
    ``w = q * scale + offset`` (``offset = zero - 8 * scale``, as the kernel computes it)."""
    count = blocks.shape[0]
    groups = blocks.reshape(count, -1, BLOCK_BYTES)  # [block, G, bytes]
    nibbles = groups[..., : 8 * LANES * 4].reshape(count, -1, 8, LANES, 4).long()  # [block, G, j, channel, byte]
    levels = torch.stack([nibbles & 15, nibbles >> 4], dim=3)  # [block, G, j, half, channel, byte]
    levels = levels.permute(0, 4, 1, 3, 2, 5).reshape(count * LANES, -1)[:out_features]
    floats = groups[..., 8 * LANES * 4 :].contiguous().view(torch.bfloat16).float()  # [block, G, kind * channel]
    floats = floats.reshape(count, -1, 2, LANES).permute(0, 3, 2, 1).reshape(count * LANES, 2, -1)[:out_features]
    scale, zero = floats[:, 0], floats[:, 1]
    return levels, scale, zero - 8 * scale


def reference_matmul(layer: W4A8Linear, rows: torch.Tensor) -> torch.Tensor:
    """What :meth:`W4A8Linear.matmul` computes, in plain torch (up to the order of fp32 sums): each group of 64
    inputs rounded to int8 steps of its ``max|x| / 127`` multiplies the levels, and the offsets multiply the
    group's exact sum."""
    groups = rows.float().reshape(rows.shape[0], -1, GROUP)
    step = groups.abs().amax(dim=-1, keepdim=True) / 127
    inverse = torch.where(step > 0, 1 / step, torch.zeros_like(step))
    rounded = torch.round(groups * inverse) * step  # [M, G, 64]
    q, scale, offset = unpack_blocks(layer.blocks, layer.out_features)
    levels = q.float().reshape(layer.out_features, -1, GROUP)  # [N, G, 64]
    dots = torch.einsum("mgk,ngk->mng", rounded, levels)
    return (dots * scale).sum(-1) + groups.sum(-1) @ offset.T


class W4A8Linear(QuantizedLinear):
    """Int4 weights (as :class:`~specdecode.models.quantized_layers.Int4Linear` rounds them, groups of 64) multiplied
    by int8-quantized activations in :func:`kernel`; fp32 in, fp32 out.

    Buffer: ``blocks`` [ceil(out/16), in/64 * 576] uint8 (:func:`pack_blocks`).

    It keeps no bf16 copy for prompts, as int8 and int4 layers do where oneDNN's bf16 matmul runs: this kernel
    multiplies many rows faster than that matmul (see the module doc), so prompts go through it as decoding does,
    and the model holds no second copy of its weights (3 GB for a 1.5B target)."""

    input_dtype = torch.float32
    channel_buffers = (("blocks", 0),)

    def __init__(self, linear: nn.Linear, *, tied: bool) -> None:
        super().__init__(linear, tied=tied)
        kernel()  # build (or load) it now: a missing compiler is a load-time error, not a mid-decode one
        self.register_buffer("blocks", pack_blocks(*int4_levels(linear.weight, GROUP)))

    @property
    def kernel_build(self) -> str:
        """The instruction set its kernel runs and the kernel's source (part of what the cost curves and
        ``--quantize auto``'s choice are keyed by: a new kernel is timed anew)."""
        return f"{best_isa()}:{source_digest()}"

    @property
    def rows_alone(self) -> bool:
        return self.block_weight is None  # the kernel is row invariant and keeps no bf16 copy

    def dequantized(self) -> torch.Tensor:
        q, scale, offset = unpack_blocks(self.blocks, self.out_features)
        levels = q.float().reshape(self.out_features, -1, GROUP)
        dense = levels * scale[..., None] + offset[..., None]
        return dense.reshape(self.out_features, self.in_features)

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        return kernel().w4a8_mm(rows.float().contiguous(), self.blocks, self.out_features)
