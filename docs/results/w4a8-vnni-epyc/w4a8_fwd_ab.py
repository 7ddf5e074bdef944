"""Whole forwards of the w4a8 Qwen at 200 cached tokens, n = 1..5 new, the AVX2 build against the VNNI build,
interleaved round by round (fastest of 7 rounds each)."""

import torch

from specdecode.models import loading, w4a8
from specdecode.models.cost import prefilled, timed_round

torch.set_num_threads(2)
builds = {isa: w4a8.kernel(isa) for isa in ("avx2", "avx512vnni")}
target = loading.load_model("qwen2.5-coder-1.5b", quantize="w4a8")
backend = target.backend
cache, new = prefilled(backend, 200, 5)
original = w4a8.kernel
samples = {isa: [] for isa in builds}
with torch.inference_mode():
    for round_index in range(9):
        for isa, module in builds.items():
            w4a8.kernel = lambda isa_=None, m=module: m
            times = timed_round(backend, cache, new)
            if round_index >= 2:
                samples[isa].append(times)
for isa, rounds in samples.items():
    best = [min(r[i] for r in rounds) * 1e3 for i in range(5)]
    print(isa, "ms for n=1..5:", [round(b, 1) for b in best], "ratio to n=1:", [round(b / best[0], 2) for b in best])
