"""``specdecode bench coupling``: coupled against rejection sampling (:mod:`specdecode.bench.coupling`)."""

from __future__ import annotations

from typing import Any

from specdecode.bench.arguments import QUANTIZE_MODES, THREADS_HELP, Arguments, Flag
from specdecode.bench.benchmark import Benchmark, register_benchmark


@register_benchmark
class Coupling(Benchmark):
    name = "coupling"
    help = "seeded sampling: acceptance of Gumbel-max coupling vs rejection sampling per drafter"
    description = (
        "Every method decodes every quick-suite prompt twice with the same seed, coupled and by "
        "rejection sampling; results go to --out (results.json, results.md)."
    )
    module = "specdecode.bench.coupling"

    def arguments(self) -> Arguments:
        return {
            "model": "target model (default smollm2-135m)",
            "methods": "comma-separated drafter specs (default pld,suffix,recycling,stand)",
            "tasks": "comma-separated tasks (default: all)",
            "prompts_per_task": "default 1",
            "max_new_tokens": "default 64",
            "temperature": Flag(type=float, help="sampling temperature, > 0 (default 0.8)"),
            "top_p": Flag(type=float, help="nucleus sampling, in (0, 1] (default 1.0: off)"),
            "seed": "sampling seed of every decode (default 0)",
            "quantize": Flag(
                metavar=QUANTIZE_MODES, help="weight-only quantization of the target and draft models (default none)"
            ),
            "out": "output directory (default bench-out/coupling)",
            "threads": THREADS_HELP,
            "progress": "no progress bar",
        }

    def measure(self, settings: Any, progress: bool) -> Any:
        return self.implementation.measure_coupling(settings, progress=progress)
