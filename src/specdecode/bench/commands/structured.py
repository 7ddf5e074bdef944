"""``specdecode bench structured``: structured outputs with speculation (:mod:`specdecode.bench.structured`)."""

from __future__ import annotations

from typing import Any

from specdecode.bench.arguments import QUANTIZE_MODES, THREADS_HELP, Arguments, Flag
from specdecode.bench.benchmark import Benchmark, register_benchmark


@register_benchmark
class Structured(Benchmark):
    name = "structured"
    help = "JSON extraction and classification under their schemas: plain vs each drafter, forced drafts on and off"
    description = (
        "Every prompt of the structured suites is decoded greedily, unconstrained and under its JSON schema, by plain "
        "decoding and by every method with the grammar's forced tokens drafted and not; results go to --out "
        "(results.json, results.md)."
    )
    module = "specdecode.bench.structured"

    def arguments(self) -> Arguments:
        return {
            "model": "target model (default smollm2-135m)",
            "methods": "comma-separated drafter specs (default pld,suffix,recycling)",
            "suites": Flag(metavar="SUITES", help="comma-separated: extraction, classification (default both)"),
            "max_new_tokens": "default 128",
            "quantize": Flag(metavar=QUANTIZE_MODES, help="weight-only quantization of the target (default none)"),
            "out": "output directory (default bench-out/structured)",
            "threads": THREADS_HELP,
            "servers": (
                "other OpenAI-compatible servers measured beside ours, e.g. vllm=http://127.0.0.1:8001 "
                "(label default: HOST:PORT); the schema sent as `response_format`"
            ),
            "served_model": "the model name those servers serve (default: --model)",
            "progress": "no progress bar",
        }

    def measure(self, settings: Any, progress: bool) -> Any:
        return self.implementation.measure_structured(settings, progress=progress)
