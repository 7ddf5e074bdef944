"""``specdecode bench multidraft``: multi-draft verifiers against recursive rejection sampling on toy models
(:mod:`specdecode.bench.multidraft`)."""

from __future__ import annotations

from typing import Any

from specdecode.bench.arguments import Arguments, Flag
from specdecode.bench.benchmark import Benchmark, register_benchmark


@register_benchmark
class Multidraft(Benchmark):
    name = "multidraft"
    help = "k i.i.d. drafts per node: acceptance of spectr and optimal-md vs rejection sampling (toy models, exact)"
    description = (
        "Expected acceptance per node and tokens per step of i.i.d. draft trees on toy bigram models, computed "
        "exactly for each verifier, with the optimum alpha*; results go to --out (results.json, results.md)."
    )
    module = "specdecode.bench.multidraft"

    def arguments(self) -> Arguments:
        return {
            "drafts": Flag(metavar="K,...", help="drafts per node, comma-separated (default 1,2,4)"),
            "temperatures": Flag(metavar="T,...", help="temperatures > 0, comma-separated (default 0.5,0.8,1.0,1.5)"),
            "vocab": Flag(type=int, metavar="N", help="tokens of the toy model (default 8)"),
            "noise": Flag(type=float, help="std of the noise added to the target's logits for the draft (default 1.5)"),
            "depth": Flag(type=int, metavar="N", help="levels of the draft tree (default 3)"),
            "seed": "seed of the toy model's tables (default 0)",
            "out": "output directory (default bench-out/multidraft)",
        }

    def measure(self, settings: Any, progress: bool) -> Any:
        return self.implementation.measure_multidraft(settings)
