"""`specdecode serve` for real: uvicorn on a random loopback port, driven by the official `openai` client and
by raw HTTP for what the client cannot send (bad JSON, wrong types, no API key)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import torch
import uvicorn

from specdecode.cli import main
from specdecode.generator import SpeculativeGenerator
from specdecode.models.loading import load_model
from specdecode.server.app import ServerConfig, Service, create_app
from specdecode.server.protocol import CompletionRequest

CHAT = [{"role": "user", "content": "w1 w2 w3 w4 w1 w2 w3"}]
TEXT = "w5 w6 w7 w5 w6 w7 w5"


class RunningServer:
    """uvicorn serving an app in a background thread on a free loopback port."""

    def __init__(self, service: Service) -> None:
        self.service = service
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.server = uvicorn.Server(
            uvicorn.Config(
                create_app(service), host="127.0.0.1", port=self.port, log_level="error", timeout_graceful_shutdown=2
            )
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> RunningServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)

    def client(self, api_key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=60)


def make_service(target, drafter="pld", **config) -> Service:
    from specdecode.drafters import create_drafter

    generator = SpeculativeGenerator.build(target, drafter)
    drafters = {
        drafter: generator.drafter,
        "none": create_drafter("none", target),
        "suffix": create_drafter("suffix", target),
    }
    return Service(generator, drafters, ServerConfig(model_name="tiny", **config))


@pytest.fixture(scope="module")
def server(tiny_target):
    with RunningServer(make_service(tiny_target)) as running:
        yield running


def solo(target, prompt, chat: bool, n: int, **params):
    return SpeculativeGenerator.build(target, "none").generate(prompt, chat=chat, max_new_tokens=n, **params)


def test_chat_and_completions_equal_solo_greedy_output_streamed_or_not(server, tiny_target):
    client = server.client()
    want_chat = solo(tiny_target, CHAT, True, 24)
    chat = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=24, temperature=0)
    assert chat.choices[0].message.content == want_chat.text
    assert chat.usage.completion_tokens == len(want_chat.token_ids)
    assert chat.usage.prompt_tokens == want_chat.prompt_tokens
    spec = chat.model_extra["metrics"]["speculative_decoding"]
    assert {
        "num_drafts",
        "num_draft_tokens",
        "num_accepted_tokens",
        "mean_acceptance_length",
        "draft_acceptance_rate",
        "acceptance_per_position",
    } <= set(spec)

    stream = client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=24, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want_chat.text
    assert chunks[-1].usage.completion_tokens == len(want_chat.token_ids)
    assert "speculative_decoding" in chunks[-1].model_extra["metrics"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in {"stop", "length"}

    want_text = solo(tiny_target, TEXT, False, 20, ignore_eos=False)
    done = client.completions.create(model="tiny", prompt=TEXT, max_tokens=20)
    assert done.choices[0].text == want_text.text
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(model="tiny", prompt=TEXT, max_tokens=20, stream=True)
        if c.choices
    )
    assert streamed == want_text.text


def test_stop_strings_and_per_request_speculation(server, tiny_target):
    client = server.client()
    full = solo(tiny_target, TEXT, False, 30)
    stop = " ".join(full.text.split()[3:5])
    cut = client.completions.create(model="tiny", prompt=TEXT, max_tokens=30, stop=[stop])
    assert cut.choices[0].text == full.text[: full.text.index(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(model="tiny", prompt=TEXT, max_tokens=30, stop=[stop], stream=True)
        if c.choices
    )
    assert streamed == cut.choices[0].text
    plain = client.completions.create(
        model="tiny", prompt=TEXT, max_tokens=30, extra_body={"speculative": {"drafter": "none"}}
    )
    assert plain.model_extra["metrics"]["speculative_decoding"]["num_drafts"] == 0
    deep = client.completions.create(
        model="tiny",
        prompt=TEXT,
        max_tokens=30,
        extra_body={"speculative": {"drafter": "suffix", "num_draft_tokens": 6}},
    )
    assert plain.choices[0].text == deep.choices[0].text == full.text


def test_metrics_agree_with_responses(server, tiny_target):
    client = server.client()
    before = _scrape(server.url)
    done = client.completions.create(model="tiny", prompt=TEXT, max_tokens=16)
    after = _scrape(server.url)
    spec = done.model_extra["metrics"]["speculative_decoding"]
    assert (
        after["specdecode:spec_decode_num_draft_tokens_total"]
        - before.get("specdecode:spec_decode_num_draft_tokens_total", 0)
        == spec["num_draft_tokens"]
    )
    assert (
        after["specdecode:spec_decode_num_accepted_tokens_total"]
        - before.get("specdecode:spec_decode_num_accepted_tokens_total", 0)
        == spec["num_accepted_tokens"]
    )
    assert after["specdecode:generation_tokens_total"] - before.get("specdecode:generation_tokens_total", 0) == 16
    assert after["specdecode:num_requests_running"] == 0
    assert "specdecode:time_to_first_token_seconds_count" in after
    assert "specdecode:inter_token_latency_seconds_count" in after


def _scrape(url: str) -> dict[str, float]:
    values = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


BAD = [
    ("not json", 400),
    (json.dumps({"messages": CHAT, "temperature": "hot"}), 400),
    (json.dumps({"messages": CHAT, "temperature": 5}), 400),
    (json.dumps({"messages": CHAT, "max_tokens": 0}), 400),
    (json.dumps({"messages": CHAT, "n": 0}), 400),
    (json.dumps({"messages": CHAT, "n": 129}), 400),  # more than OpenAI allows
    (json.dumps({"messages": CHAT, "n": 100}), 400),  # more than the queue holds
    (json.dumps({"messages": []}), 400),
    (json.dumps({"messages": [{"role": "wizard", "content": "x"}]}), 400),
    (json.dumps({"messages": CHAT, "speculative": {"drafter": "nope"}}), 400),
    (json.dumps({"messages": CHAT, "speculative": {"num_draft_tokens": "many"}}), 400),
    (json.dumps({"messages": [{"role": "user", "content": "w1 " * 400}]}), 400),  # longer than the context
    (json.dumps({"messages": [{"role": "user", "content": " \n\t "}]}), 400),  # blank
    (json.dumps({"messages": CHAT, "seed": 1, "coupled": "no"}), 400),
    (json.dumps({"messages": CHAT, "seed": 1, "coupled": 0}), 400),
    (json.dumps({"messages": CHAT, "model": "gpt-9"}), 404),
    (json.dumps([1, 2, 3]), 400),
    (json.dumps({"messages": [{"role": "user", "content": []}]}), 400),  # no parts
    (json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}), 400),
]


@pytest.mark.parametrize("body,status", BAD, ids=range(len(BAD)))
def test_bad_input_gets_a_4xx_with_an_error_object(server, body, status):
    response = httpx.post(
        f"{server.url}/v1/chat/completions", content=body, headers={"content-type": "application/json"}
    )
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]


def test_an_unknown_field_is_a_400_with_strict_api(tiny_target):
    with RunningServer(make_service(tiny_target, strict_api=True)) as strict:
        for body in ({"messages": CHAT, "colour": "blue"}, {"messages": CHAT, "stream_options": {"hue": 1}}):
            response = httpx.post(f"{strict.url}/v1/chat/completions", json=body)
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["message"] and error["type"] and error["message"].endswith("unsupported field")
        document = httpx.get(f"{strict.url}/openapi.json").json()
        assert document["components"]["schemas"]["ChatCompletionRequest"]["additionalProperties"] is False


def test_a_body_that_is_not_json_is_named_so(server):
    response = httpx.post(
        f"{server.url}/v1/completions", content='{"prompt":', headers={"content-type": "application/json"}
    )
    error = response.json()["error"]
    assert (
        response.status_code == 400 and error["message"].startswith("the body is not valid JSON") and not error["param"]
    )


def test_text_parts_of_a_message_are_its_text_joined_by_newlines(server, tiny_target):
    """The OpenAI clients may send a message's content as a list of text parts; vLLM joins them with newlines."""
    parts = [{"type": "text", "text": "w1 w2"}, {"type": "text", "text": "w3"}]
    chat = server.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": parts}], max_tokens=8, temperature=0
    )
    want = solo(tiny_target, [{"role": "user", "content": "w1 w2\nw3"}], True, 8)
    assert chat.choices[0].message.content == want.text


