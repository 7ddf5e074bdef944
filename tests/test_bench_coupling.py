"""``specdecode bench coupling`` on the tiny model: both verifiers per method, drafter invariance of the coupled
rows, the report files, and the command's flags and errors.  Timings are never asserted beyond being positive."""

from __future__ import annotations

import dataclasses
import json

import pytest

from helpers import bench_parser, tiny_bench_tasks
from specdecode.bench import coupling
from specdecode.errors import SpecDecodeError

MAX_NEW = 8


@pytest.fixture(scope="module")
def finished(tiny_dirs, tmp_path_factory):
    settings = coupling.resolve_settings(
        model=str(tiny_dirs["target"]),
        methods="none,pld:k=3,suffix:k=3",  # fixed depths: under `auto` a loaded machine may draft nothing
        tasks="edit",
        max_new_tokens=MAX_NEW,
        threads=1,
        out=str(tmp_path_factory.mktemp("coupling")),
    )
    edit = tiny_bench_tasks()[0]
    one_prompt = [dataclasses.replace(edit, prompts=edit.prompts[:1])]
    return settings, coupling.measure_coupling(settings, tasks=one_prompt, progress=False)


def test_every_method_with_both_verifiers_and_coupled_rows_equal_plain(finished):
    settings, results = finished
    rows = {(r["method"], r["verifier"]): r for r in results["rows"]}
    methods = ["none", "pld:k=3", "suffix:k=3"]  # none once, first, though also listed
    assert list(rows) == [(m, v) for m in methods for v in ("coupled", "rejection")]
    for (method, verifier), row in rows.items():
        assert 1 <= row["new_tokens"] <= MAX_NEW and row["new_tokens"] == row["steps"] + row["accepted_tokens"]
        assert row["mean_accepted_tokens"] == pytest.approx(row["new_tokens"] / row["steps"])
        assert row["tokens_per_s"] > 0 and row["wall_s"] > 0
        assert [p["prompt"] for p in row["per_prompt"]] == ["edit/edit/0"]
        if method == "none":
            assert row["acceptance_rate"] is None and row["mean_accepted_tokens"] == 1.0
        else:
            assert row["drafted_tokens"] > 0 and 0.0 <= row["acceptance_rate"] <= 1.0
        if verifier == "coupled":
            assert row["equal_to_plain_coupled"] == 1.0, method  # drafter invariance
    assert results["settings"]["methods"] == ["pld:k=3", "suffix:k=3"] and results["settings"]["temperature"] == 0.8
    assert results["environment"]["threads"] == 1 and results["prompts"][0]["prompt_tokens"] > 0


def test_files_written(finished):
    settings, results = finished
    assert json.loads((settings.out / "results.json").read_text()) == results
    report = (settings.out / "results.md").read_text()
    assert "| method | verifier | mean accepted tokens / step |" in report
    assert "| `pld:k=3` | coupled |" in report and "| `suffix:k=3` | rejection |" in report
    assert "| 1/1 |" in report and "temperature 0.8" in report


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"temperature": 0}, "--temperature must be > 0"),
        ({"temperature": "hot"}, "--temperature must be a number"),
        ({"top_p": 0}, "--top-p must be in (0, 1]"),
        ({"top_p": 1.5}, "--top-p must be in (0, 1]"),
        ({"quantize": "int3"}, "--quantize must be one of"),
        ({"max_new_tokens": 0}, "--max-new-tokens must be a positive integer"),
        ({"tasks": "edit,poetry"}, "unknown benchmark task 'poetry'"),
        ({"methods": "telepathy"}, "unknown drafter 'telepathy'"),
        ({"colour": "blue"}, "unknown coupling setting(s): colour"),
    ],
)
def test_bad_settings_are_one_line_errors(overrides, message):
    with pytest.raises(SpecDecodeError) as info:
        coupling.resolve_settings(**overrides)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_command_flags_reach_the_settings(tmp_path, monkeypatch, capsys):
    parser = bench_parser()
    seen = []

    def fake_measure(settings, progress):
        seen.append((settings, progress))
        (settings.out / "results.md").write_text("the report\n")

    monkeypatch.setattr(coupling, "measure_coupling", fake_measure)
    tmp_path.joinpath("out").mkdir()
    argv = [
        "bench",
        "coupling",
        "--methods",
        "pld",
        "--temperature",
        "0.5",
        "--top-p",
        "0.9",
        "--seed",
        "7",
        "--max-new-tokens",
        "16",
    ]
    args = parser.parse_args([*argv, "--out", str(tmp_path / "out"), "--no-progress"])
    assert args.run(args) == 0
    settings, progress = seen[0]
    assert [m.spec for m in settings.methods] == ["pld"] and not progress
    assert (settings.temperature, settings.top_p, settings.seed, settings.max_new_tokens) == (0.5, 0.9, 7, 16)
    assert settings.model == "smollm2-135m" and settings.prompts_per_task == 1
    assert capsys.readouterr().out.startswith("the report")
