"""SLED over HTTP: drafts made here, verified by a real uvicorn server's ``/v1/verify`` (server/sled.py), through
``specdecode.remote`` and ``specdecode generate --remote``.  Greedy output equals the server's plain output; the
sparse draft distributions keep rejection sampling exact (chi-square, with a client that lies about them failing);
sessions end on close, on timeout and when the client leaves; every bad input is a 4xx."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import socket
import time

import httpx
import numpy as np
import pytest
import torch

import specdecode
import specdecode.remote_target
import specdecode.verify.exact
from helpers import DRAWS, PASS_P, BigramLM, V, chain_pvalues
from specdecode.cli import main
from specdecode.config import GenerationConfig
from specdecode.draft_length.base import FixedLength
from specdecode.drafters.base import Drafter, DraftRequest, DraftSession
from specdecode.engine import TargetVerifier, finish_sequence, read_prompt, start_sequence, step
from specdecode.remote_target import _draft_body, _drawn_from
from specdecode.sampling import sample, sampling_probs
from specdecode.sampling_params import SamplingParams
from specdecode.server.sled import ClientDrafts, VerifyStepRequest, client_draft
from specdecode.types import Draft, Verdict
from test_server import TEXT, RunningServer, make_service, solo

PROMPTS = [(TEXT, False), ("w1 w2 w3 w4 w1 w2 w3", True)]


@pytest.fixture(scope="module")
def server(tiny_target):
    with RunningServer(make_service(tiny_target, max_verify_sessions=3, verify_idle_s=60.0)) as running:
        yield running


def sessions_of(server):
    return server.server.config.app.state.verify_sessions


def wait_until(condition, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def all_closed(server) -> bool:
    sessions = sessions_of(server)
    return not sessions.open and (sessions.pool is None or sessions.pool.active == 0)


@pytest.mark.parametrize("drafter", ["pld", "draft-model"])
def test_greedy_remote_output_is_the_servers_plain_output(server, tiny_target, tiny_draft, drafter):
    options = {"draft_model": tiny_draft} if drafter == "draft-model" else {}
    remote = specdecode.remote(server.url, drafter, num_draft_tokens=4, **options)
    client = server.client()
    for prompt, chat in PROMPTS:
        want = solo(tiny_target, prompt, chat, 40, ignore_eos=True)
        got = remote.generate(prompt, chat=chat, max_new_tokens=40, ignore_eos=True)
        assert got.token_ids == want.token_ids and got.text == want.text
        assert got.stats.new_tokens == got.stats.steps + got.stats.accepted_tokens == 40
        plain = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=40, temperature=0, extra_body={"ignore_eos": True}
        )
        assert chat or got.text == plain.choices[0].text  # the server's own plain output (completions: no template)
    stop = solo(tiny_target, TEXT, False, 40, ignore_eos=True).text.split()[3]
    stopped = remote.generate(TEXT, chat=False, max_new_tokens=40, ignore_eos=True, stop=stop)
    want = solo(tiny_target, TEXT, False, 40, ignore_eos=True, stop=stop)
    assert stopped.finish_reason == "stop" and (stopped.text, stopped.token_ids) == (want.text, want.token_ids)
    assert all_closed(server)


def test_sessions_and_batched_requests_side_by_side_keep_their_own_output(server, tiny_target, tiny_draft):
    """Two clients drafting for themselves while the batch decodes completions: every output is still plain's."""
    want = solo(tiny_target, TEXT, False, 40, ignore_eos=True)
    clients = [
        specdecode.remote(server.url, "pld", num_draft_tokens=3),
        specdecode.remote(server.url, "draft-model", draft_model=tiny_draft, num_draft_tokens=2),
    ]
    openai_client = server.client()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        remote = [
            pool.submit(client.generate, TEXT, chat=False, max_new_tokens=40, ignore_eos=True) for client in clients
        ]
        served = [
            pool.submit(
                openai_client.completions.create,
                model="tiny",
                prompt=TEXT,
                max_tokens=40,
                extra_body={"ignore_eos": True, "speculative": {"drafter": drafter}},
            )
            for drafter in ("pld", "none")
        ]
        assert [future.result().token_ids for future in remote] == [want.token_ids] * 2
        assert [future.result().choices[0].text for future in served] == [want.text] * 2
    assert all_closed(server)