def test_coupled_false_opts_a_seeded_request_out_of_coupling(server):
    async def sampling(**fields):  # the config a request would decode with (submission needs a running loop)
        body = CompletionRequest(prompt=TEXT, temperature=0.8, seed=1, **fields)
        return server.service.submission(body, chat=False).config.sampling

    assert asyncio.run(sampling()).is_coupled and asyncio.run(sampling(coupled=True)).is_coupled
    assert not asyncio.run(sampling(coupled=False)).is_coupled
    done = server.client().completions.create(
        model="tiny", prompt=TEXT, max_tokens=4, temperature=0.8, seed=1, extra_body={"coupled": False}
    )
    assert done.usage.completion_tokens >= 1


def test_bad_completion_prompt_and_unknown_route(server):
    assert httpx.post(f"{server.url}/v1/completions", json={"prompt": [-1]}).status_code == 400
    assert httpx.post(f"{server.url}/v1/completions", json={"prompt": ""}).status_code == 400
    blank = httpx.post(f"{server.url}/v1/completions", json={"prompt": "   \n"})
    assert blank.status_code == 400 and blank.json()["error"]["message"] == "prompt is blank (only whitespace)"
    assert httpx.get(f"{server.url}/v1/nothing").json()["error"]["type"] == "not_found_error"
    assert httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"] == "tiny"


