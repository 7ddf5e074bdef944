"""``specdecode bench serve`` on the tiny target: a real uvicorn server in-process driven by the real ``openai``
client — every cell, equality with ``none`` at C=1 (and with solo decoding), client-side TTFT/ITL, resume,
refusal of other settings, the report files, and CLI parsing and errors.

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
from specdecode.bench import serve, serve_client, serve_report
from specdecode.cli import main
from specdecode.errors import SpecDecodeError
from specdecode.generator import SpeculativeGenerator
from specdecode.models.quantize import draft_quantization

MAX_NEW = BENCH_MAX_NEW
CELLS = [("none", 1), ("none", 2), ("pld", 1), ("pld", 2)]
KEYS = ["edit/edit/0", "edit/edit/1", "mt-bench/mt/0"]


def _settings(tiny_dirs, out, **overrides):
    return tiny_bench_settings(serve.resolve_settings, tiny_dirs, out, **{"concurrency": "2,1", **overrides})


@pytest.fixture(scope="module")
def finished(tiny_dirs, tmp_path_factory):
    settings = _settings(tiny_dirs, tmp_path_factory.mktemp("serve"))
    return settings, serve.run_serve_bench(settings, tasks=tiny_bench_tasks(), progress=False)


def _cells(results):
    return cells_by(results, "concurrency")


def test_every_cell_measured_lossless_with_client_side_latencies(finished, tiny_target):
    settings, results = finished
    cells = _cells(results)
    assert list(cells) == CELLS  # the reference (none at C=1) first
    for (method, concurrency), cell in cells.items():
        assert [r["prompt"] for r in cell["per_request"]] == KEYS
        assert cell["requests"] == 3
        assert cell["completion_tokens"] == sum(r["completion_tokens"] for r in cell["per_request"]) > 0
        assert cell["tokens_per_s"] > 0 and cell["wall_s"] > 0
        # Greedy outputs through the server equal none's at C=1, whatever the drafter and the concurrency.
        assert cell["equal_to_none_c1"] == 1.0, (method, concurrency)
        assert 0 < cell["ttft_p50_s"] <= cell["ttft_p95_s"] <= cell["wall_s"]
        assert 0 < cell["itl_p50_s"] <= cell["itl_p95_s"] <= cell["wall_s"]
        assert cell["latency_p95_s"] <= cell["wall_s"] + 1e-3
        assert cell["mean_acceptance_length"] >= 1.0
        for record in cell["per_request"]:
            assert record["completion_tokens"] <= MAX_NEW and record["finish_reason"] in {"stop", "length"}
            assert len(record["chunk_gaps_s"]) == len(record["chunk_tokens"]) - 1
            assert all(gap >= 0 for gap in record["chunk_gaps_s"]) and min(record["chunk_tokens"]) >= 1
            # The tiny tokenizer maps a word to a token, so the re-encoded chunks hold every generated token but
            # those without text (EOS, or a special token the detokeniser skips: one here, in edit/0).
            assert 0 <= record["completion_tokens"] - sum(record["chunk_tokens"]) <= 1
        assert cell["chunk_tokens"] == sum(sum(r["chunk_tokens"]) for r in cell["per_request"])
    assert cells["none", 1]["mean_acceptance_length"] == cells["none", 2]["mean_acceptance_length"] == 1.0
    # The reference is what solo plain decoding of the same chat prompt gives.
    solo = SpeculativeGenerator.build(tiny_target, "none")
    reference = {r["prompt"]: r["text"] for r in cells["none", 1]["per_request"]}
    for task in tiny_bench_tasks():
        for p in task.prompts:
            want = solo.generate(p.text, chat=True, max_new_tokens=MAX_NEW)
            assert reference[f"{task.name}/{p.id}"] == want.text
    assert results["fingerprint"] == {
        "model": settings.model,
        "max_new_tokens": MAX_NEW,
        "max_batch_size": 2,  # the largest concurrency
        "quantize": "none",
        "prompts": results["fingerprint"]["prompts"],
    }
    assert len(results["fingerprint"]["prompts"]) == 3
    assert results["settings"]["methods"] == ["none", "pld"] and results["settings"]["concurrency"] == [1, 2]
    assert results["endpoint"] == "/v1/chat/completions" and [p["prompt"] for p in results["prompts"]] == KEYS
    env = results["environment"]
    assert env["cpu_capability"] and env["threads"] == 1 and env["openai"] and env["uvicorn"]


def test_files_written(finished):
    settings, results = finished
    text = saved_report(settings, results)
    for heading in (
        "## Tokens/s (all requests)",
        "## Tokens/s over `none` at the same C",
        "## Time to first token p95 (ms)",
        "## Inter-token latency p95 (ms)",
        "## Mean acceptance length",
        "## Outputs identical to `none` at C=1",
    ):
        assert heading in text
    assert "One run on one machine" in text and "share this CPU" in text
    assert results["environment"]["cpu_capability"] in text
    assert "| `pld` |" in text and "| method | C=1 | C=2 |" in text and "| `none` | 1.00x | 1.00x |" in text
    assert (settings.out / "serve.png").read_bytes()[:4] == b"\x89PNG"


def test_rerun_resumes_without_measuring(finished, monkeypatch, tmp_path):
    settings, results = finished
    forbid(monkeypatch, serve, "load_model", "ClientProcess", "InProcessServer")
    again = serve.run_serve_bench(settings, tasks=tiny_bench_tasks(), progress=False)
    assert again["cells"] == results["cells"]

    # A directory missing one cell measures that cell only, after one warm-up of its method.
    out = without_cell(settings, tmp_path / "partial", "concurrency", ("pld", 2))
    monkeypatch.undo()
    cells, warmups = [], []
    real_run_cell, real_stream_one = serve_client.ClientProcess.run_cell, serve_client.ClientProcess.stream_one

    def spy_cell(self, url, model, chat, texts, method, concurrency, max_tokens):
        cells.append((method.spec, concurrency, len(texts)))
        return real_run_cell(self, url, model, chat, texts, method, concurrency, max_tokens)

    def spy_warmup(self, url, model, chat, text, method, max_tokens):
        warmups.append((method.spec, max_tokens))
        return real_stream_one(self, url, model, chat, text, method, max_tokens)

    monkeypatch.setattr(serve_client.ClientProcess, "run_cell", spy_cell)
    monkeypatch.setattr(serve_client.ClientProcess, "stream_one", spy_warmup)
    resumed = serve.run_serve_bench(
        _settings({"target": settings.model}, out), tasks=tiny_bench_tasks(), progress=False
    )
    assert cells == [("pld", 2, 3)]
    assert warmups == [("pld", serve.WARMUP_TOKENS)]
    assert list(_cells(resumed)) == CELLS and _cells(resumed)["pld", 2]["equal_to_none_c1"] == 1.0


def test_other_settings_are_refused(finished):
    settings, _ = finished
    for change in ({"max_new_tokens": MAX_NEW + 1}, {"max_batch_size": 4}):
        other = _settings({"target": settings.model}, settings.out, **change)
        with pytest.raises(SpecDecodeError, match="other settings") as info:
            serve.run_serve_bench(other, tasks=tiny_bench_tasks(), progress=False)
        assert "\n" not in str(info.value)
    with pytest.raises(SpecDecodeError, match="other settings"):
        serve.run_serve_bench(settings, tasks=tiny_bench_tasks()[:1], progress=False)  # other prompts


def test_itl_divides_each_gap_by_the_tokens_its_chunk_carried():
    record = {"chunk_tokens": [2, 3, 1], "chunk_gaps_s": [0.3, 0.1]}
    assert serve_report.itl_samples(record) == pytest.approx([0.1, 0.1, 0.1, 0.1])
    assert serve_report.itl_samples({"chunk_tokens": [4], "chunk_gaps_s": []}) == []


# --------------------------------------------------------------------------------------------------------
# CLI


def test_cli_parses_flags_and_defaults():
    args = bench_parser().parse_args(
        [
            "bench",
            "serve",
            "--model",
            "m",
            "--concurrency",
            "1,4",
            "--methods",
            "none,pld:k=5",
            "--tasks",
            "edit",
            "--prompts-per-task",
            "2",
            "--max-new-tokens",
            "16",
            "--max-batch-size",
            "3",
            "--out",
            "o",
            "--threads",
            "1",
            "--no-progress",
        ]
    )
    assert args.run.__name__ == "run_bench_serve" and args.bench_command == "serve"
    assert (args.model, args.concurrency, args.methods, args.tasks, args.prompts_per_task) == (
        "m",
        "1,4",
        "none,pld:k=5",
        "edit",
        2,
    )
    assert (args.max_new_tokens, args.max_batch_size, args.out, args.threads, args.progress) == (16, 3, "o", 1, False)
    defaults = bench_parser().parse_args(["bench", "--model", "m2", "serve"])
    assert (defaults.model, defaults.progress, getattr(defaults, "concurrency", None)) == ("m2", True, None)
    settings = serve.resolve_settings()
    assert settings.concurrency == (1, 4, 8) and settings.max_batch_size == 8 and settings.max_new_tokens == 96
    assert [m.spec for m in settings.methods] == ["none", "pld", "suffix"] and settings.model == "smollm2-135m"
    assert str(settings.out) == "bench-out/serve" and len(settings.tasks) == 8 and settings.prompts_per_task == 1
    assert serve.resolve_settings(concurrency="8,2,2").concurrency == (2, 8)
    # Draft models load as generate loads them: int4 by default, fp32 for one that adapts, or as asked.
    assert (settings.quantize, settings.quantize_draft) == ("none", None)  # no draft model served
    drafting = serve.resolve_settings(methods="none,draft-model:qwen2.5-coder-0.5b")
    assert drafting.quantize_draft == draft_quantization(None, "none")
    adapting = serve.resolve_settings(methods="draft-model:qwen2.5-coder-0.5b:adapt=true")
    assert adapting.quantize_draft == "none"
    assert (
        serve.resolve_settings(methods="draft-model:m", quantize="bf16", quantize_draft="int8").quantize_draft == "int8"
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--concurrency", "0"], "--concurrency takes comma-separated positive integers"),
        (["--concurrency", "x"], "--concurrency takes comma-separated positive integers"),
        (["--concurrency", "1,-2"], "--concurrency takes comma-separated positive integers"),
        (["--methods", "none,nonsense"], "nonsense"),
        (["--tasks", "edit,nope"], "unknown benchmark task 'nope'"),
        (["--max-batch-size", "0"], "--max-batch-size must be a positive integer"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be a positive integer"),
        (["--methods", "draft-model:m", "--quantize-draft", "int3"], "--quantize-draft"),
    ],
)
def test_cli_errors_are_one_line(flags, message, capsys, monkeypatch):
    monkeypatch.setattr(serve, "load_model", lambda *a, **k: pytest.fail("bad flags: nothing is loaded"))
    monkeypatch.setattr(serve, "load_tasks", lambda *a, **k: pytest.fail("bad flags: no prompts are loaded"))
    assert_one_line_error(capsys, ["bench", "serve", *flags, "--no-progress"], message)


def test_cli_end_to_end_prints_the_report(finished, monkeypatch, capsys):
    """The CLI on the finished directory: it resumes (nothing to measure) and prints results.md."""
    settings, _ = finished
    monkeypatch.setattr(serve, "load_tasks", lambda names, n, seed: tiny_bench_tasks())
    monkeypatch.setattr(serve, "load_model", lambda *a, **k: pytest.fail("nothing to measure"))
    flags = f"--model {settings.model} --methods none,pld --concurrency 1,2 --tasks edit,mt-bench --max-new-tokens "
    flags += f"{MAX_NEW} --threads 1 --out {settings.out} --no-progress"
    assert main(["bench", "serve", *flags.split()]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# specdecode server under load") and "## Tokens/s (all requests)" in out


def test_another_server_is_measured_beside_ours_on_the_same_prompts(tiny_dirs, tiny_target, tmp_path):
    """``--url LABEL=URL``: another OpenAI-compatible server (here a second specdecode server, drafting with
    ``pld``, which the benchmark sends no ``speculative`` field) gets cells of its own, its texts compared with
    our plain decoding's and its speculation read from its ``/metrics``."""
    from test_server import RunningServer, make_service

    with RunningServer(make_service(tiny_target, drafter="pld")) as other:
        settings = _settings(
            tiny_dirs, tmp_path, methods="none", concurrency="1", servers=f"other={other.url}/v1", served_model="tiny"
        )
        results = serve.run_serve_bench(settings, tasks=tiny_bench_tasks(), progress=False)
        drafted = serve.speculation_counters(serve_client.metrics_text(other.url))
    cells = _cells(results)
    assert list(cells) == [("none", 1), ("other", 1)]
    assert cells["other", 1]["equal_to_none_c1"] == 1.0 and cells["other", 1]["completion_tokens"] > 0
    assert drafted["spec_decode_num_drafts_total"] > 0
    assert cells["other", 1]["mean_acceptance_length"] >= 1.0
    assert cells["none", 1]["mean_acceptance_length"] is None or cells["none", 1]["mean_acceptance_length"] == 1.0
    assert results["servers"] == {"other": {"url": other.url, "model": "tiny"}}
    assert "| `other` |" in (tmp_path / "results.md").read_text()


