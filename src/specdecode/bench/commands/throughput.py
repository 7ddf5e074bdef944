"""``specdecode bench throughput``: batched decoding (:mod:`specdecode.bench.throughput`)."""

from __future__ import annotations

from typing import Any

from specdecode.bench.arguments import REQUESTS_TASKS_HELP, THREADS_HELP, Arguments, Flag
from specdecode.bench.benchmark import Benchmark, register_benchmark
from specdecode.models.registry import DEFAULT_MODEL


@register_benchmark
class Throughput(Benchmark):
    name = "throughput"
    help = "batched decoding: tokens/s and latency per method and batch size, vs transformers"
    description = (
        "All prompts are submitted at once to one batch engine per (method, batch size). Results go "
        "to --out (results.json, results.md, throughput.png); a rerun skips the cells that directory holds."
    )
    files = "results.json, results.md, throughput.png"
    module = "specdecode.bench.throughput"

    def arguments(self) -> Arguments:
        return {
            "model": f"target model (default {DEFAULT_MODEL})",
            "methods": "comma-separated drafter specs (default none,pld,suffix)",
            "batch_sizes": Flag(
                metavar="B,B,...", help="largest numbers of sequences decoding together (default 1,2,4,8)"
            ),
            "tasks": REQUESTS_TASKS_HELP,
            "prompts_per_task": "default 1",
            "max_new_tokens": "default 96",
            "seed": "seed of the prompt selection (default 0)",
            "out": "output directory (default bench-out/throughput)",
            "peers": Flag("--no-peers", action="store_false", help="skip transformers' batched generate()"),
            "threads": THREADS_HELP,
            "progress": "no progress bar",
        }

    def measure(self, settings: Any, progress: bool) -> Any:
        return self.implementation.run_throughput(settings, progress=progress)