def test_api_key_guards_everything_but_health(tiny_target):
    with RunningServer(make_service(tiny_target, api_key="sesame")) as running:
        assert httpx.get(f"{running.url}/health").status_code == 200
        for path in ("/v1/models", "/metrics"):
            response = httpx.get(f"{running.url}{path}")
            assert response.status_code == 401 and response.json()["error"]["type"] == "authentication_error"
        with pytest.raises(openai.AuthenticationError):
            running.client("wrong").models.list()
        assert running.client("sesame").models.list().data[0].id == "tiny"


def test_full_queue_answers_429_with_retry_after(tiny_target):
    service = make_service(tiny_target, max_batch_size=1, max_queue=0, drain_s=0.0)
    service.worker.start = lambda: None  # a worker that never steps: the first request keeps the only place
    with RunningServer(service) as running:
        first = threading.Thread(
            target=lambda: httpx.post(f"{running.url}/v1/completions", json={"prompt": TEXT}, timeout=5), daemon=True
        )
        first.start()
        deadline = time.monotonic() + 10
        while not service.worker.waiting:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        response = httpx.post(f"{running.url}/v1/completions", json={"prompt": TEXT, "max_tokens": 4})
        assert response.status_code == 429 and response.headers["retry-after"]
        assert response.json()["error"]["type"] == "rate_limit_error"


def test_load_with_disconnects_leaves_no_sequence_and_no_5xx(tiny_target):
    """200 requests, 16 at a time, a fifth of them dropped mid-stream: no 5xx, every completed greedy output
    equal to its solo output, nothing left running, memory bounded."""
    import psutil

    prompts = [f"w{i % 50 + 1} w{i % 7 + 2} w{i % 5 + 3} w{i % 50 + 1} w{i % 7 + 2}" for i in range(200)]
    expected = {p: solo(tiny_target, p, False, 12, ignore_eos=False).text for p in set(prompts)}
    with RunningServer(make_service(tiny_target, max_batch_size=8, max_queue=64)) as running:
        rss_before = psutil.Process().memory_info().rss

        def one(index: int) -> tuple[int, str | None]:
            body = {"prompt": prompts[index], "max_tokens": 12, "stream": True}
            with httpx.stream("POST", f"{running.url}/v1/completions", json=body, timeout=60) as response:
                if response.status_code != 200:
                    return response.status_code, None
                text = ""
                for line in response.iter_lines():
                    if index % 5 == 0:
                        return 200, None  # disconnect after the first event
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        text += "".join(c["text"] for c in chunk["choices"])
                return 200, text

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            outcomes = list(pool.map(one, range(200)))
        assert all(status < 500 for status, _ in outcomes)
        completed = [(i, text) for i, (status, text) in enumerate(outcomes) if text is not None]
        assert len(completed) >= 150
        assert all(text == expected[prompts[i]] for i, text in completed)
        deadline = time.monotonic() + 10
        while running.service.worker.running or running.service.worker.waiting:
            assert time.monotonic() < deadline, "sequences leaked"
            time.sleep(0.05)
        assert running.service.worker.engine.pool.active == 0
        assert psutil.Process().memory_info().rss - rss_before < 200 * 2**20


