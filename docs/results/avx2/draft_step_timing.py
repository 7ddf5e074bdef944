"""Median time of one draft token (``python draft_step_timing.py MODEL``) after a 500-token prompt, four
interleaved rounds of 30: int4 through transformers' modules, and the written-out step in int4 and in w4a8."""

import statistics
import sys
import time

import torch

from specdecode.models.loading import load_model

name = sys.argv[1]
models = {mode: load_model(name, quantize=mode).backend for mode in ("int4", "w4a8")}
prompt = torch.randint(100, 1000, (500,), generator=torch.Generator().manual_seed(0))


def median_ms(backend, use_step: bool, n: int = 30) -> float:
    cache = backend.new_cache()
    backend.forward(prompt, cache, invariant=False)
    times, token = [], 5
    for _ in range(n):
        start = time.perf_counter()
        tokens = torch.tensor([token])
        if use_step:
            logits = backend.draft_logits(tokens, cache)
        else:
            logits = backend.forward(tokens, cache, logits_rows=slice(-1, None), invariant=False).logits[0]
        times.append(time.perf_counter() - start)
        token = int(logits.argmax())
    return statistics.median(times) * 1e3


rounds = {"int4 modules": [], "int4 step": [], "w4a8 step": []}
for _ in range(4):
    rounds["int4 modules"].append(median_ms(models["int4"], False))
    rounds["int4 step"].append(median_ms(models["int4"], True))
    rounds["w4a8 step"].append(median_ms(models["w4a8"], True))
for label, values in rounds.items():
    listed = ", ".join(f"{v:.1f}" for v in values)
    print(name, label, f"median {statistics.median(values):.1f} ms  (rounds: {listed})", flush=True)
