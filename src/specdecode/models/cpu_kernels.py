"""Our own CPU kernels (``kernels/ragged_attention.cpp``, ``kernels/chunk_attention.cpp``,
``kernels/panel_linear.cpp``, ``kernels/layer_ops.cpp``), built as one extension.

Built on first use with torch's C++ extension loader (a few seconds: the sources include ATen's core headers only;
cached under ``$TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``), once per instruction set torch runs
at.  Without a C++ compiler, or when the build fails, or with ``SPECDECODE_CPU_KERNELS=0``, nothing is built and torch's
own kernels run instead: :func:`cpu_kernels_built` says which, and the cost curves are keyed by it.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import time
from pathlib import Path

import torch

log = logging.getLogger("specdecode")

KERNELS = Path(__file__).with_name("kernels")
SOURCES = tuple(
    KERNELS / name
    for name in (
        "ragged_attention.cpp",
        "chunk_attention.cpp",
        "panel_linear.cpp",
        "layer_ops.cpp",
        "greedy_head.cpp",
        "bf16_panel_linear.cpp",
    )
)
HEADERS = (KERNELS / "vector16.h", KERNELS / "vec.h", KERNELS / "panel_tile.h", KERNELS / "bf16_panel_tile.h")

#: Compiler flags for the instruction set torch itself runs at here (its dispatch level), so that the kernels' vector
#: code is what this CPU runs best and the build's name says which one it is.
ISA_FLAGS = {
    "AVX512": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx2", "-mfma", "-mprefer-vector-width=512"),
    "AVX2": ("-mavx2", "-mfma"),
}


def compile_flags(isa: str) -> list[str]:
    """The compiler flags the kernels are built with at torch's dispatch level ``isa`` (its name, ``AVX512``...)."""
    return ["-O3", "-fopenmp", *ISA_FLAGS.get(isa, ())]