def test_serve_cli_exits_cleanly_on_sigterm_and_rejects_bad_flags(tiny_dirs, capsys):
    assert main(["serve", "--model", str(tiny_dirs["target"]), "--drafter", "nope"]) == 2
    assert main(["serve", "--model", str(tiny_dirs["target"]), "--max-batch-size", "0"]) == 2
    assert main(["serve", "--model", str(tiny_dirs["target"]), "--drafter-option", "colour=blue"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("specdecode: error:") for line in err)

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "specdecode.cli",
            "serve",
            "--model",
            str(tiny_dirs["target"]),
            "--port",
            str(port),
            "--drafter",
            "pld,suffix",
            "--drain-timeout",
            "5",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, process.stderr.read().decode()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        assert client.completions.create(model=str(tiny_dirs["target"]), prompt=TEXT, max_tokens=5).choices[0].text
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
        stderr = process.stderr.read().decode()
        assert "Traceback" not in stderr
        assert "measured before serving in" in stderr  # measured before the first request
    finally:
        if process.poll() is None:
            process.kill()


def test_engine_driven_by_the_callers_thread_serves_and_stops(tiny_target):
    """``engine_thread=False``: the caller's thread steps the engine (what `serve` does with its main thread,
    because a second thread running torch makes every forward slower); it serves until uvicorn shuts down."""
    service = make_service(tiny_target, engine_thread=False)
    answers = []
    with RunningServer(service) as running:

        def ask() -> None:
            answers.append(running.client().completions.create(model="tiny", prompt=TEXT, max_tokens=6))
            running.server.should_exit = True  # uvicorn's shutdown stops the worker, which ends drive()

        asker = threading.Thread(target=ask)
        asker.start()
        service.worker.drive()
        asker.join()
    assert answers[0].choices[0].text == solo(tiny_target, TEXT, chat=False, n=6).text
    service.worker.drive(alive=lambda: False)  # an idle engine whose server is gone returns at once


@pytest.fixture
def slow_endless_server(tiny_dirs, monkeypatch):
    """A server whose target takes 50 ms a forward and never ends a request by EOS: a request for 240 tokens
    decodes for 12 s unless it is cancelled."""
    target = load_model(str(tiny_dirs["target"]))
    forward_batch = target.backend.forward_batch

    def slow_forward_batch(*args, **kwargs):
        time.sleep(0.05)
        return forward_batch(*args, **kwargs)

    monkeypatch.setattr(target.backend, "forward_batch", slow_forward_batch)
    monkeypatch.setattr(SpeculativeGenerator, "eos_ids", property(lambda self: frozenset()))
    with RunningServer(make_service(target, drafter="none")) as running:
        yield running


def wait_until_idle(running: RunningServer, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while running.service.worker.running or running.service.worker.waiting:
        assert time.monotonic() < deadline, "the request kept decoding after its client left"
        time.sleep(0.05)
    assert running.service.worker.engine.pool.active == 0


@pytest.mark.parametrize("chat", [False, True])
def test_a_non_streamed_request_whose_client_times_out_is_cancelled(slow_endless_server, chat):
    client = openai.OpenAI(base_url=f"{slow_endless_server.url}/v1", api_key="unused", max_retries=0, timeout=0.6)
    with pytest.raises(openai.APITimeoutError):
        if chat:
            client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=240)
        else:
            client.completions.create(model="tiny", prompt=TEXT, max_tokens=240)
    wait_until_idle(slow_endless_server, within_s=3)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_socket_closed_mid_request_cancels_it(slow_endless_server, path):
    field = {"messages": CHAT} if "chat" in path else {"prompt": TEXT}
    body = json.dumps({"model": "tiny", "max_tokens": 240, **field}).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    with socket.create_connection(("127.0.0.1", slow_endless_server.port)) as raw:
        raw.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
        deadline = time.monotonic() + 5
        while not slow_endless_server.service.worker.running:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.02)
    wait_until_idle(slow_endless_server, within_s=3)


