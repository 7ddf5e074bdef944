"""The benchmark harness on tiny models: method specs, metric arithmetic, equality, resume, report, CLI parsing.

Timings are never asserted; only what the harness computes from them.
"""

from __future__ import annotations

import argparse
import json

import pytest

from specdecode.bench import contestants, report, runner, suites
from specdecode.bench.cells import CellResult, build_cells
from specdecode.bench.cli import add_bench_command
from specdecode.bench.methods import DEFAULT_K, MethodSpec, parse_method, parse_methods
from specdecode.bench.metrics import acceptance, equal_pct, median_wall_s, tokens_per_s
from specdecode.bench.runner import run_benchmark
from specdecode.bench.suites import resolve_settings
from specdecode.data.tasks import Prompt, Task
from specdecode.errors import SpecDecodeError, UnknownDrafterError

# --------------------------------------------------------------------------------------------------------
# Method specs


def test_method_spec_syntax():
    assert parse_method("none") == MethodSpec("none")
    pld = parse_method("pld:k=6:max_ngram=4")
    assert (pld.drafter, pld.k, dict(pld.options), pld.spec) == ("pld", 6, {"max_ngram": 4}, "pld:k=6:max_ngram=4")
    dm = parse_method("draft-model:qwen2.5-coder-0.5b:k=4")
    assert (dm.draft_model, dm.k) == ("qwen2.5-coder-0.5b", 4)
    assert parse_method("pld:max-ngram=4:k=6") == pld  # same configuration, other spelling
    assert pld.option("min_ngram") == 1  # the drafter's own default
    assert pld.with_k(2).spec == "pld:k=2:max_ngram=4"
    assert dm.with_k(8).spec == "draft-model:qwen2.5-coder-0.5b:k=8"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("pld:k=0", "positive integer"),
        ("pld:k=two", "positive integer"),
        ("pld:max_ngram", "OPTION=VALUE"),
        ("pld:k=3:k=4", "twice"),
        ("draft-model", "needs a draft model"),
        (":k=3", "no drafter name"),
    ],
)
def test_method_spec_errors_are_one_line(text, message):
    with pytest.raises(SpecDecodeError, match=message) as info:
        parse_method(text)
    assert "\n" not in str(info.value)


def test_method_list_errors():
    with pytest.raises(UnknownDrafterError):
        parse_methods("none,nonsense")
    with pytest.raises(SpecDecodeError, match="twice"):
        parse_methods("none,pld,pld")
    with pytest.raises(SpecDecodeError, match="empty"):
        parse_methods(" , ")


def test_settings_from_suite_and_overrides(tmp_path):
    quick = resolve_settings("quick")
    assert quick.model == "smollm2-135m" and [m.spec for m in quick.methods] == ["none", "pld"]
    assert str(quick.out) == "bench-out/quick" and quick.sweep_tasks == ("edit",)
    custom = resolve_settings("quick", tasks="mt-bench,rag", draft_lengths="2,4", out=str(tmp_path))
    assert custom.tasks == ("mt-bench", "rag") and custom.sweep_tasks == ("rag",)  # the grounded one
    assert resolve_settings("quick", draft_lengths="none").sweep_tasks == ()
    full_peers = contestants.peer_specs(resolve_settings("full"))
    assert [spec.name for spec in full_peers] == ["hf-plain", "hf-pld", "hf-assisted"]
    assert [spec.matches.spec for spec in full_peers] == ["none", "pld", "draft-model:qwen2.5-coder-0.5b"]
    assert full_peers[1].config["prompt_lookup_num_tokens"] == contestants.PEER_K  # ours is adaptive by default
    assert contestants.peer_specs(resolve_settings("quick", peers=False)) == []
    bad_settings = [
        ({"tasks": "nope"}, "unknown benchmark task"),
        ({"repeats": 0}, "positive integer"),
        ({"draft_lengths": "1,x"}, "comma-separated"),
        ({"tasks": "edit", "sweep_tasks": "rag"}, "not among"),
    ]
    for bad, message in bad_settings:
        with pytest.raises(SpecDecodeError, match=message):
            resolve_settings("quick", **bad)
    with pytest.raises(SpecDecodeError, match="unknown suite"):
        resolve_settings("huge")


