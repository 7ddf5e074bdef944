"""``specdecode bench --prompts FILE.jsonl`` (the user's own prompts, Spec-Bench's layout or ours) and the
bootstrap interval of the speed-up over prompts."""

from __future__ import annotations

import json

import pytest

from helpers import BENCH_MAX_NEW, assert_one_line_error
from specdecode.bench.metrics import bootstrap_speedup, tokens_per_s
from specdecode.bench.runner import run_benchmark
from specdecode.bench.suites import resolve_settings
from specdecode.cli import main
from specdecode.data.prompt_file import read_prompt_file
from specdecode.errors import SpecDecodeError


def _write(path, *lines) -> str:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return str(path)


def test_spec_bench_layout_takes_the_first_turn(tmp_path):
    path = _write(
        tmp_path / "question.jsonl",
        {"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Now shorter."]},
        {"question_id": 82, "category": "coding", "turns": ["Sort a list."]},
        {"question_id": 83, "category": "writing", "turns": ["Write a story."]},
    )
    prompts = read_prompt_file(path)
    assert list(prompts.tasks) == ["writing", "coding"]  # in order of first appearance
    assert [(p.id, p.text) for p in prompts.tasks["writing"]] == [
        ("writing/81", "Write a poem."),
        ("writing/83", "Write a story."),
    ]
    assert prompts.skipped == [] and prompts.largest_task == 2 and len(prompts.sha256) == 64


def test_our_layout_defaults_and_sessions(tmp_path):
    path = _write(
        tmp_path / "mine.jsonl",
        {"text": "Hello there"},
        "",
        {"id": "a", "task": "edit", "text": "Fix this.", "session": "s1", "grounded": True},
        {"id": "b", "task": "edit", "text": "And this.", "session": "s1"},
        {"id": "c", "task": "edit", "text": "Other."},
    )
    prompts = read_prompt_file(path)
    assert [p.id for p in prompts.tasks["custom"]] == ["custom/line-1"]
    edit = prompts.tasks["edit"]
    assert edit[0].grounded and edit[0].session == "s1"
    # per_task counts sessions, as for multi-edit: the first "session" holds both of s1's requests.
    (chosen,) = prompts.select(("edit",), 1)
    assert [p.id for p in chosen.prompts] == ["edit/a", "edit/b"]
    assert prompts.largest_task == 2


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "not a JSON object"),
        ({"id": "x"}, 'neither "turns"'),
        ({"turns": []}, "non-empty list"),
        ({"text": "  "}, "non-empty string"),
        ({"text": "hi", "id": True}, '"id" must be a string or an integer'),
        ({"text": "hi", "task": 3}, '"task" must be a string'),
        ({"text": "hi", "grounded": "yes"}, '"grounded" must be a boolean'),
        ({"id": "dup", "text": "again"}, "duplicate id"),
    ],
)
def test_a_bad_line_is_reported_and_the_others_kept(tmp_path, line, message):
    path = _write(tmp_path / "p.jsonl", {"id": "dup", "text": "first"}, line, {"id": "z", "text": "last"})
    prompts = read_prompt_file(path)
    assert [p.id for p in prompts.tasks["custom"]] == ["custom/dup", "custom/z"]
    (problem,) = prompts.skipped
    assert problem.startswith(f"{path}:2: ") and message in problem and "\n" not in problem


def test_a_file_without_prompts_is_an_error(tmp_path):
    with pytest.raises(SpecDecodeError, match="no valid prompt"):
        read_prompt_file(_write(tmp_path / "bad.jsonl", "{oops", {"x": 1}))
    with pytest.raises(SpecDecodeError, match="holds no prompts"):
        read_prompt_file(_write(tmp_path / "empty.jsonl", ""))
    with pytest.raises(SpecDecodeError, match="cannot read prompts file"):
        read_prompt_file(tmp_path / "missing.jsonl")


