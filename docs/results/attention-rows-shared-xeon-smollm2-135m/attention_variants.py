"""Microseconds a layer of one ragged attention call for 1-17 new rows after 300 cached tokens, SmolLM2-135M's
attention shape (9 query heads, 3 key heads, head size 64, fp32 storage), for several versions of
``kernels/ragged_attention.cpp`` built side by side; rows beyond the first form a binary tree, as a verification's draft
does.  30 layers' storage is cycled through, as a forward does.  Each version's outputs are first compared bitwise with
the first's (every row count, 1 and 2 threads); the timings interleave the versions, round by round, and keep each one's
fastest of 15 rounds of 20 forwards' worth of calls.

    python attention_variants.py NAME=SOURCE.cpp [NAME=SOURCE.cpp ...] > out.json
"""

import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

from specdecode.models.cpu_kernels import ISA_FLAGS, KERNELS

HEADS, KV_HEADS, DIM, CAPACITY, PAST, LAYERS = 9, 3, 64, 1024, 300, 30
ROWS = range(1, 18)


def build(name: str, source: Path, workdir: Path):
    """The kernel in ``source`` as op namespace ``name`` (its TORCH_LIBRARY renamed)."""
    text = source.read_text().replace("TORCH_LIBRARY(specdecode_attention, m)", f"TORCH_LIBRARY({name}, m)")
    path = workdir / f"{name}.cpp"
    path.write_text(text)
    isa = str(torch.backends.cpu.get_cpu_capability())
    load(
        name=name,
        sources=[str(path)],
        extra_cflags=["-O3", "-fopenmp", *ISA_FLAGS.get(isa, ())],
        extra_ldflags=["-fopenmp"],
        extra_include_paths=[str(KERNELS)],
        is_python_module=False,
    )
    return getattr(torch.ops, name).ragged_attention


generator = torch.Generator().manual_seed(0)
keys = [torch.randn(1, KV_HEADS, CAPACITY, DIM, generator=generator) for _ in range(LAYERS)]
values = [torch.randn(1, KV_HEADS, CAPACITY, DIM, generator=generator) for _ in range(LAYERS)]
queries = {rows: torch.randn(HEADS, rows, DIM, generator=generator) for rows in ROWS}


def call_arguments(rows: int) -> tuple:
    mask = torch.zeros(rows, rows, dtype=torch.bool)
    for row in range(rows):
        node = row
        while node >= 0:
            mask[row, node] = True
            node = (node - 1) // 2 if node > 0 else -1
    return torch.tensor([[0, 0, rows, PAST, 0]]), mask.flatten(), torch.arange(PAST, PAST + rows)


def outputs(op, rows: int) -> torch.Tensor:
    out = torch.empty(rows, HEADS, DIM)
    op(queries[rows], keys[0], values[0], *call_arguments(rows), DIM**-0.5, 0, out)
    return out


def forward_seconds(op, rows: int) -> float:
    meta, mask, positions = call_arguments(rows)
    out = torch.empty(rows, HEADS, DIM)
    started = time.perf_counter()
    for _ in range(20):
        for layer in range(LAYERS):
            op(queries[rows], keys[layer], values[layer], meta, mask, positions, DIM**-0.5, 0, out)
    return (time.perf_counter() - started) / 20 / LAYERS


def main() -> None:
    versions = dict(argument.split("=", 1) for argument in sys.argv[1:])
    workdir = Path(tempfile.mkdtemp())
    try:
        ops = {name: build(f"attention_{name}", Path(source), workdir) for name, source in versions.items()}
    finally:
        shutil.rmtree(workdir)
    first = next(iter(ops.values()))
    threads = torch.get_num_threads()
    bitwise = {}
    for name, op in ops.items():
        same = True
        for count in (1, threads):
            torch.set_num_threads(count)
            same = same and all(torch.equal(outputs(op, rows), outputs(first, rows)) for rows in ROWS)
        torch.set_num_threads(threads)
        bitwise[name] = same
    best = {name: {rows: float("inf") for rows in ROWS} for name in ops}
    for rows in ROWS:
        for op in ops.values():
            forward_seconds(op, rows)  # warm
    for _ in range(15):
        for rows in ROWS:
            for name, op in ops.items():
                best[name][rows] = min(best[name][rows], forward_seconds(op, rows))
    us = {name: {rows: round(seconds * 1e6, 1) for rows, seconds in times.items()} for name, times in best.items()}
    json.dump({"threads": threads, "bitwise_equal_to_first": bitwise, "us_per_layer": us}, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
