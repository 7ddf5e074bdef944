"""A 16-node tree (plus the last token) through bf16 SmolLM2 after a 300-token prompt: the row-invariant attention
as batched per-bucket calls (``TreePlan``) against row by row, interleaved; then the same 17 tokens as a chain and
one token alone.  Run: ``python tree_forward_timing.py`` (output in ``tree_forward_timing.txt``)."""

from __future__ import annotations

import time

import torch

import specdecode.models.ragged as ragged
from specdecode.engine import ancestor_mask
from specdecode.models.base import SequenceInput
from specdecode.models.loading import load_model
from specdecode.types import Draft

REPEATS = 15
TREES = {
    "chainy16": [-1, 0, 1, 2, 3, 4, 5, 6, -1, 8, 9, 10, 0, 12, 1, 14],
    "bushy16": [-1, -1, -1, 0, 0, 1, 1, 2, 3, 3, 4, 5, 6, 8, 9, 10],
    "chain16": list(range(-1, 15)),
}


def summary(seconds: list[float]) -> str:
    ordered = sorted(seconds)
    return f"min {ordered[0] * 1e3:.1f} ms, median {ordered[len(ordered) // 2] * 1e3:.1f} ms"


def main() -> None:
    torch.set_num_threads(2)
    backend = load_model("smollm2-135m", quantize="bf16").backend
    prompt = torch.arange(100, 400)
    cache = backend.new_cache()
    backend.forward_batch([SequenceInput(prompt, cache, invariant=False)])

    def timed(inputs: SequenceInput) -> float:
        tick = time.perf_counter()
        backend.forward_batch([inputs])
        elapsed = time.perf_counter() - tick
        cache.crop(len(prompt))
        return elapsed

    batched = ragged.batches_are_row_invariant
    ways = {"batched": batched, "row by row": lambda *layout: False}
    for name, parents in TREES.items():
        tokens = list(range(500, 500 + len(parents)))
        depth: list[int] = []
        for parent in parents:
            depth.append(1 if parent < 0 else depth[parent] + 1)
        tree = SequenceInput(
            torch.tensor([5, *tokens]),
            cache,
            positions=len(prompt) + torch.tensor([0, *depth]),
            tree_mask=ancestor_mask(Draft(tokens, parents=parents)),
        )
        results: dict[str, list[float]] = {way: [] for way in ways}
        for _ in range(REPEATS):
            for way, probe in ways.items():
                ragged.batches_are_row_invariant = probe
                results[way].append(timed(tree))
        ragged.batches_are_row_invariant = batched
        print(name, {way: summary(seconds) for way, seconds in results.items()})
    chain = [timed(SequenceInput(torch.arange(5, 22), cache)) for _ in range(REPEATS)]
    print("17 tokens as a chain", summary(chain))
    alone = [timed(SequenceInput(torch.tensor([5]), cache)) for _ in range(REPEATS)]
    print("one token", summary(alone))


if __name__ == "__main__":
    main()
