"""The clients of ``specdecode bench serve``: the official ``openai`` client, streaming, in closed loops.

:func:`run_cell` sends every prompt through C client threads that each send their next request when their
previous one finished; :func:`stream_one` times one streamed request's chunks as they arrive.  Both run in
:class:`ClientProcess`, a child process, so that the clients never hold the server's interpreter lock.
"""

from __future__ import annotations

import multiprocessing
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from specdecode.bench.methods import DEFAULT_K, MethodSpec
from specdecode.errors import SpecDecodeError

REQUEST_TIMEOUT_S = 900.0


def stream_one(
    client: Any, model: str, chat: bool, text: str, method: MethodSpec | None, max_tokens: int
) -> dict[str, Any]:
    """One streamed request → its send/finish times, content chunks (arrival time, text), usage and metrics.
    ``method``: the drafter our server is asked for (None: another server, sent no ``speculative`` field)."""
    params: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if method is not None:
        speculative: dict[str, Any] = {"drafter": method.spec}
        if method.k != DEFAULT_K:
            speculative["num_draft_tokens"] = method.k
        params["extra_body"] = {"speculative": speculative}
    times: list[float] = []
    pieces: list[str] = []
    reply: dict[str, Any] = {"completion_tokens": None, "metrics": None, "finish_reason": None}
    sent = time.perf_counter()
    if chat:
        stream = client.chat.completions.create(messages=[{"role": "user", "content": text}], **params)
    else:
        stream = client.completions.create(prompt=text, **params)
    with stream:
        for chunk in stream:
            now = time.perf_counter()
            if chunk.choices:
                choice = chunk.choices[0]
                piece = choice.delta.content if chat else choice.text
                if piece:
                    times.append(now)
                    pieces.append(piece)
                reply["finish_reason"] = choice.finish_reason or reply["finish_reason"]
            if chunk.usage is not None:
                reply["completion_tokens"] = chunk.usage.completion_tokens
                reply["metrics"] = (chunk.model_extra or {}).get("metrics")
    finished = time.perf_counter()
    if reply["completion_tokens"] is None:
        raise SpecDecodeError("the stream ended without a usage chunk")
    return {**reply, "sent": sent, "finished": finished, "times": times, "pieces": pieces}


def one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def run_cell(
    client: Any,
    model: str,
    chat: bool,
    texts: Sequence[str],
    method: MethodSpec | None,
    concurrency: int,
    max_tokens: int,
) -> tuple[list[dict[str, Any]], float]:
    """All prompts through ``concurrency`` closed-loop client threads → (replies in input order, wall s)."""
    work: queue.SimpleQueue[int] = queue.SimpleQueue()
    for index in range(len(texts)):
        work.put(index)
    replies: list[dict[str, Any] | None] = [None] * len(texts)
    failures: list[tuple[int, BaseException]] = []

    def client_loop() -> None:
        while not failures:
            try:
                index = work.get_nowait()
            except queue.Empty:
                return
            try:
                replies[index] = stream_one(client, model, chat, texts[index], method, max_tokens)
            except Exception as exc:  # reported by the main thread
                failures.append((index, exc))
                return

    threads = [threading.Thread(target=client_loop, name=f"bench-client-{i}", daemon=True) for i in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        index, exc = failures[0]
        raise SpecDecodeError(
            f"request {index} of {method.spec if method else model!r} at concurrency {concurrency} failed: "
            + one_line(exc)
        )
    done = [r for r in replies if r is not None]
    return done, max(r["finished"] for r in done) - min(r["sent"] for r in done)


class ClientProcess:
    """The benchmark's clients, in a spawned child process that lives for the whole run.

    Client threads in the server's process would take the interpreter lock from the engine's thread between
    its torch calls and lengthen its steps (``docs/results/serve-bf16-clientproc-smollm2-135m``); real clients
    run elsewhere.  The child keeps one ``openai`` client (and its pooled connections) per server across cells."""

    def __init__(self) -> None:
        self.pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))

    def __enter__(self) -> ClientProcess:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)

    def stream_one(self, url: str, *args: Any) -> dict[str, Any]:
        return self.pool.submit(_in_child, url, stream_one, *args).result()

    def run_cell(self, url: str, *args: Any) -> tuple[list[dict[str, Any]], float]:
        return self.pool.submit(_in_child, url, run_cell, *args).result()

    def metrics(self, url: str) -> str:
        return self.pool.submit(metrics_text, url).result()

    def reset_prefix_cache(self, url: str) -> bool:
        return self.pool.submit(reset_prefix_cache, url).result()


_CHILD_CLIENTS: dict[str, Any] = {}


def _in_child(url: str, call: Callable[..., Any], *args: Any) -> Any:
    """``call(client, *args)`` in the client process, with that process's client of the server at ``url``."""
    if url not in _CHILD_CLIENTS:
        _CHILD_CLIENTS[url] = client_for(url)
    return call(_CHILD_CLIENTS[url], *args)


def client_for(url: str) -> Any:
    import openai  # optional (not even the server extra needs it): imported in the client process only

    # trust_env=False: a proxy configured for the outside world must not see loopback requests.
    http = openai.DefaultHttpxClient(trust_env=False, timeout=REQUEST_TIMEOUT_S)
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, http_client=http)


def metrics_text(url: str) -> str:
    """The Prometheus text of the server at ``url`` (empty where it has no ``/metrics``)."""
    import httpx  # comes with openai, as above

    response = httpx.get(f"{url}/metrics", timeout=30.0, trust_env=False)
    return response.text if response.status_code == 200 else ""


def reset_prefix_cache(url: str) -> bool:
    """Empty the prefix cache of the server at ``url`` (``POST /reset_prefix_cache``: ours, and vLLM's when it runs
    with ``VLLM_SERVER_DEV_MODE=1``); False where the server has no such endpoint or refused."""
    import httpx

    try:
        response = httpx.post(f"{url}/reset_prefix_cache", timeout=30.0, trust_env=False)
    except httpx.HTTPError:
        return False
    return response.status_code == 200
