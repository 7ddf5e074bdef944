"""The load-testing clients operators point at a server, unchanged, against `specdecode serve`: guidellm 0.8.1
(`guidellm run`) and aiperf 0.13 (`aiperf profile`), each on both endpoints, with no request failing.

Each client lives in a venv of its own (its pins conflict with ours): ``python tools/client_venvs.py setup guidellm``
or ``... setup aiperf``.  Where a venv is absent its test skips, naming that command.  The runs are tiny (three
requests of 16 prompt tokens and 8 new ones, on SmolLM2, whose tokenizer directory they read) and download nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_server import RunningServer, make_service

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import client_venvs  # noqa: E402  (a tool script, not a package module)

pytestmark = [pytest.mark.slow, pytest.mark.real_model]
ENDPOINTS = ["/v1/completions", "/v1/chat/completions"]


@pytest.fixture(scope="module")
def server(smollm2):
    with RunningServer(make_service(smollm2)) as running:
        yield running


@pytest.fixture(scope="module")
def tokenizer_dir() -> str:
    from specdecode.models import registry

    return str(registry.ensure_model("smollm2-135m"))


def client(name: str) -> str:
    command = client_venvs.executable(name)
    if not command.exists():
        pytest.skip(f"{name} is not installed in {client_venvs.venv(name)}: python tools/client_venvs.py setup {name}")
    return str(command)


def ignored_fields(caplog) -> list[str]:
    """What the server logged as fields it ignored: a client's field it does not know."""
    return [record.getMessage() for record in caplog.records if "fields ignored" in record.getMessage()]


def run(command: list[str], cwd: Path, offline: bool = True) -> subprocess.CompletedProcess:
    # Not offline: drop the offline switches another test or the caller's shell may have set, not only leave them out.
    online = {key: value for key, value in os.environ.items() if key not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env = {**os.environ, "HF_HUB_OFFLINE": "1"} if offline else online
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return done


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_guidellm_run_has_no_errored_request(server, tokenizer_dir, tmp_path, endpoint, caplog):
    report = tmp_path / "report.json"
    backend = f"kind=openai_http,target={server.url},model=tiny,request_format={endpoint}"
    run(
        [
            client("guidellm"),
            "run",
            "--backend",
            backend,
            "--profile",
            "kind=concurrent,streams=2",
            "--constraint",
            "kind=max_requests,count=3",
            "--data",
            "kind=synthetic_text,prompt_tokens=16,output_tokens=8",
            "--tokenizer",
            f"kind=huggingface_auto,model={tokenizer_dir}",
            "--output",
            f"kind=json,path={report}",
            "--disable-console-interactive",
        ],
        tmp_path,
    )
    (benchmark,) = json.loads(report.read_text())["benchmarks"]
    made = benchmark["scheduler_metrics"]["requests_made"]
    assert made["errored"] == 0 and made["incomplete"] == 0 and made["successful"] == 3, made
    assert not ignored_fields(caplog)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_aiperf_profile_has_no_failed_request(server, tokenizer_dir, tmp_path, endpoint, caplog):
    out = tmp_path / "out"
    run(
        [
            client("aiperf"),
            "profile",
            "--model",
            "tiny",
            "--url",
            server.url,
            "--endpoint-type",
            endpoint,
            "--streaming",
            "--tokenizer",
            tokenizer_dir,
            "--request-count",
            "3",
            "--concurrency",
            "2",
            "--prompt-input-tokens-mean",
            "16",
            "--prompt-output-tokens-mean",
            "8",
            "--output-artifact-dir",
            str(out),
            "--ui-type",
            "none",
        ],
        tmp_path,
        offline=False,  # in its offline mode aiperf looks for a hub snapshot, not the directory it is given
    )
    summary = json.loads((out / "profile_export_aiperf.json").read_text())
    assert summary["request_count"]["avg"] == 3 and summary["error_summary"] == [], summary["error_summary"]
    assert not ignored_fields(caplog)