def test_settings_take_the_files_tasks(tmp_path):
    path = _write(
        tmp_path / "p.jsonl",
        {"question_id": 1, "category": "qa", "turns": ["a?"]},
        {"question_id": 2, "category": "qa", "turns": ["b?"]},
        {"question_id": 3, "category": "math", "turns": ["1+1?"]},
    )
    settings = resolve_settings("quick", prompts_file=path, out=str(tmp_path / "out"))
    assert settings.tasks == ("qa", "math") and settings.prompts_per_task == 2
    assert settings.fingerprint["prompts_sha256"] == read_prompt_file(path).sha256
    assert [len(t.prompts) for t in settings.load_tasks()] == [2, 1]
    cut = resolve_settings("quick", prompts_file=path, tasks="qa", prompts_per_task=1)
    assert [[p.id for p in t.prompts] for t in cut.load_tasks()] == [["qa/1"]]
    with pytest.raises(SpecDecodeError, match="not in .*it has qa, math"):
        resolve_settings("quick", prompts_file=path, tasks="humaneval")
    # The built-in tasks' fingerprint is unchanged, so their earlier results still resume.
    assert "prompts_sha256" not in resolve_settings("quick").fingerprint


def test_bench_runs_on_a_prompts_file(tiny_dirs, tmp_path):
    words = "w1 w2 w3 w4 w5 w1 w2 w3 w4 w5 w1 w2 w3"
    path = _write(
        tmp_path / "p.jsonl",
        {"id": 1, "task": "copy", "text": f"{words} w10"},
        {"id": 2, "task": "copy", "text": f"{words} w11"},
        {"id": 3, "task": "copy", "text": f"{words} w12"},
    )
    settings = resolve_settings(
        "quick",
        prompts_file=path,
        model=str(tiny_dirs["target"]),
        methods="none,pld",
        max_new_tokens=BENCH_MAX_NEW,
        repeats=1,
        threads=1,
        peers=False,
        draft_lengths="none",
        out=str(tmp_path / "out"),
    )
    results = run_benchmark(settings, progress=False)
    assert sorted(results["runs"]["pld"]["copy"]) == ["copy/1", "copy/2", "copy/3"]
    pld = next(c for c in results["cells"] if c["method"] == "pld")
    low, high = pld["speedup_ci"]
    assert low <= pld["speedup"] <= high and pld["equal_to_plain_pct"] == 100.0
    text = (settings.out / "results.md").read_text()
    assert "prompts from `p.jsonl`" in text and "95% interval" in text


def test_cli_reports_bad_lines_and_refuses_a_missing_file(capsys, tmp_path):
    assert_one_line_error(capsys, ["bench", "--prompts", str(tmp_path / "none.jsonl")], "cannot read prompts file")
    path = _write(tmp_path / "p.jsonl", "{bad", {"text": "hi", "task": "t"})
    # The bad line is reported; the valid one still reaches the settings, where the unknown task stops the run.
    assert main(["bench", "--prompts", path, "--tasks", "nope"]) == 2
    warning, error = capsys.readouterr().err.strip().splitlines()
    assert (
        warning == f"specdecode: {path}:1: not JSON (Expecting property name enclosed in double quotes); line left out"
    )
    assert error.startswith("specdecode: error: task(s) nope not in") and error.endswith("it has t")


def _records(walls: list[float], tokens: int = 10) -> dict:
    return {f"p{i}": {"new_tokens": tokens, "wall_s": [wall]} for i, wall in enumerate(walls)}


def test_bootstrap_interval_brackets_the_pooled_speedup():
    plain = _records([1.0, 2.0, 1.5, 3.0])
    faster = _records([0.5, 1.6, 0.6, 2.9])  # some prompts gain much, some little
    low, high = bootstrap_speedup(faster, plain)
    point = tokens_per_s(faster.values()) / tokens_per_s(plain.values())
    assert low < point < high
    assert bootstrap_speedup(faster, plain) == (low, high)  # seeded: the report is reproducible
    assert bootstrap_speedup(_records([0.5, 1.0]), _records([1.0, 2.0])) == pytest.approx((2.0, 2.0))


def test_bootstrap_needs_two_common_prompts():
    assert bootstrap_speedup(_records([1.0]), _records([1.0])) is None
    assert bootstrap_speedup(_records([1.0, 1.0]), {"other": {"new_tokens": 1, "wall_s": [1.0]}}) is None
