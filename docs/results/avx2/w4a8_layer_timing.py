"""One 1536→8960 layer (Qwen2.5-1.5B's MLP): torch's int4 kernel against our w4a8 kernel, 1 to 8 rows.

Fastest of 30 calls each (the weights stay warm in the cache, so this times the arithmetic, not memory)."""

import time

import torch
from torch import nn

from specdecode.models.quantized_layers import Int4Linear
from specdecode.models.w4a8 import W4A8Linear


def fastest_ms(call, n=30):
    call()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


torch.manual_seed(0)
torch.set_num_threads(2)
linear = nn.Linear(1536, 8960, bias=False)
linear.weight.data.normal_(0, 0.02)
int4, w4a8 = Int4Linear(linear, tied=False, group_size=64), W4A8Linear(linear, tied=False)
for rows in (1, 2, 4, 8):
    x = torch.randn(rows, 1536)
    rounded = x.bfloat16()  # what int4 layers feed their kernel
    int4_ms = fastest_ms(lambda rounded=rounded: int4.matmul(rounded))
    w4a8_ms = fastest_ms(lambda x=x: w4a8.matmul(x))
    print(f"{rows} rows: int4 {int4_ms:.2f} ms, w4a8 {w4a8_ms:.2f} ms", flush=True)
