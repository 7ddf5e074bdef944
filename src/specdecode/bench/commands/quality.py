"""``specdecode bench quality``: relaxed verifiers' speed against quality (:mod:`specdecode.bench.quality`)."""

from __future__ import annotations

from typing import Any

from specdecode.bench.arguments import QUANTIZE_MODES, THREADS_HELP, Arguments, Flag
from specdecode.bench.benchmark import Benchmark, register_benchmark


@register_benchmark
class Quality(Benchmark):
    name = "quality"
    help = "relaxed (lossy) verifiers: speed-up against quality (HumanEval pass@1, CHAMP answers, chat), in one run"
    description = (
        "Every drafter decodes every selected problem with every verifier; HumanEval completions run "
        "against the problem's tests in a limited child process, CHAMP final answers are compared, chat answers "
        "are compared with the lossless ones. Results go to --out (results.json, results.md, quality.png); a rerun "
        "resumes what that directory holds."
    )
    files = "results.json, results.md, quality.png"
    module = "specdecode.bench.quality"

    def arguments(self) -> Arguments:
        return {
            "model": "target model (default smollm2-135m)",
            "methods": "comma-separated drafter specs (default pld,recycling)",
            "verifiers": Flag(
                help="comma-separated verifier specs NAME[:OPTION=VALUE...]; exact always runs "
                "(default exact,fly,fly:window=1,fly:entropy=0.05,typical)"
            ),
            "tasks": Flag(metavar="N", help="problems of the dataset, a seeded subset (default 20; HumanEval has 164)"),
            "dataset": Flag(
                help="humaneval: pass@1 by running the tests (default); champ: final-answer accuracy on CHAMP math; "
                "chat: MT-Bench/ShareGPT, equality with the lossless answer only"
            ),
            "seed": "seed of the subset (and of sampling) (default 0)",
            "max_new_tokens": "default 256",
            "temperature": Flag(type=float, help="0 = greedy (default)"),
            "timeout_s": Flag(type=float, help="per completion's tests (default 10)"),
            "memory_mb": Flag(type=int, help="address space of a test process (default 1024)"),
            "out": "output directory (default bench-out/quality)",
            "threads": THREADS_HELP,
            "quantize": "weights of the target (default none); lossless is against plain decoding of these weights",
            "quantize_draft": Flag(
                metavar=QUANTIZE_MODES, help="of the draft models (default int4, w4a8 on AVX2-only CPUs)"
            ),
            "progress": "no progress bar",
        }

    def measure(self, settings: Any, progress: bool) -> Any:
        return self.implementation.measure_quality(settings, progress=progress)
