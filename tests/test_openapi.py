"""``/openapi.json`` describes the API as it behaves: schemathesis (the fuzzer FastAPI users run) sends schema-valid
and schema-violating requests to a real server and checks every answer against the document — statuses, content
types, bodies, the ``Allow`` header of a 405 — and that no request is answered with a 5xx."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from test_server import RunningServer, make_service

SCHEMATHESIS = shutil.which("schemathesis") or str(Path(sys.executable).parent / "schemathesis")


@pytest.fixture(scope="module", params=[False, True], ids=["unknown-fields-ignored", "strict-api"])
def running(tiny_target, request):
    # A short queue bounds the choices a request may ask for (n <= 8 + 8), which keeps the fuzzer's requests short.
    with RunningServer(make_service(tiny_target, strict_api=request.param, max_queue=8)) as server:
        yield server


def test_the_document_declares_what_the_server_answers(running):
    document = httpx.get(f"{running.url}/openapi.json").json()
    completions = document["paths"]["/v1/completions"]["post"]["responses"]
    assert {"200", "400", "401", "404", "429", "500"} <= set(completions) and "422" not in completions
    assert "text/event-stream" in completions["200"]["content"]
    assert "text/plain" in document["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    prompt = document["components"]["schemas"]["CompletionRequest"]["properties"]["prompt"]["anyOf"]
    assert {"type": "string", "minLength": 1, "pattern": r"\S"} in prompt


def test_a_405_names_the_allowed_methods(running):
    answer = httpx.delete(f"{running.url}/v1/completions")
    assert answer.status_code == 405 and answer.headers["allow"] == "POST"
    assert answer.json()["error"]["message"] == "Method Not Allowed"


@pytest.mark.slow
def test_schemathesis_finds_nothing(running, tmp_path):
    if not Path(SCHEMATHESIS).exists():
        pytest.fail("schemathesis is not installed: pip install -e '.[dev]'")
    run = subprocess.run(
        [SCHEMATHESIS, "run", f"{running.url}/openapi.json", "--checks", "all", "--max-examples", "40", "--seed", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,  # where it keeps its cache of crashes
    )
    assert run.returncode == 0, run.stdout[-4000:]
