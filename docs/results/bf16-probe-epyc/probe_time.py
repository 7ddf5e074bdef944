"""Time probe_row_split per layer shape (the split it picks too), bf16, 2 threads."""

import sys
import time

import torch
from torch import nn

from specdecode.models import quantized_layers as q

torch.set_num_threads(2)
shapes = [(576, 1536), (1536, 576), (576, 49152), (1536, 8960), (8960, 1536), (1536, 151936)]
for i, o in shapes:
    layer = q.Bf16Linear(nn.Linear(i, o, bias=False), tied=False)
    t = time.perf_counter()
    split = q.probe_row_split(layer.packed, i, o) if "new" in sys.argv else q.probe_row_split(layer.packed, i)
    print(f"{i}x{o}: {time.perf_counter() - t:.2f} s {split}", flush=True)
