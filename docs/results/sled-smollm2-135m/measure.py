"""Tokens per second of a client that drafts with prompt lookup and has a server verify (SLED, ``/v1/verify``),
against the server drafting with prompt lookup itself and against plain decoding, with a round trip of 0, 20 and
80 ms added in the client before every call (one call for a whole completion; one per step for SLED).  The server
is ``specdecode serve``'s (uvicorn beside the engine stepping in the main thread) on loopback, greedy, 64 tokens.

Run from the repository root: ``python docs/results/sled-smollm2-135m/measure.py``; writes ``results.json`` and
``results.md`` beside this file."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import httpx
import uvicorn

import specdecode
from specdecode.config import GenerationConfig
from specdecode.drafters import create_drafter
from specdecode.generator import SpeculativeGenerator
from specdecode.models.loading import load_model
from specdecode.server.app import ServerConfig, Service, create_app, uvicorn_config

MODEL = "smollm2-135m"
NEW_TOKENS = 64
DRAFT_TOKENS = 5
DELAYS_MS = (0, 20, 80)
PROMPTS = [
    "Repeat this list exactly, then add two more fruits: apple, banana, cherry, date, elderberry, fig.",
    "Here is a config file:\n\nserver:\n  host: 0.0.0.0\n  port: 8080\n  workers: 4\nlogging:\n  level: info\n"
    "  file: /var/log/app.log\n\nChange the port to 9090 and print the whole updated file.",
]
HERE = Path(__file__).resolve().parent


def completion(url: str, prompt: str, drafter: str, delay_s: float) -> tuple[list[int], float]:
    """The server decoding alone (``drafter`` none or pld): one round trip for the whole completion."""
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": NEW_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "speculative": {"drafter": drafter, "num_draft_tokens": DRAFT_TOKENS if drafter != "none" else 0},
    }
    tick = time.perf_counter()
    time.sleep(delay_s)
    answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300).json()
    return answer["choices"][0]["message"]["content"], time.perf_counter() - tick


def measure(url: str) -> list[dict]:
    completion(url, PROMPTS[0], "none", 0.0)  # warm-up: first-call allocations are not decoding
    rows = []
    for delay_ms in DELAYS_MS:
        delay_s = delay_ms / 1000
        remote = specdecode.remote(url, "pld", num_draft_tokens=DRAFT_TOKENS, round_trip_delay_s=delay_s)
        for index, prompt in enumerate(PROMPTS):
            plain_text, plain_s = completion(url, prompt, "none", delay_s)
            served_text, served_s = completion(url, prompt, "pld", delay_s)
            tick = time.perf_counter()
            sled = remote.generate(prompt, chat=True, max_new_tokens=NEW_TOKENS, ignore_eos=True)
            sled_s = time.perf_counter() - tick
            rows.append(
                {
                    "delay_ms": delay_ms,
                    "prompt": index,
                    "plain_tok_s": NEW_TOKENS / plain_s,
                    "server_pld_tok_s": NEW_TOKENS / served_s,
                    "sled_pld_tok_s": NEW_TOKENS / sled_s,
                    "sled_round_trips": sled.stats.steps,
                    "identical": plain_text == served_text == sled.text,
                }
            )
            print(rows[-1], flush=True)
        remote.close()
    return rows


def report(rows: list[dict]) -> str:
    lines = [
        f"# SLED on {MODEL}: a client drafting with pld, the server verifying (greedy, {NEW_TOKENS} tokens, "
        f"K = {DRAFT_TOKENS})",
        "",
        "| added round trip | prompt | plain (server) tok/s | pld on the server tok/s | SLED: pld on the client tok/s "
        "| SLED round trips | same text |",
        "|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['delay_ms']} ms | {row['prompt']} | {row['plain_tok_s']:.1f} | {row['server_pld_tok_s']:.1f} "
            f"| {row['sled_pld_tok_s']:.1f} | {row['sled_round_trips']} | {'yes' if row['identical'] else 'NO'} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    target = load_model(MODEL)
    generator = SpeculativeGenerator.build(target, "pld", GenerationConfig(num_draft_tokens=DRAFT_TOKENS))
    drafters = {"pld": generator.drafter, "none": create_drafter("none", target)}
    service = Service(generator, drafters, ServerConfig(model_name=MODEL, engine_thread=False))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn_config(create_app(service), host="127.0.0.1", port=port, log_level="warning"))
    http = threading.Thread(target=server.run, daemon=True)
    rows: list[dict] = []

    def client() -> None:
        try:
            while not server.started:
                time.sleep(0.05)
            rows.extend(measure(f"http://127.0.0.1:{port}"))
        finally:
            server.should_exit = True

    http.start()
    threading.Thread(target=client, daemon=True).start()
    service.worker.drive(alive=http.is_alive)  # the engine in the thread that loaded the model, as `serve` runs it
    http.join()
    (HERE / "results.json").write_text(json.dumps(rows, indent=1) + "\n")
    (HERE / "results.md").write_text(report(rows))
    print(report(rows))


if __name__ == "__main__":
    main()
