"""Prefill time of an N-token prompt (``python prefill_timing.py MODEL N``), fp32 against int4: fastest of 3."""

import sys
import time

import torch

from specdecode.models.loading import load_model

name, n = sys.argv[1], int(sys.argv[2])
prompt = torch.randint(100, 1000, (n,), generator=torch.Generator().manual_seed(0))
for label, options in (("fp32", {}), ("int4", {"quantize": "int4"})):
    backend = load_model(name, **options).backend
    times = []
    for _ in range(3):
        cache = backend.new_cache()
        start = time.perf_counter()
        backend.forward(prompt, cache, logits_rows=slice(-1, None), invariant=False)
        times.append(time.perf_counter() - start)
    print(name, label, n, f"prefill {min(times) * 1e3:.0f} ms", flush=True)
