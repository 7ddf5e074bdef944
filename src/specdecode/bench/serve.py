"""``specdecode bench serve``: the OpenAI-compatible server under closed-loop load, per method and concurrency.

The model is loaded once and served by ONE real uvicorn server in this process (the server's own
:class:`~specdecode.server.app.Service` and app) on a free 127.0.0.1 port, with every listed method as a
served drafter (keyed by its spec, e.g. ``pld`` or ``pld:k=4``).  Every cell (method, concurrency C) replays
all prompts through the official ``openai`` client: C client threads pull from one shared queue of prompts
and each sends its next request when its previous one has finished (closed loop).  Requests are streamed
chat completions (a model without a chat template gets ``/v1/completions`` on the plain text) with
``stream_options.include_usage``, temperature 0, ``max_tokens`` = ``max_new_tokens`` and the method in
``extra_body={"speculative": {"drafter": METHOD}}``; the API has no ``ignore_eos``, so a request may end at
EOS and only the tokens the final usage chunk reports are counted.

The clients run in a child process of their own (spawned once per run): like real clients, they never
hold the server's interpreter lock, though they still share the machine's CPUs with it.

Timing is client side: a cell's wall time runs from its first send to its last finish; TTFT from a request's
send to its first content-bearing chunk; inter-token latency (ITL) is, for every later content-bearing chunk,
the gap since the previous one divided by the tokens that chunk carried, counted once per token.  A chunk's
tokens are counted by encoding its delta text with the served model's tokenizer (no special tokens, at least
one) after the cell, outside the timed part; results.json keeps every request's chunk gaps and token counts.

Every cell starts cold, like a fresh generator in ``bench throughput``: the served drafters and the
adaptive draft-length policies are reset while the server is idle, and so is the prefix cache of every server
that has vLLM's ``POST /reset_prefix_cache`` (ours; vLLM's with ``VLLM_SERVER_DEV_MODE=1``, which
``tools/vllm_cpu.py`` sets), so that no cell reads a prompt an earlier cell left cached (a cell's
``prefix_cache_reset`` says whether that worked); each method gets one untimed warm-up request first.
The reference for equality is method ``none`` at C=1 (always measured, first).
``results.json`` is written after every cell; a rerun with the same settings skips the cells it holds.

Other servers (``--url LABEL=URL,...``: vLLM, SGLang, llama.cpp, another specdecode) are measured in the same
run, by the same client process, on the same prompts, after ours: their cells are named by their labels.  Such a
server is sent the request without our ``speculative`` field, is asked for ``--served-model`` (default: the
model's name), cannot be reset between cells, and has its speculation read from its ``/metrics`` where it keeps
vLLM's counters (``vllm:spec_decode_num_drafts_total``, ``..._num_accepted_tokens_total``; ours have the same
names under ``specdecode:``): a cell's mean acceptance length is then 1 + accepted / drafts over the cell.

Needs the ``server`` extra, as ``specdecode serve`` does.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import uvicorn
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

from specdecode.bench import common
from specdecode.bench.methods import MethodSpec, draft_weights
from specdecode.bench.resume import other_settings_error, resume, run_fingerprint
from specdecode.bench.serve_client import ClientProcess, one_line
from specdecode.bench.serve_report import request_record, summarize_cell, write_report
from specdecode.config import GenerationConfig
from specdecode.data.tasks import TASK_NAMES, Task, load_tasks
from specdecode.drafters import create_drafter
from specdecode.errors import SpecDecodeError
from specdecode.generator import SpeculativeGenerator
from specdecode.models.loading import fast_path_default, load_model
from specdecode.models.quantize import check_quantize
from specdecode.server.app import ServerConfig, Service, create_app, freeze_startup_heap, uvicorn_config

SCHEMA_VERSION = 2  # 2: prefix caches reset before every cell
RESULTS_FILE = "results.json"
REFERENCE = "none"  # at concurrency 1: the outputs every cell is compared with
WARMUP_TOKENS = 8
DEFAULTS: dict[str, Any] = {
    "model": "smollm2-135m",
    "methods": "none,pld,suffix",
    "concurrency": "1,4,8",
    "tasks": TASK_NAMES,
    "prompts_per_task": 1,
    "max_new_tokens": 96,
    "max_batch_size": None,  # the largest concurrency
    "seed": 0,
    "out": "bench-out/serve",
    "quantize": "none",
    "quantize_draft": None,  # draft models, if any: as specdecode generate loads them (int4 on a CPU)
    "servers": "",  # other OpenAI-compatible servers, LABEL=URL,...
    "served_model": None,  # the model name those servers serve: default the model's
}
#: Prometheus counters of speculation as vLLM names them (and our server, under ``specdecode:``).
SPECULATION_COUNTERS = ("spec_decode_num_drafts_total", "spec_decode_num_accepted_tokens_total")
SPECULATION_PREFIXES = ("vllm:", "specdecode:")


def parse_servers(text: str) -> tuple[tuple[str, str], ...]:
    """``--url``: ``[LABEL=]URL,...`` → ((label, base URL without ``/v1``), ...); a URL without a label is
    labelled by its host and port."""
    servers = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        label, sep, url = part.partition("=") if "=" in part.split("://")[0] else ("", "", part)
        label, url = label.strip(), url.strip().rstrip("/").removesuffix("/v1")
        if (sep and not label) or not url.startswith(("http://", "https://")) or not url.split("://")[1]:
            raise SpecDecodeError(f"--url takes [LABEL=]http://HOST:PORT (comma-separated), got {part!r}")
        servers.append((label or url.split("://")[1], url))
    return tuple(servers)


def check_server_labels(servers: tuple[tuple[str, str], ...], methods: set[str]) -> None:
    """``--url``'s labels name one server each, and no method of ours."""
    labels = [label for label, _ in servers]
    clash = sorted({*labels} & methods | {x for x in labels if labels.count(x) > 1})
    if clash:
        raise SpecDecodeError(f"--url labels must be unique and differ from --methods: {', '.join(clash)}")


