"""A whole forward's time after a cached context, shared by the measuring tools (imported by the tools run from this
directory)."""

from __future__ import annotations

import time

import torch

CACHED = 100


def forward_ms(backend, ids: torch.Tensor, rows: int) -> float:
    """Milliseconds of a forward over ``ids[CACHED:CACHED + rows]`` after ``ids[:CACHED]`` are cached (the cache cropped
    back after each): the fastest of three rounds' means, 20 calls a round (5 from 100 rows)."""
    means = []
    for _ in range(3):
        cache = backend.new_cache()
        backend.forward(ids[:CACHED], cache)
        calls = 20 if rows < 100 else 5
        started = time.perf_counter()
        for _ in range(calls):
            backend.forward(ids[CACHED : CACHED + rows], cache)
            cache.crop(CACHED)
        means.append((time.perf_counter() - started) / calls * 1000)
    return round(min(means), 2)
