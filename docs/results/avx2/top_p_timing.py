"""Top-p before and after the candidate nucleus (ccaa4ce), in one run: generate() with the old full-sort
``_top_p_drop`` and the current one, alternating, 3 repeats each, the best of each kept.

    python docs/results/avx2/top_p_timing.py smollm2-135m
    python docs/results/avx2/top_p_timing.py qwen2.5-coder-1.5b w4a8
"""

import sys
import time

import torch

import specdecode.sampling as sampling
from specdecode.generator import SpeculativeGenerator
from specdecode.models.loading import load_model


def full_sort_top_p_drop(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The code before: sort the whole vocabulary of every row."""
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    drop_sorted = mass_before >= top_p
    drop_sorted[..., 0] = False
    return torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)


def main(model_name: str, quantize: str = "none") -> None:
    candidates = sampling._top_p_drop
    model = load_model(model_name, quantize=quantize)
    prompt = "Write a short story about a lighthouse keeper who finds a message in a bottle."
    params = dict(chat=True, max_new_tokens=48, ignore_eos=True, temperature=0.7, top_p=0.9, seed=1)
    for drafter in ("none", "pld"):
        generator = SpeculativeGenerator.build(model, drafter)
        generator.generate(prompt, **{**params, "max_new_tokens": 4})
        speeds: dict[str, list[float]] = {"full sort": [], "candidates": []}
        outputs = {}
        for _ in range(3):
            for label, drop in (("full sort", full_sort_top_p_drop), ("candidates", candidates)):
                sampling._top_p_drop = drop
                start = time.perf_counter()
                result = generator.generate(prompt, **params)
                speeds[label].append(len(result.token_ids) / (time.perf_counter() - start))
                outputs[label] = result.token_ids
        sampling._top_p_drop = candidates
        best = {label: max(values) for label, values in speeds.items()}
        print(
            f"{model_name} {quantize} {drafter}: full sort {best['full sort']:.2f} tok/s, candidates "
            f"{best['candidates']:.2f} tok/s ({best['candidates'] / best['full sort']:.2f}x), "
            f"same tokens: {outputs['full sort'] == outputs['candidates']}",
            flush=True,
        )


if __name__ == "__main__":
    main(*sys.argv[1:])