# --- the fields real clients send (OpenAI's, and vLLM's through extra_body) ---------------------------------------

PROCESSING = {
    "presence_penalty": 0.8,
    "frequency_penalty": 0.6,
    "logit_bias": {"7": 4.0, "11": -100.0},
}
VLLM_EXTRAS = {"repetition_penalty": 1.3, "min_p": 0.05, "min_tokens": 6, "ignore_eos": True}


def python_params(fields: dict) -> dict:
    return {key: value for key, value in fields.items() if key != "logit_bias"} | {
        "logit_bias": {int(k): v for k, v in fields.get("logit_bias", {}).items()}
    }


def test_penalties_bias_and_vllm_extras_give_plain_decodings_output(server, tiny_target):
    client = server.client()
    want = solo(tiny_target, CHAT, True, 20, **python_params(PROCESSING | VLLM_EXTRAS))
    assert want.text != solo(tiny_target, CHAT, True, 20).text  # the fields change the output
    for drafter in ("pld", "suffix", "none"):
        extra = VLLM_EXTRAS | {"speculative": {"drafter": drafter, "num_draft_tokens": 4}}
        chat = client.chat.completions.create(
            model="tiny", messages=CHAT, max_tokens=20, temperature=0, **PROCESSING, extra_body=extra
        )
        assert chat.choices[0].message.content == want.text, drafter
        assert chat.usage.completion_tokens == len(want.token_ids)
    sampled = dict(PROCESSING, temperature=0.9, seed=5)
    seeded = solo(tiny_target, TEXT, False, 16, **python_params(sampled | VLLM_EXTRAS))
    done = client.completions.create(model="tiny", prompt=TEXT, max_tokens=16, **sampled, extra_body=VLLM_EXTRAS)
    assert done.choices[0].text == seeded.text


def test_stop_token_ids_min_tokens_and_the_stop_text(server, tiny_target):
    client = server.client()
    free = solo(tiny_target, TEXT, False, 30, ignore_eos=True)
    stop_id = free.token_ids[4]
    stopped = client.completions.create(
        model="tiny", prompt=TEXT, max_tokens=30, extra_body={"stop_token_ids": [stop_id], "ignore_eos": True}
    )
    cut_at = free.token_ids.index(stop_id)
    before = tiny_target.tokenizer.decode(free.token_ids[:cut_at], skip_special_tokens=True)
    assert stopped.choices[0].text == before and stopped.usage.completion_tokens == cut_at + 1  # not its text
    assert stopped.choices[0].finish_reason == "stop"
    kept = client.completions.create(
        model="tiny",
        prompt=TEXT,
        max_tokens=30,
        extra_body={"stop_token_ids": [stop_id], "ignore_eos": True, "include_stop_str_in_output": True},
    )
    assert kept.choices[0].text == tiny_target.tokenizer.decode(free.token_ids[: cut_at + 1], skip_special_tokens=True)
    stop = " ".join(free.text.split()[3:5])
    with_stop = client.completions.create(
        model="tiny", prompt=TEXT, max_tokens=30, stop=[stop], extra_body={"include_stop_str_in_output": True}
    )
    assert with_stop.choices[0].text == free.text[: free.text.index(stop) + len(stop)]
    held = client.completions.create(
        model="tiny", prompt=TEXT, max_tokens=30, extra_body={"stop_token_ids": [stop_id], "min_tokens": 12}
    )
    assert held.usage.completion_tokens >= 12
    late = client.completions.create(
        model="tiny", prompt=TEXT, max_tokens=30, stop=[stop], extra_body={"min_tokens": 12}
    )
    assert late.usage.completion_tokens >= 12  # the stop string, earlier, was not looked for


