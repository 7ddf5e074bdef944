"""One 1536→8960 layer (Qwen2.5-1.5B's MLP): torch's int4 kernel against our w4a8 kernel, 1 to 8 rows.

Warm: fastest of 30 calls of one layer (its weights stay in the cache, so this times the arithmetic).
Cold: fastest of 10 passes over 12 such layers (over 80 MB, beyond the cache, as in decoding), per layer."""

import time

import torch
from torch import nn

from specdecode.models.quantized_layers import Int4Linear
from specdecode.models.w4a8 import W4A8Linear


def fastest_ms(call, layers, n):
    call(layers[0])
    times = []
    for _ in range(n):
        start = time.perf_counter()
        for layer in layers:
            call(layer)
        times.append((time.perf_counter() - start) / len(layers))
    return min(times) * 1e3


torch.manual_seed(0)
torch.set_num_threads(2)
int4_layers, w4a8_layers = [], []
for _ in range(12):
    linear = nn.Linear(1536, 8960, bias=False)
    linear.weight.data.normal_(0, 0.02)
    int4_layers.append(Int4Linear(linear, tied=False, group_size=64))
    w4a8_layers.append(W4A8Linear(linear, tied=False))
for rows in (1, 2, 4, 8):
    x = torch.randn(rows, 1536)
    rounded = x.bfloat16()  # what int4 layers feed their kernel

    def int4_call(layer, rounded=rounded):
        return layer.matmul(rounded)

    def w4a8_call(layer, x=x):
        return layer.matmul(x)

    cells = []
    for name, call, layers in (("int4", int4_call, int4_layers), ("w4a8", w4a8_call, w4a8_layers)):
        warm, cold = fastest_ms(call, layers[:1], 30), fastest_ms(call, layers, 10)
        cells.append(f"{name} warm {warm:.2f} cold {cold:.2f}")
    print(f"{rows} rows (ms): " + ", ".join(cells), flush=True)