@functools.cache
def cpu_kernels_built() -> bool:
    """Build (or load) the extension once; False where it cannot be."""
    if os.environ.get("SPECDECODE_CPU_KERNELS", "1") == "0":
        return False
    if not (shutil.which("c++") or shutil.which("g++")):
        log.info("CPU kernels: no C++ compiler on the PATH; torch's kernels run instead")
        return False
    from torch.utils.cpp_extension import load  # its build tooling is needed by the first build only

    isa = str(torch.backends.cpu.get_cpu_capability())
    try:
        load(
            name=f"specdecode_cpu_kernels_{isa.lower()}",
            sources=[str(source) for source in SOURCES],
            # OpenMP: at::parallel_for runs on torch's own OpenMP threads only when compiled with it.
            # The loader rebuilds when a source or a flag changes, not a header: the headers' hash is a flag.
            extra_cflags=[*compile_flags(isa), f"-DSPECDECODE_HEADERS={_headers_hash()}"],
            extra_ldflags=["-fopenmp"],
            extra_include_paths=[str(KERNELS)],
            is_python_module=False,
        )
    except (OSError, RuntimeError, ImportError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        log.warning("CPU kernels: building them failed (%s); torch's kernels run instead", first)
        return False
    return True


def _headers_hash() -> str:
    return _files_hash(HEADERS)


@functools.cache
def kernels_source_digest() -> str:
    """A hash of the kernels' sources and headers: what a measurement of their speed is keyed by, so that a changed
    kernel is timed anew (:func:`specdecode.models.cost.machine_and_model_key`)."""
    return _files_hash((*SOURCES, *HEADERS))


def _files_hash(paths: tuple[Path, ...]) -> str:
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


#: Output channels of one panel of :func:`pack_panels` (one vector at AVX-512, two at AVX2).
PANEL = 16


def panels_pay() -> bool:
    """Whether the fp32 fast path multiplies with the panel kernel here: where the kernels are built for AVX-512 or
    AVX2, at which the kernel beat oneDNN's product at every row count from 1 to 256 on the same CPU
    (``docs/results/panel-linear-smollm2-135m``: products.json, products-avx2.json); not measured at other levels."""
    return cpu_kernels_built() and str(torch.backends.cpu.get_cpu_capability()) in ("AVX512", "AVX2")


def bf16_panels_pay() -> bool:
    """Whether bf16 layers multiply with the bf16 panel kernel (``kernels/bf16_panel_linear.cpp``): where the CPU has
    AVX512_BF16 and no AMX (with AMX oneDNN's product is as fast at 8 rows as at one and several times the kernel's
    speed from 32 rows: results/bf16-kernels-xeon-smollm2-135m), the kernels built."""
    return cpu_kernels_built() and torch.cpu._is_avx512_bf16_supported() and not torch.cpu._is_amx_tile_supported()


def pack_bf16_panels(weight: torch.Tensor) -> torch.Tensor:
    """A weight [out, in] (``out`` a multiple of :data:`PANEL`, ``in`` even) rounded to bf16 in the bf16 panel kernel's
    layout, int32 pairs [out / 16, in / 2, 16]: panel p, step k holds channel c's weights at inputs 2k and 2k + 1."""
    out, inner = weight.shape
    pairs = weight.detach().to(torch.bfloat16).view(out // PANEL, PANEL, inner // 2, 2).permute(0, 2, 1, 3)
    return pairs.contiguous().view(torch.int32).view(out // PANEL, inner // 2, PANEL)


def unpack_bf16_panels(panels: torch.Tensor) -> torch.Tensor:
    """:func:`pack_bf16_panels` undone: the bf16 weight [out, in], bitwise."""
    count, half, _ = panels.shape
    pairs = panels.contiguous().view(torch.bfloat16).view(count, half, PANEL, 2).permute(0, 2, 1, 3)
    return pairs.reshape(count * PANEL, half * 2)


def bf16_panel_linear(rows: torch.Tensor, panels: torch.Tensor, widened: bool | None = None) -> torch.Tensor:
    """bf16 ``rows`` [m, in] times the weight of ``panels = pack_bf16_panels(weight)``, fp32 [m, out]: every row bitwise
    what it gets alone.  ``widened``: by multiply-adds on the numbers widened to fp32 instead of AVX512_BF16's dot
    product, the same bits (default: the faster here, :func:`bf16_widened_pays`)."""
    out = rows.new_empty(rows.shape[0], panels.shape[0] * PANEL, dtype=torch.float32)
    pairs = rows.contiguous().view(torch.int32)
    widened = bf16_widened_pays() if widened is None else widened
    return torch.ops.specdecode_bf16.bf16_panel_linear(pairs, panels, out, widened)


#: The layer the two bf16 products are timed on (SmolLM2-135M's MLP input: 576 in, 1,536 out), the rows a verification
#: forward multiplies (a block of the tile), and how much faster the multiply-adds must be to be chosen.
_PROBE_SHAPE, _PROBE_ROWS, _PROBE_MARGIN = (1536, 576), 12, 0.9


@functools.cache
def bf16_widened_pays() -> bool:
    """Whether the bf16 panel kernel multiplies by widened pairs here (see ``kernels/bf16_panel_tile.h``): timed once
    per process on one layer, each product's fastest of six calls, the two alternated; the multiply-adds chosen where
    they take under nine tenths of the dot product's time and give the same bits (a CPU whose vdpbf16ps summed
    otherwise keeps it, so that no output depends on a timing).  On an Intel Xeon without AMX one vdpbf16ps takes the
    time of four multiply-adds though it does the work of two, so the widened product wins wherever the rows are many
    enough to be bound by arithmetic."""
    generator = torch.Generator().manual_seed(0)
    panels = pack_bf16_panels(torch.randn(*_PROBE_SHAPE, generator=generator))
    rows = torch.randn(_PROBE_ROWS, _PROBE_SHAPE[1], generator=generator).to(torch.bfloat16)
    if not torch.equal(bf16_panel_linear(rows, panels, True), bf16_panel_linear(rows, panels, False)):
        return False
    fastest = {False: float("inf"), True: float("inf")}
    for _ in range(6):
        for widened in fastest:
            start = time.perf_counter()
            bf16_panel_linear(rows, panels, widened)
            fastest[widened] = min(fastest[widened], time.perf_counter() - start)
    return fastest[True] < _PROBE_MARGIN * fastest[False]


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """An fp32 weight [out, in] (``out`` a multiple of :data:`PANEL`) in the panel kernel's layout,
    [out / 16, in, 16]: panel p, step k holds channels 16p..16p+15 at input k."""
    out, inner = weight.shape
    return weight.detach().reshape(out // PANEL, PANEL, inner).transpose(1, 2).contiguous()


def unpack_panels(panels: torch.Tensor) -> torch.Tensor:
    """:func:`pack_panels` undone: the weight [out, in], bitwise."""
    return panels.transpose(1, 2).reshape(-1, panels.shape[1])


def panel_linear(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for fp32 ``x`` [..., in] and ``panels = pack_panels(weight)``, through
    ``kernels/panel_linear.cpp`` (the CPU kernels must be built): every row bitwise what it gets alone."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = rows.new_empty(rows.shape[0], panels.shape[0] * PANEL)
    torch.ops.specdecode_linear.panel_linear(rows, panels, out)
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], out.shape[1])