def test_other_servers_are_named_once_each_with_a_url():
    assert serve.parse_servers("vllm=http://127.0.0.1:8000/v1/, x=https://h:1, http://10.1.2.3:9/v1") == (
        ("vllm", "http://127.0.0.1:8000"),
        ("x", "https://h:1"),
        ("10.1.2.3:9", "http://10.1.2.3:9"),
    )
    for bad in ("vllm", "=http://h", "vllm=h:8000", "http://"):
        with pytest.raises(SpecDecodeError, match=r"--url takes \[LABEL=\]http"):
            serve.parse_servers(bad)
    with pytest.raises(SpecDecodeError, match="unique and differ from --methods: pld"):
        serve.resolve_settings(methods="none,pld", servers="pld=http://127.0.0.1:1")


def test_speculation_is_read_from_vllm_counters():
    text = (
        "# TYPE vllm:spec_decode_num_drafts counter\n"
        'vllm:spec_decode_num_drafts_total{model_name="m",engine="0"} 10.0\n'
        "# TYPE vllm:spec_decode_num_accepted_tokens counter\n"
        'vllm:spec_decode_num_accepted_tokens_total{model_name="m",engine="0"} 25.0\n'
    )
    assert serve.speculation_counters(text) == {
        "spec_decode_num_drafts_total": 10.0,
        "spec_decode_num_accepted_tokens_total": 25.0,
    }
    assert serve.acceptance_over({}, serve.speculation_counters(text)) == 3.5
    assert serve.acceptance_over({}, {}) is None
