"""Microseconds a layer of one ragged attention call (``kernels/ragged_attention.cpp``) for 1-17 new rows after 300
cached tokens, SmolLM2-135M's attention shape (9 query heads, 3 key heads, head size 64, fp32 storage); rows beyond
the first form a binary tree as a verification's draft does.  30 layers' storage is cycled through, as a forward
does; the fastest of five rounds of 20 forwards' worth of calls."""

import json
import sys
import time

import torch

from specdecode.models.cpu_kernels import cpu_kernels_built

assert cpu_kernels_built()
attention = torch.ops.specdecode_attention.ragged_attention
HEADS, KV_HEADS, DIM, CAPACITY, PAST, LAYERS = 9, 3, 64, 1024, 300, 30
generator = torch.Generator().manual_seed(0)
keys = [torch.randn(1, KV_HEADS, CAPACITY, DIM, generator=generator) for _ in range(LAYERS)]
values = [torch.randn(1, KV_HEADS, CAPACITY, DIM, generator=generator) for _ in range(LAYERS)]


def microseconds(rows: int) -> float:
    query = torch.randn(HEADS, rows, DIM, generator=generator)
    out = torch.empty(rows, HEADS, DIM)
    mask = torch.zeros(rows, rows, dtype=torch.bool)
    for row in range(rows):
        node = row
        while node >= 0:
            mask[row, node] = True
            node = (node - 1) // 2 if node > 0 else -1
    meta = torch.tensor([[0, 0, rows, PAST, 0]])
    positions = torch.arange(PAST, PAST + rows)

    def forward() -> None:
        for layer in range(LAYERS):
            attention(query, keys[layer], values[layer], meta, mask.flatten(), positions, DIM**-0.5, 0, out)

    for _ in range(20):
        forward()
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(20):
            forward()
        best = min(best, (time.perf_counter() - started) / 20 / LAYERS * 1e6)
    return round(best, 1)


json.dump(
    {"threads": torch.get_num_threads(), "us_per_layer": {rows: microseconds(rows) for rows in range(1, 18)}},
    sys.stdout,
    indent=1,
)
print()