def test_special_tokens_are_shown_when_asked(server, tiny_target):
    client = server.client()
    eos = tiny_target.tokenizer.eos_token_id
    extra = {"logit_bias": {str(eos): 100}, "include_stop_str_in_output": True}
    shown = client.completions.create(
        model="tiny", prompt=TEXT, max_tokens=4, extra_body=extra | {"skip_special_tokens": False}
    )
    hidden = client.completions.create(model="tiny", prompt=TEXT, max_tokens=4, extra_body=extra)
    assert shown.choices[0].text == tiny_target.tokenizer.eos_token and hidden.choices[0].text == ""


def test_usage_in_every_chunk_when_asked_as_guidellm_does(server, tiny_target):
    stream = server.client().chat.completions.create(
        model="tiny",
        messages=CHAT,
        max_tokens=16,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"stream_options": {"include_usage": True, "continuous_usage_stats": True}, "ignore_eos": True},
    )
    chunks = list(stream)
    assert all(chunk.usage is not None for chunk in chunks)
    counts = [chunk.usage.completion_tokens for chunk in chunks]
    assert counts == sorted(counts) and counts[-1] == 16
    assert all(chunk.usage.prompt_tokens == chunks[-1].usage.prompt_tokens for chunk in chunks)


def test_a_developer_message_is_a_system_message(server, tiny_target):
    client = server.client()
    said = [{"role": "developer", "content": "w9 w8"}, *CHAT]
    chat = client.chat.completions.create(model="tiny", messages=said, max_tokens=12, temperature=0)
    want = solo(tiny_target, [{"role": "system", "content": "w9 w8"}, *CHAT], True, 12)
    assert chat.choices[0].message.content == want.text


def test_unknown_fields_are_ignored_and_named(server, caplog):
    response = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"messages": CHAT, "max_tokens": 4, "colour": "blue", "stream_options": {"hue": 1}, "stream": True},
    )
    assert response.status_code == 200 and response.headers["x-ignored-fields"] == "colour, stream_options.hue"
    raw = server.client().chat.completions.with_raw_response.create(
        model="tiny", messages=CHAT, max_tokens=4, extra_body={"colour\n": "blue", "store": True, "metadata": {}}
    )
    assert raw.headers["x-ignored-fields"] == "colour\\n, store, metadata"
    assert any("colour" in record.getMessage() for record in caplog.records if record.name == "specdecode.server")
    plain = server.client().chat.completions.with_raw_response.create(model="tiny", messages=CHAT, max_tokens=4)
    assert "x-ignored-fields" not in plain.headers


@pytest.mark.parametrize(
    "fields, named",
    [
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
            "response_format",
        ),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"best_of": 2}, "best_of"),
        ({"logit_bias": {"100000": 1}}, "logit-bias"),
        ({"stop_token_ids": [100000]}, "stop token ids"),
        ({"presence_penalty": 3}, "presence_penalty"),
    ],
)
def test_fields_known_but_not_honoured_for_a_value_are_a_400_naming_them(server, fields, named):
    response = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": CHAT, **fields})
    assert response.status_code == 400, response.text
    assert named in response.json()["error"]["message"]
    for harmless in (
        {"tools": []},
        {"tool_choice": "none"},
        {"response_format": {"type": "text"}},
        {"top_logprobs": 2},
    ):
        answer = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, **harmless})
        assert answer.status_code == 200, answer.text


def test_serve_strict_api_flag_reaches_the_service(tiny_dirs, monkeypatch):
    from specdecode.cli import build_parser
    from specdecode.server import launch

    monkeypatch.setattr(SpeculativeGenerator, "warm_up", lambda self, drafters=(): 0.0)
    for flags, strict in (([], False), (["--strict-api"], True)):
        args = build_parser().parse_args(["serve", "--model", str(tiny_dirs["target"]), "--drafter", "pld", *flags])
        assert launch.build_service(args).config.strict_api is strict


