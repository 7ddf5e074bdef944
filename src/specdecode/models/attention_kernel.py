"""One call per layer for the attention of every decoding sequence in a ragged batch (``kernels/ragged_attention.cpp``).

Why: torch's SDPA costs about 35 µs a call on a CPU however small the call, and a batched step of 8 one-token
sequences made one call per sequence and layer: 7 of a 35 ms step for SmolLM2-135M at C=8 went to attention that
computes a few hundred dot products per head (``docs/results/serve-vllm-cpu-kernel-smollm2-135m``).  The kernel attends
every (row, head) of the sequences it is given in one parallel call.

It computes each row on its own, by one loop over the keys the row may see in column order (see the C++ source), so
a row's output depends only on its query and those keys and values: the same alone, in a draft or in a batch, and for
a tree row the same as for the branch decoded one token at a time.  That is the batch and row invariance the engine
needs (:mod:`specdecode.models.ragged`), by construction; the bucket-shaped SDPA calls of
:mod:`specdecode.models.row_attention` remain for where the kernel is not built (a GPU, no C++ compiler).

A prompt's chunk of many rows is a product per head instead, which ``kernels/chunk_attention.cpp`` computes in a call of
its own (fp32, causal, no sliding window; SDPA's blocked kernel otherwise): it read a 128-token chunk's attention 2.4x
faster than SDPA (``docs/results/chunk-attention-smollm2-135m``).  A chunk needs no row invariance (solo and batched
decoding read a prompt in the same chunks), but the kernel's rows depend on nothing else in the chunk either.

Built with the other CPU kernels (:mod:`specdecode.models.cpu_kernels`); where they are not built, attention stays on
SDPA.
"""

from __future__ import annotations

import torch

from specdecode.models.cpu_kernels import cpu_kernels_built

#: A sequence bringing at most this many new tokens and needing no invariance (a draft model's step, a short
#: prompt's chunk) takes the kernel too; more rows (a prompt's chunk) are faster in the chunk kernel's products.
FEW_ROWS = 16


def ragged_attention_op() -> object | None:
    """``torch.ops.specdecode_attention.ragged_attention``; None where the CPU kernels are not built."""
    return torch.ops.specdecode_attention.ragged_attention if cpu_kernels_built() else None


def chunk_kernel_fits(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the chunk kernel computes a full-attention chunk of these heads: fp32 on the CPU, heads a whole number
    of 64 floats, the kernels built."""
    return device.type == "cpu" and dtype == torch.float32 and head_dim % 64 == 0 and cpu_kernels_built()


def chunk_attention_op(query: torch.Tensor, sliding_window: int | None) -> object | None:
    """``torch.ops.specdecode_chunk.chunk_attention`` where it computes this layer's causal chunk (no sliding window,
    :func:`chunk_kernel_fits`); None elsewhere."""
    if sliding_window is None and chunk_kernel_fits(query.device, query.dtype, query.shape[-1]):
        return torch.ops.specdecode_chunk.chunk_attention
    return None


def kernel_attends(query: torch.Tensor) -> bool:
    """Whether the kernel takes this layer's attention: a CPU tensor of a dtype it computes, heads whose size is a
    whole number of its 16-float vectors, and the kernel built."""
    return (
        query.device.type == "cpu"
        and query.dtype in (torch.float32, torch.bfloat16)
        and query.shape[-1] % 16 == 0
        and ragged_attention_op() is not None
    )
