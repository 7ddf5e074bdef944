"""``specdecode bench contention``: decoding beside a busy process (:mod:`specdecode.bench.contention`)."""

from __future__ import annotations

from typing import Any

from specdecode.bench.arguments import Arguments
from specdecode.bench.benchmark import Benchmark, register_benchmark
from specdecode.models.registry import DEFAULT_MODEL


@register_benchmark
class Contention(Benchmark):
    name = "contention"
    help = "plain and pld tokens/s with one busy process beside us, against idle and against transformers"
    description = (
        "Every contestant decodes the prompts idle, then with one competing busy process. Results go "
        "to --out (results.json, results.md, contention.png); a rerun skips the cells that directory holds."
    )
    files = "results.json, results.md, contention.png"
    module = "specdecode.bench.contention"

    def arguments(self) -> Arguments:
        return {
            "model": f"target model (default {DEFAULT_MODEL})",
            "tasks": "comma-separated tasks (default edit,summarize,rag,humaneval)",
            "prompts_per_task": "default 1",
            "max_new_tokens": "default 64",
            "seed": "seed of the prompt selection (default 0)",
            "out": "output directory (default bench-out/contention)",
            "progress": "no progress lines",
        }

    def measure(self, settings: Any, progress: bool) -> Any:
        return self.implementation.run_contention(settings, progress=progress)
