"""``specdecode bench throughput`` on tiny models: cells, equality with solo plain decoding, resume, refusal of
other settings, the report files, the transformers batched peer, and CLI parsing and errors.

Timings are never asserted beyond being positive and ordered."""

from __future__ import annotations

import pytest

from helpers import (
    BENCH_MAX_NEW,
    assert_one_line_error,
    bench_parser,
    cells_by,
    forbid,
    saved_report,
    tiny_bench_settings,
    tiny_bench_tasks,
    without_cell,
)
from specdecode.bench import metrics, peers, throughput
from specdecode.cli import main
from specdecode.errors import SpecDecodeError

MAX_NEW = BENCH_MAX_NEW
OURS = [("none", 1), ("none", 2), ("pld", 1), ("pld", 2)]
PEER = [(throughput.PEER, 1), (throughput.PEER, 2)]


def _settings(tiny_dirs, out, **overrides):
    return tiny_bench_settings(throughput.resolve_settings, tiny_dirs, out, **{"batch_sizes": "1,2", **overrides})


@pytest.fixture(scope="module")
def finished(tiny_dirs, tmp_path_factory):
    settings = _settings(tiny_dirs, tmp_path_factory.mktemp("throughput"))
    return settings, throughput.run_throughput(settings, tasks=tiny_bench_tasks(), progress=False)


def _cells(results):
    return cells_by(results, "batch_size")


def test_every_cell_measured_and_lossless(finished):
    settings, results = finished
    cells = _cells(results)
    assert list(cells) == OURS + PEER  # the solo plain reference first, the peer last
    keys = ["edit/edit/0", "edit/edit/1", "mt-bench/mt/0"]
    reference = {r["prompt"]: r["token_ids"] for r in cells["none", 1]["per_request"]}
    assert list(reference) == keys
    for (method, batch_size), cell in cells.items():
        assert (cell["requests"], cell["new_tokens"]) == (3, 3 * MAX_NEW)
        assert cell["tokens_per_s"] > 0 and cell["wall_s"] > 0
        assert 0 < cell["latency_p50_s"] <= cell["latency_p95_s"] <= cell["wall_s"] + 1e-9
        assert all(len(r["token_ids"]) == MAX_NEW for r in cell["per_request"])
        if cell["kind"] == "ours":
            # Batched greedy decoding is lossless: every request equals its solo plain output.
            assert cell["equal_to_solo_plain"] == 1.0, (method, batch_size)
            assert cell["mean_accepted_tokens"] >= 1.0
        else:
            assert cell["kind"] == "peer" and cell["mean_accepted_tokens"] is None
            assert 0.0 <= cell["equal_to_solo_plain"] <= 1.0
    assert cells["none", 1]["mean_accepted_tokens"] == 1.0  # plain decoding
    assert results["fingerprint"]["model"] == settings.model and results["fingerprint"]["max_new_tokens"] == MAX_NEW
    assert len(results["fingerprint"]["prompts"]) == 3
    assert results["environment"]["cpu_capability"] and results["environment"]["threads"] == 1
    assert results["settings"]["methods"] == ["none", "pld"] and results["settings"]["batch_sizes"] == [1, 2]
    assert results["chat_template"] is True and [p["prompt"] for p in results["prompts"]] == keys


def test_files_written(finished):
    settings, results = finished
    text = saved_report(settings, results)
    for heading in (
        "Tokens/s (all requests)",
        "Latency p95",
        "over our `none` at the same B",
        "over our `none` at B=1",
        f"over `{throughput.PEER}` at the same B",
    ):
        assert heading in text
    assert "One run on one machine" in text and results["environment"]["cpu_capability"] in text
    assert "| `pld` |" in text and f"| `{throughput.PEER}` |" in text and "B=2" in text
    assert (settings.out / "throughput.png").read_bytes()[:4] == b"\x89PNG"


def test_rerun_resumes_without_measuring(finished, monkeypatch, tmp_path):
    settings, results = finished
    forbid(monkeypatch, throughput, "load_model", "run_ours", "run_peer")
    again = throughput.run_throughput(settings, tasks=tiny_bench_tasks(), progress=False)
    assert again["cells"] == results["cells"]

    # A directory missing one cell measures that cell only.
    out = without_cell(settings, tmp_path / "partial", "batch_size", ("pld", 2))
    monkeypatch.undo()
    measured = []
    real_run_ours = throughput.run_ours

    def spy(generator, method, prompts, batch_size, max_new_tokens):
        measured.append((method.spec, batch_size, len(prompts), max_new_tokens))
        return real_run_ours(generator, method, prompts, batch_size, max_new_tokens)

    monkeypatch.setattr(throughput, "run_ours", spy)
    resumed = throughput.run_throughput(
        _settings({"target": settings.model}, out), tasks=tiny_bench_tasks(), progress=False
    )
    assert measured == [("pld", 2, 2, throughput.WARMUP_TOKENS), ("pld", 2, 3, MAX_NEW)]  # warm-up, then the cell
    assert list(_cells(resumed)) == OURS + PEER and _cells(resumed)["pld", 2]["equal_to_solo_plain"] == 1.0


