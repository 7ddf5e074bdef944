"""How far apart successive measurements of a model's verification cost curve land, by the rounds each takes.

The curve ``auto`` sizes drafts and trees by (:func:`specdecode.models.cost.relative_cost_curve`) is the fastest of a
few timed rounds over widths 1..16, normalised by width 1, then made non-decreasing
(:func:`specdecode.models.cost.timed_relative_curve`).  This measures ``--curves``
curves one after another for each round count in ``--rounds``, alternating the counts, in one process, as the
library would (nothing read from or written to the curve file), and records each curve and each width's spread.

    python tools/measure_curve_spread.py --model smollm2-135m --quantize bf16 --rounds 2,6 \\
        --out docs/results/DIR/curve-spread.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from specdecode.machine import cpu_name
from specdecode.models.cost import CURVE_CONTEXT_TOKENS, timed_relative_curve
from specdecode.models.loading import load_model

WIDTHS = 16


def curve(backend, rounds: int) -> list[float]:
    return [round(cost, 3) for cost in timed_relative_curve(backend, CURVE_CONTEXT_TOKENS, WIDTHS, rounds)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--quantize", default="bf16", help="the target's weights, as --quantize")
    parser.add_argument("--rounds", default="2,6", help="round counts to compare")
    parser.add_argument("--curves", type=int, default=4, help="curves measured for each round count")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    counts = [int(count) for count in args.rounds.split(",")]
    backend = load_model(args.model, quantize=args.quantize).backend
    curves: dict[int, list[list[float]]] = {count: [] for count in counts}
    for _ in range(args.curves):
        for count in counts:
            curves[count].append(curve(backend, count))
            print(count, curves[count][-1], flush=True)
    spread = {
        count: {
            width: [min(c[width - 1] for c in measured), max(c[width - 1] for c in measured)]
            for width in range(2, WIDTHS + 1)
        }
        for count, measured in curves.items()
    }
    record = {
        "model": args.model,
        "quantize": args.quantize,
        "context_tokens": CURVE_CONTEXT_TOKENS,
        "threads": torch.get_num_threads(),
        "cpu": cpu_name(),
        "capability": str(torch.backends.cpu.get_cpu_capability()),
        "curves": {str(count): measured for count, measured in curves.items()},
        "spread": {str(count): {str(w): s for w, s in widths.items()} for count, widths in spread.items()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    for count, widths in spread.items():
        print(count, "rounds:", {width: widths[width] for width in (9, 12, 16)})


if __name__ == "__main__":
    main()
