"""Our own CPU kernels (``kernels/ragged_attention.cpp``, ``kernels/few_rows.cpp``), built as one extension.

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
from pathlib import Path

import torch

log = logging.getLogger("specdecode")

KERNELS = Path(__file__).with_name("kernels")
SOURCES = (KERNELS / "ragged_attention.cpp", KERNELS / "few_rows.cpp")
HEADERS = (KERNELS / "vector16.h",)

#: Compiler flags for the instruction set torch itself runs at here (its dispatch level), so that the kernels' vector
#: code is what this CPU runs best and the build's name says which one it is.
ISA_FLAGS = {
    "AVX512": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx2", "-mfma", "-mprefer-vector-width=512"),
    "AVX2": ("-mavx2", "-mfma"),
}


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
            extra_cflags=["-O3", "-fopenmp", *ISA_FLAGS.get(isa, ()), f"-DSPECDECODE_HEADERS={_headers_hash()}"],
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
    digest = hashlib.sha256()
    for header in HEADERS:
        digest.update(header.read_bytes())
    return digest.hexdigest()[:16]


def few_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` of a few fp32 rows by a dense fp32 weight through ``kernels/few_rows.cpp`` where it takes them
    (CPU kernels built, inner size a multiple of 16), else through torch (MKL)."""
    rows = x.reshape(-1, x.shape[-1])
    if not (cpu_kernels_built() and x.dtype == weight.dtype == torch.float32 and x.shape[-1] % 16 == 0):
        return torch.nn.functional.linear(x, weight, bias)
    out = rows.new_empty(rows.shape[0], weight.shape[0])
    torch.ops.specdecode_linear.few_rows_linear(rows.contiguous(), weight, out)
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], weight.shape[0])