def test_logprobs_are_the_targets_with_or_without_a_drafter_streamed_or_not(server, tiny_target):
    client = server.client()
    answers = {}
    for drafter in ("none", "pld", "suffix"):
        answers[drafter] = client.chat.completions.create(
            model="tiny",
            messages=CHAT,
            max_tokens=12,
            temperature=0,
            logprobs=True,
            top_logprobs=2,
            presence_penalty=0.5,
            extra_body={"speculative": {"drafter": drafter, "num_draft_tokens": 3}, "ignore_eos": True},
        )
    plain = answers["none"].choices[0].logprobs.content
    want = solo(tiny_target, CHAT, True, 12, ignore_eos=True, presence_penalty=0.5, logprobs=2)
    assert [entry.token for entry in plain] == [tiny_target.tokenizer.decode([t]) for t in want.token_ids]
    assert [entry.logprob for entry in plain] == pytest.approx([e.logprob for e in want.logprobs], abs=1e-4)
    assert all(len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob >= entry.logprob for entry in plain)
    for drafter, answer in answers.items():
        ours = answer.choices[0].logprobs.content
        assert [e.token for e in ours] == [e.token for e in plain], drafter
        assert [e.logprob for e in ours] == pytest.approx([e.logprob for e in plain], abs=1e-4), drafter
    streamed = client.chat.completions.create(
        model="tiny",
        messages=CHAT,
        max_tokens=12,
        logprobs=True,
        stream=True,
        presence_penalty=0.5,
        extra_body={"ignore_eos": True},
    )
    chunks = [chunk.choices[0].logprobs for chunk in streamed if chunk.choices and chunk.choices[0].logprobs]
    entries = [entry for logprobs in chunks for entry in logprobs.content]
    assert [e.logprob for e in entries] == pytest.approx([e.logprob for e in plain], abs=1e-4)
    assert all(e.top_logprobs == [] for e in entries)

    done = client.completions.create(
        model="tiny", prompt=TEXT, max_tokens=8, logprobs=3, extra_body={"ignore_eos": True}
    )
    shaped = done.choices[0].logprobs
    text = solo(tiny_target, TEXT, False, 8, ignore_eos=True, logprobs=3)
    assert shaped.token_logprobs == pytest.approx([e.logprob for e in text.logprobs], abs=1e-4)
    assert len(shaped.tokens) == len(shaped.top_logprobs) == len(shaped.text_offset) == 8
    assert shaped.text_offset[0] == 0 and all(len(top) >= 3 for top in shaped.top_logprobs)
    assert client.completions.create(model="tiny", prompt=TEXT, max_tokens=8).choices[0].logprobs is None


def test_n_choices_share_the_prompt_each_with_its_own_seed_streamed_or_not(server, tiny_target):
    client = server.client()
    want = solo(tiny_target, CHAT, True, 12, ignore_eos=True)
    fixed = {"ignore_eos": True, "speculative": {"num_draft_tokens": 3}}  # auto drafts less in a batch
    greedy = client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=12, temperature=0, n=3, extra_body=fixed
    )
    assert [choice.index for choice in greedy.choices] == [0, 1, 2]
    assert [choice.message.content for choice in greedy.choices] == [want.text] * 3
    assert greedy.usage.prompt_tokens == want.prompt_tokens and greedy.usage.completion_tokens == 3 * 12
    one = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12, temperature=0, extra_body=fixed)
    spec, alone = (answer.model_extra["metrics"]["speculative_decoding"] for answer in (greedy, one))
    assert [spec[key] for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")] == [
        3 * alone[key] for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
    ]

    sampled = {"temperature": 1.0, "seed": 7, "max_tokens": 10}
    wants = [solo(tiny_target, TEXT, False, 10, temperature=1.0, seed=7 + i, ignore_eos=True).text for i in range(3)]
    assert len(set(wants)) > 1  # the seeds give different texts
    done = client.completions.create(model="tiny", prompt=TEXT, n=3, extra_body={"ignore_eos": True}, **sampled)
    assert [choice.text for choice in sorted(done.choices, key=lambda c: c.index)] == wants
    texts = ["", "", ""]
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt=TEXT,
            n=3,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
            **sampled,
        )
    )
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == wants
    assert chunks[-1].usage.completion_tokens == 30 and [c for c in chunks if c.choices][-1].choices[0].finish_reason

    streamed = client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=12, n=2, stream=True, extra_body={"ignore_eos": True}
    )
    said = ["", ""]
    roles = []
    for chunk in streamed:
        for choice in chunk.choices:
            said[choice.index] += choice.delta.content or ""
            roles += [choice.index] if choice.delta.role else []
    assert said == [want.text] * 2 and sorted(roles) == [0, 1]
    huge = client.completions.create(model="tiny", prompt=TEXT, n=2, seed=2**64 - 1, temperature=1.0, max_tokens=4)
    assert len(huge.choices) == 2  # seed + 1 is past 64 bits: seeds are taken modulo 2**64


