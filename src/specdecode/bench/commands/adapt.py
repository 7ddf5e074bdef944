"""``specdecode bench adapt``: online adaptation of a draft model (:mod:`specdecode.bench.adapt`)."""

from __future__ import annotations

from typing import Any

from specdecode.bench.arguments import THREADS_HELP, Arguments, Flag
from specdecode.bench.benchmark import Benchmark, register_benchmark


@register_benchmark
class Adapt(Benchmark):
    name = "adapt"
    help = "online adaptation of a draft model: mean accepted tokens per request, adapted against frozen"
    description = (
        "The first N problems of one domain in order (HumanEval, or the ShareGPT openings on one "
        "topic), greedy, each decoded by the frozen and the adapted drafter. Results go to --out (results.json, "
        "results.md, adapt.png); a rerun resumes what that directory holds."
    )
    files = "results.json, results.md, adapt.png"
    module = "specdecode.bench.adapt"

    def arguments(self) -> Arguments:
        return {
            "model": "target model (default qwen2.5-coder-1.5b)",
            "draft_model": Flag(help="draft model (default smollm2-135m)"),
            "vocab_mapping": Flag(
                metavar="{intersection,text,ngram,none}",
                help="across vocabularies (default text; none: the same vocabulary)",
            ),
            "task": Flag(metavar="{humaneval,sharegpt}", help="the domain (default humaneval)"),
            "topic": Flag(
                metavar="WORD",
                help="with --task sharegpt: the openings that mention WORD, in the dataset's order (default python)",
            ),
            "requests": Flag(type=int, metavar="N", help="requests in order (default 50)"),
            "max_new_tokens": "default 128",
            "num_draft_tokens": Flag(metavar="K", help="K (default 8), auto or heuristic"),
            "adapt_budget": Flag(type=float, metavar="F", help="training time / decoding time (default 0.1)"),
            "adapt_steps": Flag(type=int, metavar="N", help="most steps per request (default 8)"),
            "adapt_lr": Flag(type=float, metavar="LR", help="learning rate (default 1e-3)"),
            "out": "output directory (default bench-out/adapt)",
            "threads": THREADS_HELP,
            "quantize": Flag(metavar="MODE", help="the target's weights (default none)"),
            "quantize_draft": Flag(
                metavar="MODE",
                help="the draft model's weights (default none; quantized, it adapts fp32 copies of its last layers "
                "and head)",
            ),
            "progress": "no progress bar",
        }

    def measure(self, settings: Any, progress: bool) -> Any:
        return self.implementation.measure_adapt(settings, progress=progress)
