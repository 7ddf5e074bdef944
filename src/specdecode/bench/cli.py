"""``specdecode bench`` (the Spec-Bench-style benchmark) and its sub-commands ``forward-cost``, ``throughput``,
``serve``, ``contention`` and ``coupling``."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

from specdecode.bench.adapt import add_adapt_command
from specdecode.bench.coupling import add_coupling_command
from specdecode.bench.quality import add_quality_command
from specdecode.errors import SpecDecodeError
from specdecode.models.registry import DEFAULT_MODEL


def add_bench_command(subparsers: argparse._SubParsersAction) -> None:
    """Add ``bench`` and its optional sub-commands ``forward-cost``, ``throughput`` and ``serve`` to the top-level
    parser."""
    bench = subparsers.add_parser(
        "bench",
        help="benchmark drafting methods against plain decoding and transformers on real prompts",
        description="Every flag left out takes the suite's value. Results go to --out "
        "(results.json, results.md, *.png); a rerun skips what that directory already holds.",
    )
    bench.add_argument(
        "--suite",
        # No ``choices=``: the suites live in bench.suites, which imports torch; resolve_settings refuses others.
        metavar="{quick,full}",
        default="quick",
        help="quick: smollm2-135m, minutes; full: qwen2.5-coder-1.5b + 0.5b draft, hours",
    )
    bench.add_argument("--model", help="target model: registry short name, local dir or .gguf")
    bench.add_argument("--methods", help="comma-separated drafter specs, e.g. none,pld:k=6,draft-model:M:k=4")
    bench.add_argument(
        "--tasks",
        help="comma-separated tasks (mt-bench,humaneval,champ,sharegpt,summarize,rag,edit,"
        "multi-edit); multi-edit is a session: related requests in a row, timed as a whole",
    )
    bench.add_argument(
        "--prompts",
        metavar="FILE.jsonl",
        help="your own prompts instead of the built-in tasks: Spec-Bench's question.jsonl layout "
        '({"question_id", "category", "turns"}: the first turn) or ours ({"id", "task", "text"}); '
        "every prompt unless --tasks / --prompts-per-task choose fewer",
    )
    bench.add_argument("--prompts-per-task", type=int, metavar="N", help="prompts per task (sessions, for multi-edit)")
    bench.add_argument("--max-new-tokens", type=int, metavar="N")
    bench.add_argument("--repeats", type=int, metavar="N", help="timed runs per prompt (the median is reported)")
    bench.add_argument("--seed", type=int, help="seed of the prompt selection (default 0)")
    bench.add_argument("--out", help="output directory (default bench-out/<suite>)")
    bench.add_argument(
        "--peers",
        metavar="LIST",
        help="peers run beside us, comma-separated: transformers (default), llamacpp (llama-cpp-python on the "
        "model's GGUF), openvino-int8, openvino-int4, openvino (both); absent extras are skipped with a message",
    )
    bench.add_argument("--no-peers", dest="peers", action="store_false", default=None, help="no peers")
    bench.add_argument("--threads", type=int, help="torch threads (default: number of cores)")
    bench.add_argument(
        "--quantize",
        metavar="{none,int8,int4,bf16,w4a8}",
        help="weight-only quantization of our target (default none); transformers peers stay fp32",
    )
    bench.add_argument(
        "--quantize-draft",
        metavar="{none,int8,int4,bf16,w4a8}",
        help="of our draft models (default int4, w4a8 on AVX2-only CPUs; none with adapt=true)",
    )
    bench.add_argument(
        "--draft-lengths",
        metavar="K,K,...",
        help="draft lengths to sweep for every drafting method on the sweep tasks ('none': no sweep)",
    )
    bench.add_argument("--sweep-tasks", help="comma-separated tasks for the draft-length sweep")
    bench.add_argument(
        "--drafter-state",
        choices=("request", "task"),
        help="request (default): our drafters start cold on every prompt (a multi-edit session "
        "still keeps its state from request to request); task: reset once per task and keep "
        "what they learn across its prompts in order (warm drafters)",
    )
    bench.add_argument(
        "--interleave",
        choices=("step", "request"),
        help="step (default): our methods decode each prompt in turns, a step at a time, each timed over its own "
        "turns, so load from other processes falls on all alike; request: one whole request after another "
        "(peers always run so)",
    )
    bench.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    bench.set_defaults(run=run_bench)

    commands = bench.add_subparsers(dest="bench_command", required=False)  # argparse lists every sub-command
    cost = commands.add_parser(
        "forward-cost", help="time one forward over 1..N new tokens: the cost curve of verification"
    )
    # SUPPRESS: ``bench --model M forward-cost`` keeps the M given before the sub-command.
    cost.add_argument("--model", default=argparse.SUPPRESS, help=f"default {DEFAULT_MODEL}")
    cost.add_argument("--context-tokens", type=int, default=256, metavar="N", help="cached tokens before the forward")
    cost.add_argument("--max-new", type=int, default=16, metavar="N", help="largest number of new tokens (>= 8)")
    cost.add_argument("--repeats", type=int, default=argparse.SUPPRESS, metavar="N", help="default 5")
    cost.add_argument("--threads", type=int, default=argparse.SUPPRESS, help="torch threads (default: torch's)")
    cost.add_argument(
        "--quantize",
        default=argparse.SUPPRESS,
        metavar="{none,int8,int4,bf16,w4a8}",
        help="weight-only quantization (default none)",
    )
    cost.add_argument("--json", action="store_true", help="print one JSON object")
    cost.add_argument(
        "--profile", action="store_true", help="also print per-operator profiles of 1- and 8-token forwards"
    )
    cost.set_defaults(run=run_forward_cost)

    throughput = commands.add_parser(
        "throughput",
        help="batched decoding: tokens/s and latency per method and batch size, vs transformers",
        description="All prompts are submitted at once to one batch engine per (method, batch size). Results go "
        "to --out (results.json, results.md, throughput.png); a rerun skips the cells that directory holds.",
    )
    # SUPPRESS: a flag given to ``bench`` before the sub-command is kept unless repeated after it.
    keep = argparse.SUPPRESS
    throughput.add_argument("--model", default=keep, help=f"target model (default {DEFAULT_MODEL})")
    throughput.add_argument("--methods", default=keep, help="comma-separated drafter specs (default none,pld,suffix)")
    throughput.add_argument(
        "--batch-sizes",
        default=keep,
        metavar="B,B,...",
        help="largest numbers of sequences decoding together (default 1,2,4,8)",
    )
    throughput.add_argument(
        "--tasks",
        default=keep,
        help="comma-separated tasks (default: all); every prompt, multi-edit's requests too, is an independent request",
    )
    throughput.add_argument("--prompts-per-task", type=int, default=keep, metavar="N", help="default 1")
    throughput.add_argument("--max-new-tokens", type=int, default=keep, metavar="N", help="default 96")
    throughput.add_argument("--seed", type=int, default=keep, help="seed of the prompt selection (default 0)")
    throughput.add_argument("--out", default=keep, help="output directory (default bench-out/throughput)")
    throughput.add_argument(
        "--no-peers", dest="peers", action="store_false", default=keep, help="skip transformers' batched generate()"
    )
    throughput.add_argument("--threads", type=int, default=keep, help="torch threads (default: number of cores)")
    throughput.add_argument(
        "--no-progress", dest="progress", action="store_false", default=keep, help="no progress bar"
    )
    throughput.set_defaults(run=run_throughput)

    serve = commands.add_parser(
        "serve",
        help="the OpenAI-compatible server under closed-loop load: tokens/s, TTFT and ITL per method and concurrency",
        description="Loads the model once and starts one uvicorn server in this process on a free loopback port; "
        "per (method, concurrency C), C threads of the openai client replay every prompt, streamed. Results go to "
        "--out (results.json, results.md, serve.png); a rerun skips the cells that directory holds.",
    )
    serve.add_argument("--model", default=keep, help=f"target model (default {DEFAULT_MODEL})")
    serve.add_argument(
        "--concurrency", default=keep, metavar="C,C,...", help="closed-loop clients sending at once (default 1,4,8)"
    )
    serve.add_argument(
        "--methods", default=keep, help="comma-separated drafter specs, all served at once (default none,pld,suffix)"
    )
    serve.add_argument(
        "--tasks",
        default=keep,
        help="comma-separated tasks (default: all); every prompt, multi-edit's requests too, is an independent request",
    )
    serve.add_argument("--prompts-per-task", type=int, default=keep, metavar="N", help="default 1")
    serve.add_argument(
        "--max-new-tokens", type=int, default=keep, metavar="N", help="max_tokens of every request (default 96)"
    )
    serve.add_argument(
        "--max-batch-size", type=int, default=keep, metavar="B", help="the server's batch (default: largest C)"
    )
    serve.add_argument("--out", default=keep, help="output directory (default bench-out/serve)")
    serve.add_argument("--threads", type=int, default=keep, help="torch threads (default: number of cores)")
    serve.add_argument(
        "--quantize",
        default=keep,
        metavar="{none,int8,int4,bf16,w4a8}",
        help="weights of the served target (default none)",
    )
    serve.add_argument(
        "--quantize-draft",
        default=keep,
        metavar="{none,int8,int4,bf16,w4a8}",
        help="of the served draft models (default int4, w4a8 on AVX2-only CPUs; none with adapt=true)",
    )
    serve.add_argument("--no-progress", dest="progress", action="store_false", default=keep, help="no progress bar")
    serve.set_defaults(run=run_bench_serve)

    contention = commands.add_parser(
        "contention",
        help="plain and pld tokens/s with one busy process beside us, against idle and against transformers",
        description="Every contestant decodes the prompts idle, then with one competing busy process. Results go "
        "to --out (results.json, results.md, contention.png); a rerun skips the cells that directory holds.",
    )
    contention.add_argument("--model", default=keep, help=f"target model (default {DEFAULT_MODEL})")
    contention.add_argument(
        "--tasks", default=keep, help="comma-separated tasks (default edit,summarize,rag,humaneval)"
    )
    contention.add_argument("--prompts-per-task", type=int, default=keep, metavar="N", help="default 1")
    contention.add_argument("--max-new-tokens", type=int, default=keep, metavar="N", help="default 64")
    contention.add_argument("--seed", type=int, default=keep, help="seed of the prompt selection (default 0)")
    contention.add_argument("--out", default=keep, help="output directory (default bench-out/contention)")
    contention.add_argument(
        "--no-progress", dest="progress", action="store_false", default=keep, help="no progress lines"
    )
    contention.set_defaults(run=run_bench_contention)
    add_coupling_command(commands)
    add_quality_command(commands)
    add_adapt_command(commands)


def run_bench(args: argparse.Namespace) -> int:
    from specdecode.bench.runner import run_benchmark
    from specdecode.bench.suites import resolve_settings
    from specdecode.data.prompt_file import read_prompt_file

    prompt_file = read_prompt_file(args.prompts) if args.prompts is not None else None
    for problem in prompt_file.skipped if prompt_file else ():
        print(f"specdecode: {problem}", file=sys.stderr)
    flags = ("model", "methods", "tasks", "prompts_per_task", "max_new_tokens", "repeats", "seed", "out", "peers")
    settings = resolve_settings(
        args.suite,
        prompts_file=prompt_file,
        **_flags(
            args,
            *flags,
            "threads",
            "draft_lengths",
            "sweep_tasks",
            "drafter_state",
            "interleave",
            "quantize",
            "quantize_draft",
        ),
    )
    return _run_and_print("bench", "results.json, results.md, plots", settings, run_benchmark, args.progress)


def _flags(args: argparse.Namespace, *names: str) -> dict[str, Any]:
    """The named flags' values for ``resolve_settings``: None where not given (a sub-command's suppressed flag
    given neither to it nor to ``bench`` is absent from ``args``)."""
    return {name: getattr(args, name, None) for name in names}


def _run_and_print(label: str, files: str, settings: Any, run: Callable[..., Any], progress: bool) -> int:
    """Run a benchmark into ``settings.out``, print its results.md, and say on stderr what it wrote and how long
    it took."""
    started = time.perf_counter()
    run(settings, progress=progress)
    print((settings.out / "results.md").read_text())
    print(
        f"[{label}] wrote {settings.out}/ ({files}) in {(time.perf_counter() - started) / 60:.1f} min",
        file=sys.stderr,
    )
    return 0


def run_forward_cost(args: argparse.Namespace) -> int:
    import torch

    from specdecode.bench.forward_cost import format_curve, measure_forward_cost, profile_forward
    from specdecode.models.loading import load_model
    from specdecode.models.quantize import check_quantize

    quantize = check_quantize(getattr(args, "quantize", None) or "none")
    if args.threads is not None:
        if args.threads < 1:
            raise SpecDecodeError(f"--threads must be a positive integer, got {args.threads}")
        torch.set_num_threads(args.threads)
    backend = load_model(args.model or DEFAULT_MODEL, quantize=quantize).backend
    try:
        cost = measure_forward_cost(
            backend, context_tokens=args.context_tokens, max_new=args.max_new, repeats=args.repeats or 5
        )
    except ValueError as exc:  # bad sizes: a user mistake, one line
        raise SpecDecodeError(str(exc)) from exc
    print(json.dumps({**cost.to_json(), "quantize": quantize}) if args.json else format_curve(cost))
    if args.profile:
        for n_new in (1, 8):
            print(profile_forward(backend, n_new, args.context_tokens), file=sys.stderr if args.json else sys.stdout)
    return 0


def run_throughput(args: argparse.Namespace) -> int:
    from specdecode.bench import throughput

    flags = ("model", "methods", "batch_sizes", "tasks", "prompts_per_task", "max_new_tokens", "seed", "out", "peers")
    settings = throughput.resolve_settings(**_flags(args, *flags, "threads"))
    files = "results.json, results.md, throughput.png"
    return _run_and_print("bench throughput", files, settings, throughput.run_throughput, args.progress)


def run_bench_serve(args: argparse.Namespace) -> int:
    from specdecode.bench import serve

    flags = ("model", "methods", "concurrency", "tasks", "prompts_per_task", "max_new_tokens", "max_batch_size")
    settings = serve.resolve_settings(**_flags(args, *flags, "seed", "out", "threads", "quantize", "quantize_draft"))
    files = "results.json, results.md, serve.png"
    return _run_and_print("bench serve", files, settings, serve.run_serve_bench, args.progress)


def run_bench_contention(args: argparse.Namespace) -> int:
    from specdecode.bench import contention

    settings = contention.resolve_settings(
        **_flags(args, "model", "tasks", "prompts_per_task", "max_new_tokens", "seed", "out")
    )
    files = "results.json, results.md, contention.png"
    return _run_and_print("bench contention", files, settings, contention.run_contention, args.progress)
