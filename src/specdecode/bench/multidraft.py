"""``specdecode bench multidraft``: how many more drafts the multi-draft verifiers keep than recursive rejection
sampling, on toy models where every number is exact.

A toy model is a bigram table: the target's next-token logits after each token, and a draft's, the target's plus
Gaussian noise (``--noise``), both at ``--temperature``.  A draft is a tree whose every node has k children drawn
i.i.d. from the draft, ``--depth`` levels deep.  For each verifier the probability of keeping a draft of each token at
a node is known in closed form from (p, q, k) — recursive rejection sampling (``exact`` without a seed) keeps x_j with
min(1, p_j(x_j) / q(x_j)), p_j the residual after j rejections; ``spectr`` and ``optimal-md`` by their plans — so the
expected accepted tokens of a step follow by recursion over the tree, the kept token being the next node's context:
no sampling noise, and every verifier judged on the same drafts.  Reported per k and temperature, averaged over the
vocabulary's tokens as the step's context: a node's acceptance (one level), alpha* (the optimum any lossless verifier
can reach at a node) and tokens per step (accepted + 1) of the whole tree.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from specdecode.bench import common
from specdecode.bench.methods import parse_int_list
from specdecode.errors import SpecDecodeError
from specdecode.verify.optimal_md import TransportPlan, optimal_acceptance
from specdecode.verify.spectr import KSequential

VERIFIERS = ("rejection", "spectr", "optimal-md")
DEFAULTS: dict[str, Any] = {
    "drafts": (1, 2, 4),
    "temperatures": (0.5, 0.8, 1.0, 1.5),
    "vocab": 8,
    "noise": 1.5,
    "depth": 3,
    "seed": 0,
    "out": "bench-out/multidraft",
}
#: Large enough that the transport programme never truncates a toy vocabulary (C(8 + 4, 4) = 495 multisets).
MAX_MULTISETS = 5000


@dataclass(frozen=True)
class MultidraftSettings:
    drafts: tuple[int, ...]
    temperatures: tuple[float, ...]
    vocab: int
    noise: float
    depth: int
    seed: int
    out: Any

    def __post_init__(self) -> None:
        common.check_positive_int_list("--drafts", self.drafts)
        common.check_positive_ints(("--vocab", self.vocab), ("--depth", self.depth))
        if not self.temperatures or not all(common.is_number(t) and t > 0 for t in self.temperatures):
            raise SpecDecodeError(f"--temperatures must be numbers > 0, got {self.temperatures!r}")
        if not common.is_number(self.noise) or self.noise < 0:
            raise SpecDecodeError(f"--noise must be a number >= 0, got {self.noise!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise SpecDecodeError(f"--seed must be an integer, got {self.seed!r}")


def parse_temperatures(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(t) for t in common.split_names(text))
    except ValueError:
        raise SpecDecodeError(f"--temperatures must be comma-separated numbers, got {text!r}") from None


def resolve_settings(**overrides: Any) -> MultidraftSettings:
    parsers = {"drafts": lambda text: parse_int_list(text, "--drafts"), "temperatures": parse_temperatures}
    return MultidraftSettings(**common.resolve_values(MultidraftSettings, DEFAULTS, overrides, "setting", parsers))


def rejection_kept(p: np.ndarray, q: np.ndarray, k: int) -> np.ndarray:
    """[V] the probability that recursive rejection sampling keeps a draft of each token, k i.i.d. drafts from q: the
    j-th is tried against p_j (p_0 = p, p_(j+1) = norm(max(p_j - q, 0)), whatever token was rejected)."""
    kept, reached, residual = np.zeros_like(p), 1.0, p
    for _ in range(k):
        overlap = np.minimum(residual, q)
        kept += reached * overlap
        reached *= 1.0 - overlap.sum()
        rest = np.maximum(residual - q, 0.0)
        if rest.sum() <= 0.0:
            break
        residual = rest / rest.sum()
    return kept


KEPT: dict[str, Callable[[np.ndarray, np.ndarray, int], np.ndarray]] = {
    "rejection": rejection_kept,
    "spectr": lambda p, q, k: KSequential.solve(p, q, k).kept,
    "optimal-md": lambda p, q, k: TransportPlan.solve(p, q, k, MAX_MULTISETS).kept,
}


def toy_tables(settings: MultidraftSettings, temperature: float) -> tuple[np.ndarray, np.ndarray]:
    """[V, V] the target's and the draft's next-token distributions after each token."""
    g = torch.Generator().manual_seed(settings.seed)
    target = 2.0 * torch.randn(settings.vocab, settings.vocab, generator=g, dtype=torch.float64)
    drafted = target + settings.noise * torch.randn(settings.vocab, settings.vocab, generator=g, dtype=torch.float64)
    return torch.softmax(target / temperature, -1).numpy(), torch.softmax(drafted / temperature, -1).numpy()


def tokens_per_step(kept: np.ndarray, depth: int) -> np.ndarray:
    """[V] expected tokens a step emits after each context token: ``kept[s, y]`` the probability of keeping a draft
    of y after s, each kept token the next level's context, ``depth`` levels, plus the target's own token."""
    accepted = np.zeros(kept.shape[0])
    for _ in range(depth):
        accepted = kept @ (1.0 + accepted)
    return 1.0 + accepted


def measure_cell(settings: MultidraftSettings, k: int, temperature: float) -> dict[str, Any]:
    target, drafted = toy_tables(settings, temperature)
    cell: dict[str, Any] = {"drafts": k, "temperature": temperature}
    for verifier, kept_by in KEPT.items():
        kept = np.stack([kept_by(p, q, k) for p, q in zip(target, drafted)])
        cell[verifier] = {
            "node_acceptance": float(kept.sum(axis=1).mean()),
            "tokens_per_step": float(tokens_per_step(kept, settings.depth).mean()),
        }
    cell["optimum_node_acceptance"] = float(np.mean([optimal_acceptance(p, q, k) for p, q in zip(target, drafted)]))
    return cell


def measure_multidraft(settings: MultidraftSettings) -> dict[str, Any]:
    cells = [measure_cell(settings, k, t) for k in settings.drafts for t in settings.temperatures]
    results = {"settings": common.settings_json(settings), "cells": cells}
    settings.out.mkdir(parents=True, exist_ok=True)
    (settings.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (settings.out / "results.md").write_text(markdown(results))
    return results


def markdown(results: dict[str, Any]) -> str:
    settings = results["settings"]
    lines = [
        f"Toy bigram model: {settings['vocab']} tokens, draft = target logits + N(0, {settings['noise']}^2) noise, "
        f"seed {settings['seed']}; trees of k i.i.d. children per node, {settings['depth']} levels.",
        "",
        "| k | temperature | node acceptance: rejection / spectr / optimal-md / alpha* "
        "| tokens per step: rejection / spectr / optimal-md | best over rejection |",
        "|---|---|---|---|---|",
    ]
    for cell in results["cells"]:
        node = " / ".join(f"{cell[v]['node_acceptance']:.3f}" for v in VERIFIERS)
        steps = [cell[v]["tokens_per_step"] for v in VERIFIERS]
        gain = max(steps[1:]) / steps[0] - 1.0
        lines.append(
            f"| {cell['drafts']} | {cell['temperature']:g} | {node} / {cell['optimum_node_acceptance']:.3f} "
            f"| {' / '.join(f'{s:.3f}' for s in steps)} | {gain:+.1%} |"
        )
    return "\n".join(lines) + "\n"