def test_sweep_variants_reuse_listed_methods():
    settings = resolve_settings("quick", methods="none,pld:k=4", draft_lengths="2,4")
    assert {spec: base.spec for spec, (_, base) in suites.sweep_methods(settings).items()} == {
        "pld:k=2": "pld:k=4",
        "pld:k=4": "pld:k=4",
    }


# --------------------------------------------------------------------------------------------------------
# Metric arithmetic on hand-made records


def _record(tokens, walls, steps=0, drafted_at=(), accepted_at=()):
    return {
        "token_ids": tokens,
        "new_tokens": len(tokens),
        "wall_s": list(walls),
        "repeats_identical": True,
        "steps": steps,
        "drafted_tokens": sum(drafted_at),
        "accepted_tokens": sum(accepted_at),
        "drafted_at": list(drafted_at),
        "accepted_at": list(accepted_at),
    }


def test_time_is_the_median_and_tokens_per_s_pools_prompts():
    a = _record([1] * 10, [1.0, 9.0, 2.0])  # median 2.0: an outlier repeat does not count
    b = _record([1] * 30, [3.0, 3.0])
    assert median_wall_s(a) == 2.0
    assert tokens_per_s([a, b]) == pytest.approx(40 / 5.0)
    assert tokens_per_s([]) == 0.0


def test_acceptance_pools_raw_counts():
    # prompt 1: 4 steps, drafted 4x at position 1 (3 kept) and 2x at position 2 (1 kept)
    # prompt 2: 2 steps, drafted 2x at position 1 (0 kept)
    pooled = acceptance([_record([1], [1], 4, (4, 2), (3, 1)), _record([1], [1], 2, (2,), (0,))])
    assert pooled.mean_accepted_tokens == pytest.approx((4 + 6) / 6)
    assert pooled.acceptance_rate == pytest.approx(4 / 8)
    assert pooled.by_position == pytest.approx([3 / 6, 1 / 2])
    assert acceptance([_record([1], [1], 5)]).mean_accepted_tokens == 1.0  # plain decoding


def test_equality_percentage():
    ours = {"p1": _record([1, 2, 3], [1]), "p2": _record([4, 5], [1]), "p3": _record([7], [1])}
    plain = {"p1": _record([1, 2, 3], [1]), "p2": _record([4, 6], [1])}
    assert equal_pct(ours, plain) == 50.0  # only prompts measured by both count
    assert equal_pct(ours, {}) is None


def _synthetic_results():
    """Plain at 10 tok/s, pld at 25 tok/s (equal on 1 of 2 prompts), transformers plain at 20 tok/s."""
    task = Task("edit", "edit", [Prompt("e/1", "x", True), Prompt("e/2", "y", True)])
    runs = {
        "none": {"edit": {"e/1": _record([1] * 10, [1.0], 10), "e/2": _record([2] * 10, [1.0], 10)}},
        "pld": {"edit": {"e/1": _record([1] * 10, [0.4], 4, (4,), (4,)), "e/2": _record([3] * 10, [0.4], 4)}},
        "hf-plain": {"edit": {"e/1": _record([1] * 10, [0.5]), "e/2": _record([2] * 10, [0.5])}},
    }
    settings = {
        "suite": "quick",
        "model": "m",
        "methods": ["none", "pld"],
        "baseline": "none",
        "peers": {"hf-plain": {"matches": "none"}},
        "sweep": {},
        "sweep_tasks": [],
        "seed": 0,
        "prompts_per_task": 2,
        "max_new_tokens": 10,
        "repeats": 1,
    }
    prompts = {"edit": [{"id": "e/1"}, {"id": "e/2"}]}
    return {"settings": settings, "runs": runs, "prompts": prompts}, [task]


