"""Prefill seconds of a w4a8 Qwen: bf16 block copies against the w4a8 kernel, prompts of 56-295 tokens."""

import time

import torch

from specdecode.models import loading
from specdecode.models.quantized_layers import QuantizedLinear

torch.set_num_threads(2)
target = loading.load_model("qwen2.5-coder-1.5b", quantize="w4a8")
backend = target.backend
layers = [m for m in backend.model.modules() if isinstance(m, QuantizedLinear)]
blocks = [m.block_weight for m in layers]
print("layers", len(layers), "with copies", sum(b is not None for b in blocks))


def prefill(n):
    ids = torch.randint(100, 20000, (n,))
    best = 1e9
    for _ in range(3):
        cache = backend.new_cache()
        t = time.perf_counter()
        with torch.inference_mode():
            backend.forward(ids, cache, logits_rows=slice(-1, None), invariant=False)
        best = min(best, time.perf_counter() - t)
    return best


for n in (56, 164, 295):
    with_copies = prefill(n)
    for m in layers:
        m.block_weight = None
    kernel_only = prefill(n)
    for m, b in zip(layers, blocks):
        m.block_weight = b
    print(f"{n} tokens: bf16 copies {with_copies:.3f} s, w4a8 kernel {kernel_only:.3f} s", flush=True)