@dataclass(frozen=True)
class ServeSettings(common.PromptSettings):
    methods: tuple[MethodSpec, ...]
    concurrency: tuple[int, ...]
    max_batch_size: int
    threads: int
    quantize: str = "none"  # the target's weights (--quantize)
    quantize_draft: str | None = None  # the draft models' (--quantize-draft); None: no method has one
    servers: tuple[tuple[str, str], ...] = ()  # other servers measured beside ours: (label, base URL)
    served_model: str | None = None  # the model name they serve (None: ``model``)

    @property
    def remote_model(self) -> str:
        """The model name other servers are asked for."""
        return self.served_model or self.model

    def __post_init__(self) -> None:
        super().__post_init__()
        check_server_labels(self.servers, {m.spec for m in self.methods})
        check_quantize(self.quantize)
        if self.quantize_draft is not None:
            check_quantize(self.quantize_draft, "--quantize-draft")
        common.check_positive_int_list("--concurrency", self.concurrency)
        common.check_positive_ints(("--max-batch-size", self.max_batch_size), ("--threads", self.threads))


def resolve_settings(**overrides: Any) -> ServeSettings:
    """The defaults, overridden by every given (non-None) value; strings are parsed as on the command line."""
    parsers = {**common.cell_parsers("concurrency", "--concurrency"), "servers": parse_servers}
    values = common.resolve_values(ServeSettings, DEFAULTS, overrides, "serve benchmark setting", parsers)
    concurrency = values["concurrency"]
    if all(common.is_positive_int(c) for c in concurrency):  # else ServeSettings reports them as given
        concurrency = tuple(sorted(set(concurrency)))
    batch = values["max_batch_size"]
    return ServeSettings(
        **{
            **values,
            "concurrency": concurrency,
            "max_batch_size": batch if batch is not None else max(concurrency, default=1),
            "quantize_draft": draft_weights(values["methods"], values["quantize"], values["quantize_draft"]),
        }
    )


def cell_order(settings: ServeSettings) -> list[tuple[str, int]]:
    """Every (method, concurrency) to measure, in order: the reference (``none`` at C=1) first."""
    cells = [(REFERENCE, 1)]
    names = [*(m.spec for m in settings.methods), *(label for label, _ in settings.servers)]
    return cells + [(name, c) for name in names for c in settings.concurrency if (name, c) != (REFERENCE, 1)]


# --------------------------------------------------------------------------------------------------------
# The server (its clients: specdecode.bench.serve_client)


