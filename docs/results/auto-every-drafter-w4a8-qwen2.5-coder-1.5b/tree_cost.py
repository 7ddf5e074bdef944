"""Verification forward of w chain tokens against w tree nodes (one root, w-1 children) at a 300-token context:
qwen2.5-coder-1.5b w4a8, 2 threads, fastest of 5.  Run: python tree_cost.py (output: tree_cost.txt)."""

import time

import torch

from specdecode.models.base import SequenceInput
from specdecode.models.loading import load_model

torch.set_num_threads(2)
target = load_model("qwen2.5-coder-1.5b", quantize="w4a8").backend
cache = target.new_cache()
prompt = torch.randint(100, 5000, (300,))
target.forward(prompt, cache, logits_rows=slice(-1, None), invariant=False)
base = cache.length


def timed(width, tree):
    best = 1e9
    for _ in range(5):
        tokens = torch.randint(100, 5000, (width,))
        mask = None
        positions = None
        if tree and width > 2:
            mask = torch.zeros(width, width, dtype=torch.bool)
            mask[:, 0] = True
            mask[torch.arange(width), torch.arange(width)] = True
            positions = torch.tensor([base] + [base + 1] * (width - 1))
        t = time.perf_counter()
        target.forward_batch([SequenceInput(tokens, cache, positions=positions, tree_mask=mask)])
        best = min(best, time.perf_counter() - t)
        cache.crop(base)
    return best


one = timed(1, False)
print(f"width 1: {one * 1000:.0f} ms")
for w in (2, 3, 5, 8, 12, 16):
    c, t = timed(w, False), timed(w, True)
    chain, tree = f"chain {c * 1000:5.0f} ms ({c / one:.2f}x)", f"tree {t * 1000:5.0f} ms ({t / one:.2f}x)"
    print(f"width {w:2d}: {chain}  {tree}  tree/chain {t / c:.2f}")
