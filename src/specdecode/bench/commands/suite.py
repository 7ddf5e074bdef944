"""``specdecode bench`` itself: the Spec-Bench-style suite (:mod:`specdecode.bench.runner`).

Not a registered sub-command: its flags are ``bench``'s own, and a sub-command may take them from there."""

from __future__ import annotations

from typing import Any

from specdecode.bench.arguments import THREADS_HELP, Arguments, Flag
from specdecode.bench.benchmark import Benchmark


class BenchSuite(Benchmark):
    name = ""
    label = "bench"
    entry = "run_bench"
    help = "benchmark drafting methods against plain decoding and transformers on real prompts"
    description = (
        "Every flag left out takes the suite's value. Results go to --out "
        "(results.json, results.md, *.png); a rerun skips what that directory already holds."
    )
    files = "results.json, results.md, plots"
    module = "specdecode.bench.runner"

    def arguments(self) -> Arguments:
        return {
            "suite": Flag(
                # No ``choices=``: the suites live in bench.suites, which imports torch; resolve_settings refuses
                # others.
                metavar="{quick,full}",
                default="quick",
                help="quick: smollm2-135m, minutes; full: qwen2.5-coder-1.5b + 0.5b draft, hours",
            ),
            "model": "target model: registry short name, local dir or .gguf",
            "methods": "comma-separated drafter specs, e.g. none,pld:k=6,draft-model:M:k=4",
            "tasks": "comma-separated tasks (mt-bench,humaneval,champ,sharegpt,summarize,rag,edit,multi-edit); "
            "multi-edit is a session: related requests in a row, timed as a whole; by name only: complete (stdlib "
            "asyncio functions to complete, for rasd:datastore=<stdlib>/asyncio), longctx (long code and documents "
            "cut to --long-context-tokens, or longctx-N for N tokens)",
            "long_context_tokens": Flag(
                metavar="N,N,...",
                help="the prompt lengths in tokens the longctx task is run at, one task longctx-N each "
                "(default 4096,8192; cut to the model's context)",
            ),
            "prompts": Flag(
                metavar="FILE.jsonl",
                help="your own prompts instead of the built-in tasks: Spec-Bench's question.jsonl layout "
                '({"question_id", "category", "turns"}: the first turn) or ours ({"id", "task", "text"}); '
                "every prompt unless --tasks / --prompts-per-task choose fewer",
            ),
            "prompts_per_task": "prompts per task (sessions, for multi-edit)",
            "max_new_tokens": Flag(type=int, metavar="N"),
            "repeats": "timed runs per prompt (the median is reported)",
            "seed": "seed of the prompt selection (default 0)",
            "out": "output directory (default bench-out/<suite>)",
            "peers": Flag(
                metavar="LIST",
                help="peers run beside us, comma-separated: transformers (default), llamacpp (llama-cpp-python on "
                "the model's GGUF), openvino-int8, openvino-int4, openvino (both); absent extras are skipped with a "
                "message",
            ),
            "no_peers": Flag("--no-peers", dest="peers", action="store_false", default=None, help="no peers"),
            "threads": THREADS_HELP,
            "quantize": "weight-only quantization of our target (default none); transformers peers stay fp32",
            "quantize_draft": "of our draft models (default int4, w4a8 on AVX2-only CPUs; none with adapt=true)",
            "draft_lengths": Flag(
                metavar="K,K,...",
                help="draft lengths to sweep for every drafting method on the sweep tasks ('none': no sweep)",
            ),
            "sweep_tasks": Flag(help="comma-separated tasks for the draft-length sweep"),
            "drafter_state": Flag(
                choices=("request", "task"),
                help="request (default): our drafters start cold on every prompt (a multi-edit session "
                "still keeps its state from request to request); task: reset once per task and keep "
                "what they learn across its prompts in order (warm drafters)",
            ),
            "interleave": Flag(
                choices=("step", "request"),
                help="step (default): our methods decode each prompt in turns, a step at a time, each timed over "
                "its own turns, so load from other processes falls on all alike; request: one whole request after "
                "another (peers always run so)",
            ),
            "progress": "no progress bar",
        }

    def resolve(self, given: dict[str, Any]) -> Any:
        return self.implementation.resolve_flags(**given)

    def measure(self, settings: Any, progress: bool) -> Any:
        return self.implementation.run_benchmark(settings, progress=progress)
