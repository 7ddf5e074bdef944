"""A whole forward's time after a cached context, shared by the measuring tools (imported by the tools run from this
directory)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from specdecode.machine import cpu_name
from specdecode.threads import GOVERNOR, default_threads

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


def write_record(out: Path, settings: dict, rows: list[dict]) -> None:
    """A timing tool's JSON record: what it measured (``settings``), the machine (torch's threads and capability, the
    CPU's name) and one entry per row count."""
    record = {
        **settings,
        "threads": torch.get_num_threads(),
        "capability": str(torch.backends.cpu.get_cpu_capability()),
        "cpu": cpu_name(),
        "rows": rows,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")


def add_forward_arguments(parser: argparse.ArgumentParser, rows: str, rounds: int) -> None:
    """The options of the tools that time a model's whole forwards: the model, its weights, the row counts, the context
    cached before them, the rounds and the JSON record's path."""
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--quantize", default="bf16", help="the target's weights, as --quantize")
    parser.add_argument("--rows", default=rows)
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--out", type=Path, required=True)


def pin_threads() -> None:
    """Time with a fixed thread count (``SPECDECODE_THREADS``, else the CPUs), as the benchmarks do: the thread governor
    would otherwise follow the host's load, and after a build of the kernels it ran a whole comparison on one thread."""
    GOVERNOR.pin(default_threads())
