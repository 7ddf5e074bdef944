"""One call per layer for the attention of every decoding sequence in a ragged batch (``kernels/ragged_attention.cpp``).

Why: torch's SDPA costs about 35 µs a call on a CPU however small the call, and a batched step of 8 one-token
sequences made one call per sequence and layer: 7 of a 35 ms step for SmolLM2-135M at C=8 went to attention that
computes a few hundred dot products per head (``docs/results/serve-vllm-cpu-kernel-smollm2-135m``).  The kernel attends
every (row, head) of the sequences it is given in one parallel call.

It computes each row on its own, by one loop over the keys the row may see in column order (see the C++ source), so
a row's output depends only on its query and those keys and values: the same alone, in a draft or in a batch, and for
a tree row the same as for the branch decoded one token at a time.  That is the batch and row invariance the engine
needs (:mod:`specdecode.models.ragged`), by construction; the bucket-shaped SDPA calls of
:mod:`specdecode.models.row_attention` remain for where the kernel is not built (a GPU, no C++ compiler).  A prompt's
chunk of many rows keeps SDPA, whose blocked kernel is faster for it, in a call of its own.

Built on first use with torch's C++ extension loader (a few seconds: the source includes ATen's core headers only;
cached under ``$TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``), once per instruction set torch
runs at.  Without a C++ compiler, or when the build fails, attention stays on SDPA (``SPECDECODE_ATTENTION_KERNEL=0``
chooses that too).
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
from pathlib import Path

import torch

log = logging.getLogger("specdecode")

SOURCE = Path(__file__).with_name("kernels") / "ragged_attention.cpp"

#: Compiler flags for the instruction set torch itself runs at here (its dispatch level), so that the kernel's
#: vector code is what this CPU runs best and its build name says which one it is.
ISA_FLAGS = {
    "AVX512": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx2", "-mfma"),
    "AVX2": ("-mavx2", "-mfma"),
}

#: A sequence bringing at most this many new tokens and needing no invariance (a draft model's step, a short
#: prompt's chunk) takes the kernel too; more rows (a prompt's chunk) are faster in SDPA's blocked kernel.
FEW_ROWS = 16


@functools.cache
def ragged_attention_op() -> object | None:
    """``torch.ops.specdecode_attention.ragged_attention``, built (or loaded) once; None where it cannot be."""
    if os.environ.get("SPECDECODE_ATTENTION_KERNEL", "1") == "0":
        return None
    if not (shutil.which("c++") or shutil.which("g++")):
        log.info("attention kernel: no C++ compiler on the PATH; attention stays on SDPA")
        return None
    from torch.utils.cpp_extension import load  # its build tooling is needed by the first build only

    isa = str(torch.backends.cpu.get_cpu_capability())
    try:
        load(
            name=f"specdecode_ragged_attention_{isa.lower()}",
            sources=[str(SOURCE)],
            # OpenMP: at::parallel_for runs on torch's own OpenMP threads only when compiled with it.
            extra_cflags=["-O3", "-fopenmp", *ISA_FLAGS.get(isa, ())],
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
        )
    except (OSError, RuntimeError, ImportError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        log.warning("attention kernel: building it failed (%s); attention stays on SDPA", first)
        return None
    return torch.ops.specdecode_attention.ragged_attention


def kernel_attends(query: torch.Tensor) -> bool:
    """Whether the kernel takes this layer's attention: a CPU tensor of a dtype it computes, heads whose size is a
    whole number of its 16-float vectors, and the kernel built."""
    return (
        query.device.type == "cpu"
        and query.dtype in (torch.float32, torch.bfloat16)
        and query.shape[-1] % 16 == 0
        and ragged_attention_op() is not None
    )
