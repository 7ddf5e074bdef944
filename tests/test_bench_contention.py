"""``specdecode bench contention`` on the tiny model: every cell measured with and without a busy competitor,
the report's goal lines, resume, and one-line errors (no speed is checked: speed goals live in the command)."""

from __future__ import annotations

import json

import pytest

from helpers import forbid, tiny_bench_tasks
from specdecode.bench import contention, contention_report
from specdecode.bench.contention_report import CONDITIONS, CONTESTANTS
from specdecode.cli import main


@pytest.fixture(scope="module")
def finished(tiny_dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("contention")
    settings = contention.resolve_settings(model=str(tiny_dirs["target"]), max_new_tokens=4, out=str(out))
    return settings, contention.run_contention(settings, tasks=tiny_bench_tasks(), progress=False)


def test_every_cell_measured(finished):
    settings, results = finished
    assert [(c["method"], c["condition"]) for c in results["cells"]] == [
        (name, condition) for name in CONTESTANTS for condition in CONDITIONS
    ]
    for cell in results["cells"]:
        assert cell["tokens"] == 4 * 3 and cell["tokens_per_s"] > 0 and cell["threads_at_end"] >= 1
    on_disk = json.loads((settings.out / "results.json").read_text())
    assert on_disk["cells"] == results["cells"]


def test_report_states_both_goals_and_the_peer_ratio(finished):
    settings, results = finished
    text = (settings.out / "results.md").read_text()
    assert "keep ≥ 45% of our idle plain tokens/s" in text
    assert "within 20% of its idle value" in text
    assert "against transformers' plain `generate()`" in text
    assert (settings.out / "contention.png").stat().st_size > 0
    summary = contention_report.summary(results)
    assert set(summary["kept"]) == set(CONTESTANTS)
    assert summary["same_tokens"] is True  # greedy: thread counts and load never change our tokens here


def test_rerun_resumes_without_measuring(finished, monkeypatch):
    settings, results = finished
    forbid(monkeypatch, contention, "load_model", "measure_cell")
    again = contention.run_contention(settings, tasks=tiny_bench_tasks(), progress=False)
    assert again["cells"] == results["cells"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max-new-tokens", "0"], "--max-new-tokens must be a positive integer"),
        (["--tasks", "nope"], "unknown benchmark task"),
    ],
)
def test_cli_errors_are_one_line(flags, message, capsys, monkeypatch):
    monkeypatch.setattr(contention, "load_model", lambda *a, **k: pytest.fail("bad flags: nothing is loaded"))
    assert main(["bench", "contention", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
