"""Median time of one draft token: fp32 modules, int4 modules, int4 written-out step; interleaved rounds."""
import statistics, sys, time
import torch
from specdecode.models.loading import load_model

name = sys.argv[1]
models = {"fp32": load_model(name).backend, "int4": load_model(name, quantize="int4").backend}
prompt = torch.randint(100, 1000, (500,), generator=torch.Generator().manual_seed(0))
def run(backend, use_step, n=30):
    cache = backend.new_cache()
    backend.forward(prompt, cache, invariant=False)
    times, token = [], 5
    for _ in range(n):
        t = time.perf_counter()
        if use_step:
            logits = backend.draft_logits(torch.tensor([token]), cache)
        else:
            logits = backend.forward(torch.tensor([token]), cache, logits_rows=slice(-1, None), invariant=False).logits[0]
        times.append(time.perf_counter() - t)
        token = int(logits.argmax())
    return statistics.median(times) * 1e3
rows = {"fp32 modules": [], "int4 modules": [], "int4 step": []}
for _ in range(4):
    rows["fp32 modules"].append(run(models["fp32"], False))
    rows["int4 modules"].append(run(models["int4"], False))
    rows["int4 step"].append(run(models["int4"], True))
for k, v in rows.items():
    print(name, k, "median %.1f ms  (rounds: %s)" % (statistics.median(v), ", ".join("%.1f" % x for x in v)), flush=True)