def test_cells_speedup_equality_and_peer_ratio():
    results, tasks = _synthetic_results()
    cells = {(c.method, c.task): c for c in build_cells(results, tasks)}
    assert set(cells) == {(m, "edit") for m in ("none", "pld", "hf-plain")}  # no "all" for a single task
    assert cells["none", "edit"].speedup == 1.0
    assert cells["pld", "edit"].speedup == pytest.approx(2.5)
    assert cells["pld", "edit"].equal_to_plain_pct == 50.0
    assert cells["pld", "edit"].mean_accepted_tokens == pytest.approx((4 + 8) / 8)
    peer = cells["hf-plain", "edit"]
    assert (peer.kind, peer.matches, peer.mean_accepted_tokens) == ("peer", "none", None)
    assert peer.ours_over_theirs == pytest.approx(10 / 20)
    assert peer.equal_to_ours_pct == 100.0
    text = report.markdown(results, list(cells.values()))
    assert "**we are slower**" in text and "Output differs" in text and "| all |" not in text
    assert "2.50x over plain decoding (goal >= 2x: met)" in text
    assert "  - `pld`: 2.500x on e/1 (2.50–2.50x over 1 repeat)" in text


def test_the_report_says_when_prompts_reach_into_the_training_data():
    """``specdecode train`` draws the prompts after the first ``BENCH_PROMPTS_SKIPPED`` of a task (seed 0)."""
    from specdecode.data.corpus import BENCH_PROMPTS_SKIPPED

    results, tasks = _synthetic_results()
    cells = build_cells(results, tasks)
    for per_task, seed, said in (
        (BENCH_PROMPTS_SKIPPED, 0, False),
        (BENCH_PROMPTS_SKIPPED + 1, 0, True),
        (12, 1, False),
    ):
        results["settings"].update(prompts_per_task=per_task, seed=seed)
        assert ("not held out" in report.markdown(results, cells)) == said, (per_task, seed)


# --------------------------------------------------------------------------------------------------------
# End to end on tiny models

MAX_NEW = 10


def _tiny_tasks(n: int = 2) -> list[Task]:
    words = "w1 w2 w3 w4 w5 w1 w2 w3 w4 w5 w1 w2 w3 here w7 w8 w9 w7 w8"
    return [
        Task("edit", "edit", [Prompt(f"edit/{i}", f"{words} w{10 + i} w{20 + i}", True) for i in range(n)]),
        Task("mt-bench", "chat", [Prompt(f"mt/{i}", f"user w{30 + i} w31 w32 stop", False) for i in range(n)]),
    ]


def _settings(tiny_dirs, out, **overrides):
    values = {
        "model": str(tiny_dirs["target"]),
        "methods": f"none,pld:k=3,draft-model:{tiny_dirs['draft']}:k=2",
        "tasks": "edit,mt-bench",
        "prompts_per_task": 2,
        "max_new_tokens": MAX_NEW,
        "repeats": 2,
        "threads": 1,
        "draft_lengths": "1,3",
        "out": str(out),
    } | overrides
    return resolve_settings("quick", **values)