def test_a_server_that_keeps_every_draft_token_fails_the_equality(server, tiny_target, tiny_draft, monkeypatch):
    """The broken control: greedy matching replaced by keeping the whole draft, the remote text is not plain's."""
    want = solo(tiny_target, TEXT, False, 40, ignore_eos=True)

    def keep_all(choices, draft):
        return Verdict(tuple(range(len(draft.tokens))), choices[len(draft.tokens)])

    monkeypatch.setattr(specdecode.verify.exact, "verify_greedy", keep_all)
    remote = specdecode.remote(server.url, "draft-model", draft_model=tiny_draft, num_draft_tokens=4)
    assert remote.generate(TEXT, chat=False, max_new_tokens=40, ignore_eos=True).token_ids != want.token_ids


def test_seeded_sampling_remote_gives_the_servers_text_for_that_seed(server, tiny_target, tiny_draft):
    remote = specdecode.remote(server.url, "draft-model", draft_model=tiny_draft, num_draft_tokens=3)
    for seed in (1, 2):
        want = solo(tiny_target, TEXT, False, 30, ignore_eos=True, temperature=0.9, seed=seed)
        got = remote.generate(TEXT, chat=False, max_new_tokens=30, ignore_eos=True, temperature=0.9, seed=seed)
        assert got.token_ids == want.token_ids


def test_unseeded_sampling_sends_the_draft_distributions(server, tiny_draft, monkeypatch):
    sent = []
    real = specdecode.remote_target._draft_body
    monkeypatch.setattr(specdecode.remote_target, "_draft_body", lambda draft: sent.append(real(draft)) or sent[-1])
    remote = specdecode.remote(server.url, "draft-model", draft_model=tiny_draft, num_draft_tokens=3)
    result = remote.generate(TEXT, chat=False, max_new_tokens=20, ignore_eos=True, temperature=0.9, top_k=10)
    assert len(result.token_ids) == 20
    rows = [row for body in sent for row in body.get("draft_probs", [])]
    assert rows and all(1 <= len(row) <= 10 and abs(sum(row.values()) - 1) < 1e-4 for row in rows)


# -- rejection sampling against the distributions a client sends ------------------------------------------------


