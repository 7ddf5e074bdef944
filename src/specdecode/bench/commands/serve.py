"""``specdecode bench serve``: the OpenAI-compatible server under load (:mod:`specdecode.bench.serve`)."""

from __future__ import annotations

from typing import Any

from specdecode.bench.arguments import QUANTIZE_MODES, REQUESTS_TASKS_HELP, THREADS_HELP, Arguments, Flag
from specdecode.bench.benchmark import Benchmark, register_benchmark
from specdecode.models.registry import DEFAULT_MODEL


@register_benchmark
class Serve(Benchmark):
    name = "serve"
    help = "the OpenAI-compatible server under closed-loop load: tokens/s, TTFT and ITL per method and concurrency"
    description = (
        "Loads the model once and starts one uvicorn server in this process on a free loopback port; "
        "per (method, concurrency C), C threads of the openai client replay every prompt, streamed. Results go to "
        "--out (results.json, results.md, serve.png); a rerun skips the cells that directory holds. --url adds "
        "other OpenAI-compatible servers (vLLM, SGLang, llama.cpp) to the same run, on the same prompts and client."
    )
    files = "results.json, results.md, serve.png"
    module = "specdecode.bench.serve"
    entry = "run_bench_serve"  # not run_serve: that runs `specdecode serve`
    from_bench = ("seed",)

    def arguments(self) -> Arguments:
        return {
            "model": f"target model (default {DEFAULT_MODEL})",
            "concurrency": Flag(metavar="C,C,...", help="closed-loop clients sending at once (default 1,4,8)"),
            "methods": "comma-separated drafter specs, all served at once (default none,pld,suffix)",
            "tasks": REQUESTS_TASKS_HELP,
            "prompts_per_task": "default 1",
            "max_new_tokens": "max_tokens of every request (default 96)",
            "max_batch_size": Flag(type=int, metavar="B", help="the server's batch (default: largest C)"),
            "out": "output directory (default bench-out/serve)",
            "threads": THREADS_HELP,
            "quantize": "weights of the served target (default none)",
            "quantize_draft": Flag(
                metavar=QUANTIZE_MODES,
                help="of the served draft models (default int4, w4a8 on AVX2-only CPUs; none with adapt=true)",
            ),
            "servers": (
                "other OpenAI-compatible servers measured beside ours, e.g. vllm=http://127.0.0.1:8001 "
                "(label default: HOST:PORT); sent no `speculative` field; speculation read from vLLM's /metrics"
            ),
            "served_model": "the model name those servers serve (default: --model)",
            "progress": "no progress bar",
        }

    def measure(self, settings: Any, progress: bool) -> Any:
        return self.implementation.run_serve_bench(settings, progress=progress)