@pytest.fixture(scope="module")
def finished(tiny_dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    settings = _settings(tiny_dirs, out)
    return settings, run_benchmark(settings, tasks=_tiny_tasks(), progress=False)


def test_end_to_end_results(finished):
    settings, results = finished
    dm = f"draft-model:{settings.methods[2].draft_model}"
    main = ["none", "pld:k=3", f"{dm}:k=2", "hf-plain", "hf-pld", "hf-assisted"]
    variants = ["pld:k=1", f"{dm}:k=1", f"{dm}:k=3"]  # pld:k=3 doubles as the sweep's k=3
    assert sorted(results["runs"]) == sorted(main + variants)
    for name in main + variants:
        tasks = ["edit"] if name in variants else ["edit", "mt-bench"]  # variants run on the sweep task only
        assert sorted(results["runs"][name]) == sorted(tasks)
        for record in results["runs"][name]["edit"].values():
            assert record["new_tokens"] == MAX_NEW and len(record["wall_s"]) == 2
    assert results["settings"]["peers"]["hf-pld"] == {
        "matches": "pld:k=3",
        "family": "transformers",
        "prompt_lookup_num_tokens": 3,
        "max_matching_ngram_size": 3,
    }
    assert results["environment"]["threads"] == 1 and results["environment"]["torch"]
    assert results["environment"]["cpu_capability"]  # AVX2, AVX512...: what the fast path gains depends on it
    assert [p["id"] for p in results["prompts"]["edit"]] == ["edit/0", "edit/1"]
    # Greedy speculative decoding is lossless, and transformers computes the same argmax.
    for cell in results["cells"]:
        assert cell["equal_to_plain_pct"] == 100.0, cell
        assert cell["kind"] != "peer" or cell["equal_to_ours_pct"] == 100.0
    pld = next(c for c in results["cells"] if c["method"] == "pld:k=3" and c["task"] == "edit")
    assert pld["mean_accepted_tokens"] >= 1.0 and len(pld["acceptance_by_position"]) <= 3
    # Our generation time splits into drafting, target forwards and the engine's own overhead.
    assert 0 < pld["draft_share"] < 1 and 0 <= pld["overhead_share"] < 1
    assert next(c for c in results["cells"] if c["method"] == "hf-pld")["overhead_share"] is None


def test_end_to_end_files(finished):
    settings, results = finished
    on_disk = json.loads((settings.out / "results.json").read_text())
    assert on_disk["cells"] == results["cells"] and on_disk["schema_version"] == runner.SCHEMA_VERSION
    text = (settings.out / "results.md").read_text()
    assert "## Against peers" in text and "## Draft length" in text
    for png in ("speedup.png", "draft_length.png"):
        assert (settings.out / png).read_bytes()[:4] == b"\x89PNG"


def test_resume_skips_finished_work(finished, monkeypatch, tmp_path):
    settings, results = finished
    out = tmp_path / "resume"
    out.mkdir()
    partial = json.loads((settings.out / "results.json").read_text())
    del partial["runs"]["pld:k=3"]["mt-bench"]["mt/1"]  # as if interrupted before the last prompt
    (out / "results.json").write_text(json.dumps(partial))

    measured = []
    real_run_group = runner.run_group

    def spy(contestants, *args, **kwargs):
        measured.append([c.name for c in contestants])
        return real_run_group(contestants, *args, **kwargs)

    monkeypatch.setattr(runner, "run_group", spy)
    resumed = run_benchmark(_settings(settings_dirs(settings), out), tasks=_tiny_tasks(), progress=False)
    assert measured == [["pld:k=3"]]
    assert resumed["runs"]["none"] == results["runs"]["none"]  # untouched

    measured.clear()
    monkeypatch.setattr(runner, "load_model", lambda name: pytest.fail("nothing to measure: no model load"))
    run_benchmark(_settings(settings_dirs(settings), out), tasks=_tiny_tasks(), progress=False)
    assert measured == []


def settings_dirs(settings):
    """The tiny model dirs a finished run used (so a test can rebuild the same settings)."""
    return {"target": settings.model, "draft": settings.methods[2].draft_model}


def test_resume_refuses_another_configuration(finished, tmp_path):
    settings, _ = finished
    other = _settings(settings_dirs(settings), settings.out, max_new_tokens=MAX_NEW + 1)
    with pytest.raises(SpecDecodeError, match="another configuration"):
        run_benchmark(other, tasks=_tiny_tasks(), progress=False)


def test_prompt_too_long_for_context(tiny_dirs, tmp_path):
    settings = _settings(
        tiny_dirs, tmp_path, methods="none", max_new_tokens=250, draft_lengths="none", peers=False, repeats=1
    )
    with pytest.raises(SpecDecodeError, match="exceeds the 256-token context"):
        run_benchmark(settings, tasks=_tiny_tasks(1), progress=False)


# --------------------------------------------------------------------------------------------------------
# CLI parsing


def test_bench_and_forward_cost_both_parse():
    parser = argparse.ArgumentParser(prog="specdecode")
    add_bench_command(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", "--suite", "full", "--methods", "none,pld:k=6", "--no-peers"])
    assert (args.run.__name__, args.suite, args.methods, args.peers, args.bench_command, args.drafter_state) == (
        "run_bench",
        "full",
        "none,pld:k=6",
        False,
        None,
        None,
    )
    assert parser.parse_args(["bench", "--drafter-state", "task"]).drafter_state == "task"
    args = parser.parse_args(["bench", "forward-cost", "--model", "m", "--json", "--profile"])
    assert (args.run.__name__, args.model, args.json, args.profile) == ("run_forward_cost", "m", True, True)


def test_adaptive_draft_length_methods():
    method = parse_method("pld:k=auto")
    assert method.k == "auto"
    settings = resolve_settings("quick", methods="none,pld:k=auto,pld:k=4", draft_lengths="2")
    assert contestants.peer_specs(settings)[1].config["prompt_lookup_num_tokens"] == 4
    assert "pld:k=auto" not in {variant.spec for variant, _ in suites.sweep_methods(settings).values()}
    with pytest.raises(SpecDecodeError, match="auto or heuristic"):
        parse_method("pld:k=fast")
    with pytest.raises(SpecDecodeError, match="twice"):
        parse_method(f"pld:k={DEFAULT_K}:k=3")


def _spied_suffix(tiny_target):
    """Our ``suffix`` contestant at a fixed depth, and the steps of every run it makes, in order.  A fixed depth:
    under ``auto`` the depth follows measured timings, so a repeat's steps could differ with the machine's load."""
    contestant = contestants._ours(tiny_target, parse_method("suffix:k=8"), {})
    steps: list[int] = []
    real_run = contestant.run

    def run(prompt_ids, max_new_tokens):
        measured = real_run(prompt_ids, max_new_tokens)
        steps.append(measured.stats.steps)
        return measured

    def stream(prompt_ids, max_new_tokens):  # in lockstep (run_group's default) the request is pulled as events
        for event in real_stream(prompt_ids, max_new_tokens):
            if event.result is not None:
                steps.append(event.result.stats.steps)
            yield event

    real_stream = contestant.stream
    contestant.run, contestant.stream = run, stream
    return contestant, steps


def test_repeats_of_a_learning_drafter_start_cold(tiny_target):
    """A repeat must not profit from the previous repeat of the same prompt (drafter state is reset)."""
    contestant, steps = _spied_suffix(tiny_target)
    records = runner.run_group([contestant], [[5, 17, 22, 9, 30, 41]], 24, repeats=2)
    assert records["suffix:k=8"][0]["repeats_identical"] and steps[0] == steps[1]


def test_a_session_keeps_drafter_state_and_each_repeat_resets_it(tiny_target):
    """Within a group the drafter learns (the second, identical request copies the first one's output);
    every repeat of the group starts from a fresh drafter, so repeats measure the same thing."""
    contestant, steps = _spied_suffix(tiny_target)
    prompt = [5, 17, 22, 9, 30, 41]
    records = runner.run_group([contestant], [prompt, prompt], 32, repeats=2)
    first, second = records["suffix:k=8"]
    assert first["token_ids"] == second["token_ids"] and first["repeats_identical"] and second["repeats_identical"]
    assert steps[1] < steps[0]  # warm: the earlier output is drafted
    assert steps[2:] == steps[:2]  # the second repeat starts cold again
    assert len(first["wall_s"]) == len(second["wall_s"]) == 2


def _session_tasks() -> list[Task]:
    words = "w1 w2 w3 w4 w5 w6 w7 w8 here w9"
    requests = [
        Prompt(f"multi-edit/s#{i}", f"{words} {extra}", True, words, "multi-edit/s")
        for i, extra in enumerate(("w40", "w40 w41", "w40 w41 w42"), start=1)
    ]
    return [Task("multi-edit", "edit", requests), _tiny_tasks(2)[1]]


def test_session_task_end_to_end_and_resume(tiny_dirs, tmp_path, monkeypatch):
    settings = _settings(
        tiny_dirs, tmp_path, methods="none,suffix", tasks="multi-edit,mt-bench", repeats=1, draft_lengths="none"
    )
    assert settings.tasks[0] == "multi-edit" and settings.fingerprint["drafter_state"] == "request"
    calls = []
    real_run_group = runner.run_group

    def spy(contestants, group, *args, **kwargs):
        calls.append(([c.name for c in contestants], len(group)))
        return real_run_group(contestants, group, *args, **kwargs)

    monkeypatch.setattr(runner, "run_group", spy)
    results = run_benchmark(settings, tasks=_session_tasks(), progress=False)
    # One group for the session (3 requests in order), one per ordinary prompt; the peer runs them too.
    assert calls == [
        (["none", "suffix", "hf-plain"], 3),
        (["none", "suffix", "hf-plain"], 1),
        (["none", "suffix", "hf-plain"], 1),
    ]
    assert sorted(results["runs"]["suffix"]["multi-edit"]) == [f"multi-edit/s#{i}" for i in (1, 2, 3)]
    assert [p.get("session") for p in results["prompts"]["multi-edit"]] == ["multi-edit/s"] * 3
    for cell in results["cells"]:
        assert cell["equal_to_plain_pct"] == 100.0, cell
    assert "Drafter state: reset before every prompt" in (tmp_path / "results.md").read_text()

    # Resume: a session missing one request is measured again whole, for that contestant only.
    partial = json.loads((tmp_path / "results.json").read_text())
    del partial["runs"]["suffix"]["multi-edit"]["multi-edit/s#2"]
    (tmp_path / "results.json").write_text(json.dumps(partial))
    calls.clear()
    resumed = run_benchmark(settings, tasks=_session_tasks(), progress=False)
    assert calls == [(["suffix"], 3)]
    assert sorted(resumed["runs"]["suffix"]["multi-edit"]) == [f"multi-edit/s#{i}" for i in (1, 2, 3)]
    assert resumed["runs"]["none"] == results["runs"]["none"]


def test_drafter_state_task_groups_a_whole_task(tmp_path):
    settings = resolve_settings("quick", drafter_state="task", out=str(tmp_path))
    assert settings.fingerprint["drafter_state"] == "task"
    tasks = _tiny_tasks(3)
    assert [len(g) for g in runner.groups(settings, tasks[0])] == [3]
    assert [len(g) for g in runner.groups(resolve_settings("quick"), tasks[0])] == [1, 1, 1]
    assert [len(g) for g in runner.groups(resolve_settings("quick"), _session_tasks()[0])] == [3]
    with pytest.raises(SpecDecodeError, match="drafter state"):
        resolve_settings("quick", drafter_state="forever")


def test_schema_1_results_still_resume(finished, tmp_path, monkeypatch):
    """A results file written before drafter_state existed is read as drafter_state "request", one written
    before default_k existed as measured with K=5 (it resumes only while that is the default), and one written
    before interleave existed as measured request by request."""
    settings, results = finished
    old = json.loads((settings.out / "results.json").read_text())
    old["schema_version"] = 1
    del old["fingerprint"]["drafter_state"], old["fingerprint"]["default_k"]
    (tmp_path / "results.json").write_text(json.dumps(old))
    monkeypatch.setattr(runner, "load_model", lambda name: pytest.fail("nothing to measure: no model load"))
    with pytest.raises(SpecDecodeError, match="another configuration"):
        run_benchmark(_settings(settings_dirs(settings), tmp_path), tasks=_tiny_tasks(), progress=False)
    monkeypatch.setattr(suites, "DEFAULT_K", 5)
    with pytest.raises(SpecDecodeError, match="another configuration"):  # measured request by request
        run_benchmark(_settings(settings_dirs(settings), tmp_path), tasks=_tiny_tasks(), progress=False)
    again = _settings(settings_dirs(settings), tmp_path, interleave="request")
    resumed = run_benchmark(again, tasks=_tiny_tasks(), progress=False)
    assert resumed["schema_version"] == runner.SCHEMA_VERSION and resumed["runs"] == results["runs"]


def test_model_free_goals_are_reported_not_asserted():
    def cell(method, task, tokens_per_s, accepted):
        return CellResult("m", method, "ours", task, 1, 96, 1.0, tokens_per_s, None, 100.0, True, accepted)

    cells = [
        cell("pld", "edit", 100.0, 4.8),
        cell("suffix:k=16", "edit", 140.0, 9.0),
        cell("pld", "summarize", 30.0, 1.4),
        cell("suffix:k=16", "summarize", 31.0, 1.5),
        cell("pld", "mt-bench", 70.0, 2.6),
        cell("recycling", "mt-bench", 60.0, 2.7),
    ]
    lines = report._model_free_goal_lines(cells)
    assert lines == [
        "- `suffix:k=16` on edit: 1.40x the tokens/s of `pld` (goal >= 1.3x: met).",
        "- `suffix:k=16` on summarize: 1.03x the tokens/s of `pld` (goal >= 1.3x: **not met**).",
        "- `recycling` on mt-bench: 2.70 mean accepted tokens vs 2.60 for `pld` (goal: above: met).",
    ]