class BigramClient(Drafter):
    """A client's sampling draft model on the bigram toy: draws each token from its (truncated) distribution."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__(None)  # type: ignore[arg-type]
        self.table = table

    def session(self, request: DraftRequest) -> DraftSession:
        generator = request.torch_generator()
        table, sampling = self.table, request.sampling

        class Session(DraftSession):
            def propose(self, context, max_tokens):
                tokens, rows = [], []
                for _ in range(max_tokens):
                    probs = sampling_probs(table[(tokens or context)[-1]], sampling)
                    tokens.append(sample(probs, generator))
                    rows.append(probs)
                return Draft(tokens=tokens, probs=torch.stack(rows) if rows else None)

        return Session()


def client_side_counts(target_table, draft_table, draws: int, lie: bool = False) -> np.ndarray:
    """[position in step, previous token, token] counts of tokens decoded through the server's verification of the
    client's drafts, each sent as the client sends it (JSON of the sparse rows) and read as the server reads it.
    ``lie``: the client draws from its truncated distribution but sends the whole one."""
    target = BigramLM(target_table)
    verifier = TargetVerifier(target)
    sampling = SamplingParams(temperature=0.9, coupled=False)
    client = BigramClient(draft_table)
    counts = np.zeros((4, V, V))
    produced, seed = 0, 0
    while produced < draws:
        config = GenerationConfig(max_new_tokens=200, sampling=dataclasses.replace(sampling, seed=seed))
        drawn = _drawn_from(config.sampling)
        drafting = client.session(DraftRequest((0, 1), sampling=drawn, seed=seed))
        pool = target.new_pool()
        seq = start_sequence(target, ClientDrafts(None), [0, 1], config, frozenset(), FixedLength(3), pool.allocate())  # type: ignore[arg-type]
        read_prompt(target, seq)
        previous = 1
        while not seq.done:
            draft = drafting.propose(seq.context, 3)
            sent = (
                draft
                if not lie
                else Draft(draft.tokens, torch.softmax(draft_table[[seq.context[-1], *draft.tokens[:-1]]] / 0.9, -1))
            )
            body = VerifyStepRequest.model_validate_json(json.dumps(_draft_body(sent)))
            seq.session.draft = client_draft(body, V)
            (chunk,) = step([seq], verifier)
            for position, token in enumerate(chunk):
                counts[position, previous, token] += 1
                previous = token
            produced += len(chunk)
        finish_sequence(seq)
        seed += 1
    return counts


def test_rejection_sampling_against_the_sparse_distributions_a_client_sends_is_exact(monkeypatch):
    """The client's draft model draws from its two likeliest tokens (DRAFT_SUPPORT); the server verifies against
    what it sent.  A client that sends its whole distribution instead of the one it drew from is caught."""
    monkeypatch.setattr(specdecode.remote_target, "DRAFT_SUPPORT", 2)
    g = torch.Generator().manual_seed(3)
    target_table, draft_table = torch.randn(V, V, generator=g) * 1.5, torch.randn(V, V, generator=g) * 1.5
    expected = sampling_probs(target_table, SamplingParams(temperature=0.9)).numpy()
    counts = client_side_counts(target_table, draft_table, DRAWS)
    pvalues = chain_pvalues(counts, expected)
    assert len(pvalues) >= 8 and min(pvalues) > PASS_P / len(pvalues), pvalues
    assert counts[1:].sum() > 0  # drafts were accepted
    lying = chain_pvalues(client_side_counts(target_table, draft_table, DRAWS // 5, lie=True), expected)
    assert min(lying) < 1e-6, lying


# -- sessions' lifetime ---------------------------------------------------------------------------------------------


def open_session(url: str, **body) -> dict:
    answer = httpx.post(f"{url}/v1/verify", json={"prompt": TEXT, "chat": False, "max_tokens": 50, **body})
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_close_frees_the_slot_and_the_session_is_gone(server):
    opened = open_session(server.url)
    assert sessions_of(server).pool.active == 1
    closed = httpx.delete(f"{server.url}/v1/verify/{opened['id']}")
    assert closed.status_code == 200 and closed.json()["deleted"] is True
    assert all_closed(server)
    again = httpx.post(f"{server.url}/v1/verify/{opened['id']}", json={"draft_token_ids": []})
    assert again.status_code == 404 and again.json()["error"]["type"] == "not_found_error"


def test_an_ended_output_frees_the_slot(server):
    opened = open_session(server.url, max_tokens=2, ignore_eos=True)
    last = httpx.post(f"{server.url}/v1/verify/{opened['id']}", json={"draft_token_ids": []}).json()
    assert last["finished"] and last["finish_reason"] == "length" and last["usage"]["completion_tokens"] == 2
    assert all_closed(server)


def test_an_idle_session_expires_and_its_slot_is_freed(tiny_target):
    with RunningServer(make_service(tiny_target, verify_idle_s=0.4)) as running:
        opened = open_session(running.url)
        assert sessions_of(running).pool.active == 1
        wait_until(lambda: all_closed(running), seconds=5)
        late = httpx.post(f"{running.url}/v1/verify/{opened['id']}", json={"draft_token_ids": [1]})
        assert late.status_code == 404


def test_a_client_that_leaves_before_its_answer_frees_the_slot(server):
    body = json.dumps({"prompt": TEXT, "chat": False, "max_tokens": 50}).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as raw:
        raw.sendall(
            b"POST /v1/verify HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        raw.shutdown(socket.SHUT_WR)
    wait_until(lambda: all_closed(server))


# -- bad input ----------------------------------------------------------------------------------------------------


def error_of(answer: httpx.Response, status: int) -> dict:
    assert answer.status_code == status, answer.text
    return answer.json()["error"]


def test_every_bad_input_is_a_4xx_with_the_error_object(server, tiny_target):
    url = f"{server.url}/v1/verify"
    vocab = tiny_target.backend.vocab_size
    assert (
        "draft_token_ids"
        in error_of(httpx.post(url, json={"prompt": TEXT, "draft_token_ids": [vocab]}), 400)["message"]
    )
    assert (
        "draft_token_ids"
        in error_of(httpx.post(url, json={"prompt": TEXT, "draft_token_ids": [1] * 65}), 400)["message"]
    )
    assert error_of(httpx.post(url, json={"prompt": TEXT, "draft_probs": [{"1": -0.5}]}), 400)["param"].startswith(
        "draft_probs"
    )
    assert error_of(httpx.post(url, json={"prompt": TEXT, "draft": [1]}), 400)["message"] == "draft: unsupported field"
    assert error_of(httpx.post(url, json={"prompt": "  "}), 400)["message"]
    assert error_of(httpx.post(url, json={"prompt": TEXT, "model": "other"}), 404)["param"] == "model"
    assert error_of(httpx.post(f"{url}/verify-unknown", json={}), 404)["type"] == "not_found_error"
    assert error_of(httpx.delete(f"{url}/verify-unknown"), 404)["type"] == "not_found_error"
    opened = [open_session(server.url) for _ in range(3)]  # the server keeps 3
    full = httpx.post(url, json={"prompt": TEXT})
    assert error_of(full, 429)["type"] == "rate_limit_error" and full.headers["retry-after"] == "1"
    step = f"{url}/{opened[0]['id']}"
    assert error_of(httpx.post(step, json={"draft_token_ids": [vocab + 5]}), 400)["param"].startswith("draft_token_ids")
    assert httpx.post(step, json={"draft_token_ids": [1, 2]}).json()["verified"] == 2  # the session goes on
    for session in opened:
        httpx.delete(f"{url}/{session['id']}")
    assert all_closed(server)


def test_a_draft_whose_own_distribution_excludes_it_is_cut_there():
    body = VerifyStepRequest(draft_token_ids=[1, 2, 3], draft_probs=[{"1": 2.0, "0": 2.0}, {"3": 1.0}, {"3": 1.0}])
    draft = client_draft(body, V)
    assert draft.tokens == [1] and torch.allclose(draft.probs, torch.tensor([[0.5, 0.5, 0.0, 0.0, 0.0]]))
    shorter = client_draft(VerifyStepRequest(draft_token_ids=[1, 2], draft_probs=[{"1": 1.0}]), V)
    assert shorter.tokens == [1]


def test_the_api_key_guards_verify(tiny_target):
    with RunningServer(make_service(tiny_target, api_key="sekret")) as running:
        refused = httpx.post(f"{running.url}/v1/verify", json={"prompt": TEXT})
        assert error_of(refused, 401)["type"] == "authentication_error"
        remote = specdecode.remote(running.url, "pld", api_key="sekret")
        assert len(remote.generate(TEXT, chat=False, max_new_tokens=5, ignore_eos=True).token_ids) == 5
        with pytest.raises(specdecode.SpecDecodeError, match="401"):
            specdecode.remote(running.url, "pld").generate(TEXT, chat=False, max_new_tokens=5)


# -- the command line ---------------------------------------------------------------------------------------------


def test_generate_remote_prints_the_servers_plain_text(server, tiny_target, capsys):
    want = solo(tiny_target, TEXT, False, 20, ignore_eos=True)
    argv = ["generate", TEXT, "--remote", server.url, "--no-chat", "--max-new-tokens", "20", "--ignore-eos"]
    assert main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == want.token_ids
    assert main([*argv, "--num-draft-tokens", "3"]) == 0
    assert capsys.readouterr().out == want.text + "\n"


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--drafter", "layer-skip"], "cannot draft for a remote target"),
        (["--verifier", "typical"], "--remote does not take --verifier"),
        (["--num-draft-tokens", "auto"], "fixed number of tokens"),
        (["--drafter", "draft-model"], "needs --draft-model"),
    ],
)
def test_generate_remote_refuses_in_one_line(server, capsys, flags, message):
    assert main(["generate", TEXT, "--remote", server.url, *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


# -- the real model -----------------------------------------------------------------------------------------------


@pytest.mark.real_model
def test_smollm2_remote_greedy_equals_plain(smollm2):
    from specdecode.drafters import create_drafter
    from specdecode.generator import SpeculativeGenerator
    from specdecode.server.app import ServerConfig, Service

    generator = SpeculativeGenerator.build(smollm2, "none")
    service = Service(generator, {"none": create_drafter("none", smollm2)}, ServerConfig(model_name="smollm2-135m"))
    prompt = "Repeat this list exactly: apple, banana, cherry, date, elderberry, fig, grape."
    want = generator.generate(prompt, chat=True, max_new_tokens=32, ignore_eos=True)
    with RunningServer(service) as running:
        got = specdecode.remote(running.url, "pld").generate(prompt, chat=True, max_new_tokens=32, ignore_eos=True)
        assert all_closed(running)
    assert got.token_ids == want.token_ids and got.text == want.text
    assert got.stats.accepted_tokens > 0


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--max-verify-sessions", "-1"], "--max-verify-sessions must be an integer >= 0"),
        (["--verify-idle-timeout", "0"], "--verify-idle-timeout must be a positive number"),
    ],
)
def test_serve_refuses_bad_session_limits_in_one_line(tiny_dirs, capsys, flags, message):
    assert main(["serve", "--model", str(tiny_dirs["target"]), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err
