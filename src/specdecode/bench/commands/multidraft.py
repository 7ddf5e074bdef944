"""``specdecode bench multidraft``: multi-draft verifiers against recursive rejection sampling, on toy models where
every number is exact (:mod:`specdecode.bench.multidraft`), or with ``--model`` on real prompts, each verifier judged
on the same drafts (:mod:`specdecode.bench.multidraft_prompts`)."""

from __future__ import annotations

import importlib
from typing import Any

from specdecode.bench.arguments import Arguments, Flag
from specdecode.bench.benchmark import Benchmark, register_benchmark

PROMPTS_MODULE = "specdecode.bench.multidraft_prompts"


@register_benchmark
class Multidraft(Benchmark):
    name = "multidraft"
    help = "k i.i.d. drafts per node: acceptance of spectr and optimal-md vs rejection sampling (toy models or --model)"
    description = (
        "Without --model: expected acceptance per node and tokens per step of i.i.d. draft trees on toy bigram "
        "models, computed exactly for each verifier, with the optimum alpha*. With --model: the quick prompts "
        "decoded with the eagle head drafting k i.i.d. draws per node, each step's draft verified --trials times by "
        "every verifier. Results go to --out (results.json, results.md)."
    )
    module = "specdecode.bench.multidraft"
    from_bench = ("model", "tasks", "prompts_per_task", "max_new_tokens", "threads")

    def arguments(self) -> Arguments:
        return {
            "drafts": Flag(metavar="K,...", help="drafts per node, comma-separated (default 1,2,4; with --model 4)"),
            "temperatures": Flag(
                metavar="T,...", help="temperatures > 0, comma-separated (default 0.5,0.8,1.0,1.5; with --model 0.8)"
            ),
            "vocab": Flag(type=int, metavar="N", help="tokens of the toy model (default 8)"),
            "noise": Flag(type=float, help="std of the noise added to the target's logits for the draft (default 1.5)"),
            "depth": Flag(type=int, metavar="N", help="levels of the draft tree (default 3)"),
            "trials": Flag(type=int, metavar="N", help="with --model: verifications of each step per verifier (32)"),
            "seed": "seed of the toy model's tables, or of the sampling (default 0)",
            "out": "output directory (default bench-out/multidraft, with --model bench-out/multidraft-prompts)",
        }

    def resolve(self, given: dict[str, Any]) -> Any:
        """The toy's settings, or with ``--model`` the prompts'; a flag of the other mode is an unknown setting."""
        module = self.implementation if given.get("model") is None else importlib.import_module(PROMPTS_MODULE)
        return module.resolve_settings(**given)

    def measure(self, settings: Any, progress: bool) -> Any:
        if hasattr(settings, "model"):
            return importlib.import_module(PROMPTS_MODULE).measure_prompt_multidraft(settings, progress)
        return self.implementation.measure_multidraft(settings)