def test_other_settings_are_refused(finished):
    settings, _ = finished
    other = _settings({"target": settings.model}, settings.out, max_new_tokens=MAX_NEW + 1)
    with pytest.raises(SpecDecodeError, match="other settings") as info:
        throughput.run_throughput(other, tasks=tiny_bench_tasks(), progress=False)
    assert "\n" not in str(info.value)
    with pytest.raises(SpecDecodeError, match="other settings"):
        throughput.run_throughput(settings, tasks=tiny_bench_tasks()[:1], progress=False)  # other prompts


def test_solo_plain_reference_always_runs_first(tiny_dirs, tmp_path):
    settings = _settings(tiny_dirs, tmp_path, methods="pld:k=3", batch_sizes="2", peers=False, max_new_tokens=4)
    results = throughput.run_throughput(settings, tasks=tiny_bench_tasks(), progress=False)
    assert list(_cells(results)) == [("none", 1), ("pld:k=3", 2)]
    assert _cells(results)["pld:k=3", 2]["equal_to_solo_plain"] == 1.0
    assert "| `none` |" in (tmp_path / "results.md").read_text()


def test_batched_peer_matches_solo_transformers(tiny_target):
    model = tiny_target.backend.model
    prompts = [[5, 17, 22, 9, 30, 41], [7], [12, 13, 14, 12, 13, 14, 12, 13]]
    result = peers.hf_plain_batched(model, prompts, 6, ignore_eos=True, pad_token_id=2)
    tokens, wall_s = result  # unpacks as (token lists, wall time)
    assert wall_s > 0 and [len(t) for t in tokens] == [6, 6, 6]
    assert tokens == [peers.hf_plain(model, p, 6, ignore_eos=True).token_ids for p in prompts]
    with pytest.raises(SpecDecodeError):
        peers.hf_plain_batched(model, [[5], []], 4)


def test_percentile():
    assert metrics.percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert metrics.percentile([1.0, 2.0], 95) == pytest.approx(1.95)
    assert metrics.percentile([4.0], 95) == 4.0


# --------------------------------------------------------------------------------------------------------
# CLI


def test_cli_parses_flags():
    args = bench_parser().parse_args(
        [
            "bench",
            "throughput",
            "--model",
            "m",
            "--methods",
            "none,pld:k=5",
            "--batch-sizes",
            "1,4",
            "--tasks",
            "edit",
            "--prompts-per-task",
            "2",
            "--max-new-tokens",
            "16",
            "--seed",
            "3",
            "--out",
            "o",
            "--no-peers",
            "--threads",
            "1",
            "--no-progress",
        ]
    )
    assert args.run.__name__ == "run_throughput" and args.bench_command == "throughput"
    assert (args.model, args.methods, args.batch_sizes, args.tasks, args.prompts_per_task) == (
        "m",
        "none,pld:k=5",
        "1,4",
        "edit",
        2,
    )
    assert (args.max_new_tokens, args.seed, args.out, args.peers, args.threads, args.progress) == (
        16,
        3,
        "o",
        False,
        1,
        False,
    )
    defaults = bench_parser().parse_args(["bench", "--model", "m2", "throughput"])
    assert (defaults.model, defaults.peers, defaults.progress, getattr(defaults, "batch_sizes", None)) == (
        "m2",
        None,
        True,
        None,
    )
    settings = throughput.resolve_settings(methods="none,pld:k=5")
    assert settings.batch_sizes == (1, 2, 4, 8) and settings.max_new_tokens == 96 and settings.peers
    assert str(settings.out) == "bench-out/throughput" and settings.model == "smollm2-135m"
    assert len(settings.tasks) == 8 and settings.prompts_per_task == 1 and settings.methods[1].k == 5
    assert [m.spec for m in throughput.resolve_settings().methods] == ["none", "pld", "suffix"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--batch-sizes", "0"], "--batch-sizes takes comma-separated positive integers"),
        (["--batch-sizes", "x"], "--batch-sizes takes comma-separated positive integers"),
        (["--batch-sizes", "1,-2"], "--batch-sizes takes comma-separated positive integers"),
        (["--methods", "none,nonsense"], "nonsense"),
        (["--tasks", "edit,nope"], "unknown benchmark task 'nope'"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be a positive integer"),
        (["--threads", "0"], "--threads must be a positive integer"),
    ],
)
def test_cli_errors_are_one_line(flags, message, capsys, monkeypatch):
    monkeypatch.setattr(throughput, "load_model", lambda *a, **k: pytest.fail("bad flags: nothing is loaded"))
    assert_one_line_error(capsys, ["bench", "throughput", *flags, "--no-progress"], message)


def test_cli_end_to_end_prints_the_report(finished, monkeypatch, capsys):
    """The CLI on the finished directory: it resumes (nothing to measure) and prints results.md."""
    settings, _ = finished
    monkeypatch.setattr(throughput, "load_tasks", lambda names, n, seed: tiny_bench_tasks())
    monkeypatch.setattr(throughput, "load_model", lambda *a, **k: pytest.fail("nothing to measure"))
    assert (
        main(
            [
                "bench",
                "throughput",
                "--model",
                settings.model,
                "--methods",
                "none,pld",
                "--batch-sizes",
                "2,1",
                "--tasks",
                "edit,mt-bench",
                "--max-new-tokens",
                str(MAX_NEW),
                "--threads",
                "1",
                "--out",
                str(settings.out),
                "--no-progress",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out.startswith("# specdecode batched throughput") and "## Tokens/s (all requests)" in out
