"""``specdecode bench forward-cost``: the cost curve of verification (:mod:`specdecode.bench.forward_cost`)."""

from __future__ import annotations

from typing import Any

from specdecode.bench.arguments import QUANTIZE_MODES, Arguments, Flag
from specdecode.bench.benchmark import Benchmark, register_benchmark
from specdecode.models.registry import DEFAULT_MODEL


@register_benchmark
class ForwardCost(Benchmark):
    name = "forward-cost"
    help = "time one forward over 1..N new tokens: the cost curve of verification"
    module = "specdecode.bench.forward_cost"

    def arguments(self) -> Arguments:
        return {
            "model": f"default {DEFAULT_MODEL}",
            "context_tokens": Flag(
                default="256",
                metavar="N[,N...]",
                help="cached tokens before the forward; several (comma-separated) compare their curves (default 256)",
            ),
            "max_new": Flag(type=int, default=16, metavar="N", help="largest number of new tokens (>= 8)"),
            "repeats": "default 5",
            "threads": "torch threads (default: torch's)",
            "quantize": Flag(metavar=QUANTIZE_MODES, help="weight-only quantization (default none)"),
            "json": Flag(action="store_true", help="print one JSON object"),
            "profile": Flag(action="store_true", help="also print per-operator profiles of 1- and 8-token forwards"),
        }

    def run(self, given: dict[str, Any], progress: bool) -> int:
        """Print the curve (nothing is written to disk)."""
        as_json, with_profiles = given.pop("json"), given.pop("profile")
        self.implementation.print_forward_cost(**given, as_json=as_json, with_profiles=with_profiles)
        return 0