class InProcessServer:
    """uvicorn serving ``service`` in a thread of this process, on a loopback socket bound here (no race for
    the port)."""

    def __init__(self, service: Any) -> None:
        freeze_startup_heap()  # as specdecode serve does
        self.service = service
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.socket.bind(("127.0.0.1", 0))
        self.port = self.socket.getsockname()[1]
        app = create_app(service)
        config = uvicorn_config(app, port=self.port, log_level="error", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.socket]}, name="specdecode-bench-server", daemon=True
        )

    def __enter__(self) -> InProcessServer:
        self.thread.start()
        deadline = time.monotonic() + 120
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                self.__exit__()
                raise SpecDecodeError("the benchmark's in-process server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)
        self.socket.close()

    def wait_idle(self, timeout_s: float = 30.0) -> None:
        """Until the engine holds no request (the drafters may then be reset from this thread)."""
        worker = self.service.worker
        deadline = time.monotonic() + timeout_s
        while worker.running or worker.waiting:
            if time.monotonic() > deadline:
                raise SpecDecodeError("the benchmark server still has requests in flight after a cell")
            time.sleep(0.01)


# --------------------------------------------------------------------------------------------------------
# The run


def run_serve_bench(settings: ServeSettings, tasks: Sequence[Task] | None = None, progress: bool = True) -> dict:
    """Measure every cell not yet in ``settings.out``; write results.json, results.md and serve.png.

    ``tasks`` replaces the real prompt sets (tests inject tiny ones).  Returns the results JSON."""
    tasks = list(tasks) if tasks is not None else load_tasks(settings.tasks, settings.prompts_per_task, settings.seed)
    drafts = ("quantize_draft",) if settings.quantize_draft is not None else ()
    others = ("servers", "served_model") if settings.servers else ()
    fingerprint = run_fingerprint(settings, tasks, "max_batch_size", "quantize", *drafts, *others)
    path = settings.out / RESULTS_FILE

    def same_benchmark(previous: dict[str, Any]) -> dict[str, Any]:
        if previous.get("benchmark") != "serve" or previous.get("schema_version") != SCHEMA_VERSION:
            raise SpecDecodeError(
                f"{path} holds results of another benchmark or version: choose another --out or empty it"
            )
        return previous

    def refusal(old: dict[str, Any]) -> SpecDecodeError:
        return other_settings_error(path, old, fingerprint, [("max batch size", "max_batch_size")])

    previous = resume(path, fingerprint, refusal=refusal, admit=same_benchmark)
    results = previous or common.new_results(SCHEMA_VERSION, fingerprint, benchmark="serve")

    def measure(pending: list[tuple[str, int]]) -> None:
        _measure(settings, tasks, pending, results, progress)

    return common.run_cells(results, settings, cell_order(settings), "concurrency", measure, write_report, path)


def _measure(
    settings: ServeSettings, tasks: Sequence[Task], pending: list[tuple[str, int]], results: dict, progress: bool
) -> None:
    methods = {m.spec: m for m in settings.methods}
    methods.setdefault(REFERENCE, MethodSpec("none", spec=REFERENCE))
    remote = dict(settings.servers)
    needed = [methods[name] for name in dict.fromkeys(name for name, _ in pending) if name not in remote]
    needed = needed or [methods[REFERENCE]]  # our server runs for the tokenizer's sake at least
    target = load_model(settings.model, quantize=settings.quantize)
    drafts = {
        name: load_model(name, quantize=settings.quantize_draft or settings.quantize)
        for name in sorted({m.draft_model for m in needed} - {None})
    }
    encode = common.PromptEncoder(target, settings.model, settings.max_new_tokens)
    chat = encode.chat  # a base model gets /v1/completions
    encoded = encode.encode_tasks(tasks)
    keys, texts = [e.key for e in encoded], [e.text for e in encoded]
    drafters = {m.spec: create_drafter(m.drafter, target, **common.drafter_options(m, drafts)) for m in needed}
    generator = SpeculativeGenerator(target, drafters[needed[0].spec], GenerationConfig())
    max_queue = max(c for _, c in pending)
    config = ServerConfig(
        settings.model, max_batch_size=settings.max_batch_size, max_queue=max_queue, drain_s=5.0, engine_thread=False
    )
    service = Service(generator, drafters, config)
    results["chat_template"] = chat
    results["endpoint"] = "/v1/chat/completions" if chat else "/v1/completions"
    results["server"] = {"max_batch_size": settings.max_batch_size, "max_queue": max_queue, "host": "127.0.0.1"}
    if remote:
        results["servers"] = {label: {"url": url, "model": settings.remote_model} for label, url in remote.items()}
    results["prompts"] = [{"prompt": e.key, "prompt_tokens": len(e.ids)} for e in encoded]
    versions = common.package_versions(("openai", "uvicorn", "uvloop", "httptools", "fastapi"))
    results["environment"] = {**common.environment(settings.threads), **versions, "fast_path": fast_path_default()}
    started = time.perf_counter()
    with (
        InProcessServer(service) as server,
        ClientProcess() as clients,
        tqdm(total=len(pending), unit="cell", desc="bench serve", disable=not progress, dynamic_ncols=True) as bar,
    ):
        ours = f"http://127.0.0.1:{server.port}"

        def measure_cells() -> None:
            warm: set[str] = set()
            for name, concurrency in pending:
                bar.set_postfix_str(f"{name} C={concurrency}", refresh=False)
                url = remote.get(name, ours)
                method = None if name in remote else methods[name]
                model = settings.remote_model if name in remote else settings.model
                if name not in warm:  # first-call allocations, the cost curve, the HTTP path: not measured
                    try:
                        clients.stream_one(url, model, chat, texts[0], method, WARMUP_TOKENS)
                    except Exception as exc:
                        raise SpecDecodeError(f"warm-up request of {name!r} failed: {one_line(exc)}") from exc
                    warm.add(name)
                server.wait_idle()
                for drafter in drafters.values():  # every cell starts cold
                    drafter.reset()
                generator.reset_drafter()  # also forgets what the adaptive draft-length policies learned
                cold = clients.reset_prefix_cache(url)  # no prompt of an earlier cell is cached
                before = speculation_counters(clients.metrics(url)) if name in remote else {}
                replies, wall_s = clients.run_cell(
                    url, model, chat, texts, method, concurrency, settings.max_new_tokens
                )
                server.wait_idle()
                records = [request_record(key, reply, target.tokenizer) for key, reply in zip(keys, replies)]
                cell = summarize_cell(name, concurrency, records, wall_s, _reference(results))
                cell["prefix_cache_reset"] = cold
                if name in remote:
                    cell["mean_acceptance_length"] = acceptance_over(before, speculation_counters(clients.metrics(url)))
                nonlocal started
                started = common.add_cell(results, cell, settings.out / RESULTS_FILE, started)
                bar.update()

        # The engine steps in this thread, which loaded the model (see specdecode.server.worker: torch is slower
        # in a thread of its own); the cells are driven from another.
        run_beside(measure_cells, service.worker.drive)
    results["environment"]["load_average_end"] = common.load_average()


def run_beside(work: Callable[[], None], drive: Callable[[Callable[[], bool]], None]) -> None:
    """Run ``work`` in a new thread while ``drive(alive)`` steps the engine in this one until ``work`` is done;
    ``work``'s exception is raised here."""
    failure: list[BaseException] = []

    def guarded() -> None:
        try:
            work()
        except BaseException as exc:  # re-raised in the calling thread
            failure.append(exc)

    thread = threading.Thread(target=guarded, name="bench-serve-cells", daemon=True)
    thread.start()
    drive(thread.is_alive)
    thread.join()
    if failure:
        raise failure[0]


def speculation_counters(text: str) -> dict[str, float]:
    """The speculation counters of a server's Prometheus text, summed over their labels, by name without prefix."""
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            prefix = next((p for p in SPECULATION_PREFIXES if sample.name.startswith(p)), None)
            if prefix is not None and sample.name[len(prefix) :] in SPECULATION_COUNTERS:
                name = sample.name[len(prefix) :]
                found[name] = found.get(name, 0.0) + sample.value
    return found


def acceptance_over(before: dict[str, float], after: dict[str, float]) -> float | None:
    """Mean acceptance length over a cell (1 + accepted / drafts, vLLM's definition), or None where the server
    reported no drafts."""
    drafts = after.get("spec_decode_num_drafts_total", 0.0) - before.get("spec_decode_num_drafts_total", 0.0)
    accepted = after.get("spec_decode_num_accepted_tokens_total", 0.0) - before.get(
        "spec_decode_num_accepted_tokens_total", 0.0
    )
    return 1 + accepted / drafts if drafts > 0 else None


def _reference(results: dict[str, Any]) -> dict[str, str] | None:
    """The texts of method ``none`` at C=1 by prompt key, once measured."""
    cell = next((c for c in results["cells"] if (c["method"], c["concurrency"]) == (REFERENCE, 1)), None)
    return None if cell is None else {r["prompt"]: r["text"] for r in cell["per_request"]}
