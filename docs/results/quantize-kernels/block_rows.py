"""Time the int4, int8 and bf16 CPU kernels by rows per call, for the layer shapes of the Qwen2.5 models
(``block-rows.md`` holds one run's output): where the bf16 copy of a quantized layer starts to pay."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn

from specdecode.models.quantized_layers import Int4Linear, Int8Linear, _packed_bf16_call

SHAPES = [(896, 4864), (4864, 896), (896, 896), (1536, 8960), (8960, 1536)]
ROWS = (1, 2, 4, 8, 16, 32, 64, 300)


def mean_ms(call: Callable[[], object], repeats: int = 20) -> float:
    """Mean time of ``call`` in ms, after two warm-up calls."""
    call()
    call()
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    torch.manual_seed(0)
    for inputs, outputs in SHAPES:
        linear = nn.Linear(inputs, outputs, bias=False)
        int4 = Int4Linear(linear, tied=False, group_size=64)
        int8 = Int8Linear(linear, tied=False)
        packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach().bfloat16(), None)
        cells = []
        for rows in ROWS:
            x = torch.randn(rows, inputs).bfloat16()
            times = [mean_ms(lambda layer=layer, x=x: layer.matmul(x)) for layer in (int4, int8)]
            times.append(mean_ms(lambda x=x, packed=packed: _packed_bf16_call(packed, x)))
            cells.append(f"{rows}: " + " / ".join(f"{t:.3f}" for t in times))
        print(f"{inputs} -> {outputs}: " + "; ".join(cells), flush=True)


if __name__ == "__main__":
    main()