def test_best_of_is_refused_by_name(server):
    response = httpx.post(f"{server.url}/v1/completions", json={"prompt": TEXT, "n": 2, "best_of": 3})
    assert response.status_code == 400 and "best_of is not supported" in response.json()["error"]["message"]


def test_echo_puts_the_prompt_and_its_raw_logprobs_first_with_or_without_a_drafter(server, tiny_target, tiny_dirs):
    from transformers import AutoModelForCausalLM

    client = server.client()
    plain = client.completions.create(
        model="tiny", prompt=TEXT, max_tokens=6, logprobs=2, extra_body={"ignore_eos": True}
    )
    echoed = client.completions.create(model="tiny", prompt=TEXT, max_tokens=6, echo=True)
    assert echoed.choices[0].text == TEXT + plain.choices[0].text and echoed.choices[0].logprobs is None

    prompt_ids = tiny_target.tokenizer(TEXT)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(tiny_dirs["target"])
    with torch.no_grad():
        raw = torch.log_softmax(model(torch.tensor([prompt_ids])).logits[0].float(), dim=-1)
    want = [raw[i, token].item() for i, token in enumerate(prompt_ids[1:])]
    answers = {}
    for drafter in ("none", "pld", "suffix"):
        extra = {"ignore_eos": True, "speculative": {"drafter": drafter, "num_draft_tokens": 3}}
        answers[drafter] = client.completions.create(
            model="tiny", prompt=TEXT, max_tokens=6, logprobs=2, echo=True, extra_body=extra
        ).choices[0]
    for drafter, choice in answers.items():
        shaped = choice.logprobs
        assert choice.text == TEXT + plain.choices[0].text, drafter
        assert shaped.tokens[0] == tiny_target.tokenizer.decode([prompt_ids[0]])
        assert shaped.token_logprobs[0] is None and shaped.top_logprobs[0] is None
        assert shaped.token_logprobs[1 : len(prompt_ids)] == pytest.approx(want, abs=1e-4), drafter
        assert shaped.token_logprobs[len(prompt_ids) :] == pytest.approx(
            plain.choices[0].logprobs.token_logprobs, abs=1e-4
        )
        assert shaped.tokens[len(prompt_ids) :] == plain.choices[0].logprobs.tokens
        assert all(len(top) >= 2 for top in shaped.top_logprobs[1:])
        assert shaped.text_offset == sorted(shaped.text_offset) and len(shaped.text_offset) == len(prompt_ids) + 6

    chunks = list(
        client.completions.create(
            model="tiny", prompt=TEXT, max_tokens=6, logprobs=2, echo=True, stream=True, extra_body={"ignore_eos": True}
        )
    )
    assert "".join(chunk.choices[0].text for chunk in chunks if chunk.choices) == answers["none"].text
    streamed = [
        lp
        for chunk in chunks
        if chunk.choices and chunk.choices[0].logprobs
        for lp in chunk.choices[0].logprobs.token_logprobs
    ]
    assert streamed[0] is None
    assert streamed[1:] == pytest.approx(answers["none"].logprobs.token_logprobs[1:], abs=1e-4)
