"""``--quantize auto``: the fastest weight format by its timings, timed once per machine and model and then read from
the cache; an explicit format is taken as it is; the auto-loaded model decodes as plain decoding of the format it
chose, and the command line names the choice."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import PROMPTS, run
from specdecode.cli import main
from specdecode.drafters import create_drafter
from specdecode.models import auto_quantize, cpu_kernels, loading
from specdecode.models.auto_quantize import auto_format, candidate_formats, choose_format, fastest_format
from specdecode.models.quantize import QUANTIZE_MODES
from specdecode.models.quantized_layers import QuantizedLinear
from tiny_models import tiny_llama

#: Seconds of a decoding step and an 8-token verification: Qwen2.5-1.5B's on the AMX Xeon (docs/quantization.md).
XEON_QWEN = {"none": (0.250, 0.312), "int8": (0.123, 0.295), "int4": (0.078, 0.184), "bf16": (0.145, 0.155)}


@pytest.fixture
def curves(tmp_path, monkeypatch):
    """A cache file of the test's own, on a machine no other process keeps busy."""
    path = tmp_path / "curves.json"
    monkeypatch.setenv("SPECDECODE_COST_CURVES", str(path))
    monkeypatch.setattr(auto_quantize.OthersLoad, "busy", property(lambda self: False))
    return path


def test_the_fastest_format_is_the_one_with_the_least_step_plus_half_a_verification():
    assert fastest_format(XEON_QWEN) == "int4"
    # int8's step is the fastest, but its verification costs bf16's twice: a drafter's verifications decide.
    assert fastest_format({"int8": (0.100, 0.400), "bf16": (0.140, 0.160)}) == "bf16"
    assert fastest_format({"none": (0.1, 0.2), "int4": (0.1, 0.2)}) == "none"  # a tie keeps the published weights
    with pytest.raises(ValueError):
        fastest_format({})


def test_formats_are_timed_once_per_machine_and_model_then_read_from_the_cache(curves):
    timed = []

    def timer(mode):
        timed.append(mode)
        return XEON_QWEN.get(mode)  # w4a8: does not run here

    candidates = ("none", "int8", "int4", "bf16", "w4a8")
    first = choose_format(tiny_llama(seed=0), candidates, timer)
    assert first.mode == "int4" and not first.cached and first.kept and timed == list(candidates)
    assert set(first.timings) == set(XEON_QWEN)  # the one that did not run is passed over
    assert json.loads(curves.read_text())

    def no_timing(mode):
        raise AssertionError(f"timed {mode} although the choice was cached")

    again = choose_format(tiny_llama(seed=1), candidates, no_timing)  # other weights, the same structure
    assert again.mode == "int4" and again.cached and again.timings == first.timings
    assert "cached in" in again.summary("m") and "int4 78.0+184.0" in again.summary("m")
    timed.clear()
    choose_format(tiny_llama(seed=0, layers=1), candidates, timer)  # another model: timed anew
    choose_format(tiny_llama(seed=0), candidates[:4], timer)  # other formats on offer: timed anew
    previous = torch.get_num_threads()
    torch.set_num_threads(previous + 1)
    try:
        choose_format(tiny_llama(seed=0), candidates, timer)  # another thread count: timed anew
    finally:
        torch.set_num_threads(previous)
    choose_format(tiny_llama(seed=0), candidates, timer, fast_path=False)  # fp32 on other kernels: timed anew
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(auto_quantize, "bf16_panels_pay", lambda: not cpu_kernels.bf16_panels_pay())
        choose_format(tiny_llama(seed=0), candidates, timer)  # bf16 on the other product: timed anew
    assert timed == [*candidates, *candidates[:4], *candidates, *candidates, *candidates]
    timed.clear()
    edited = {key: {**entry, "timings": "fast"} for key, entry in json.loads(curves.read_text()).items()}
    curves.write_text(json.dumps(edited))
    assert choose_format(tiny_llama(seed=0), candidates, timer).mode == "int4" and timed == list(candidates)


def test_a_choice_timed_on_a_busy_machine_serves_this_process_but_is_not_kept(curves, monkeypatch):
    monkeypatch.setattr(auto_quantize.OthersLoad, "busy", property(lambda self: True))
    model = tiny_llama(seed=0, layers=3)
    choice = choose_format(model, ("none", "bf16"), XEON_QWEN.get)
    assert choice.mode == "bf16" and not choice.kept and "not kept" in choice.summary("m")
    assert not curves.exists()
    assert choose_format(model, ("none", "bf16"), lambda mode: pytest.fail("timed twice")) is choice


def test_off_the_cpu_auto_is_fp32_untimed():
    choice = auto_format(tiny_llama(seed=0), torch.device("cuda"), fast_path=False)
    assert choice.mode == "none" and "not on cuda" in choice.summary("m")


def test_an_explicit_format_is_loaded_without_timing_anything(tiny_dirs, monkeypatch, capsys):
    monkeypatch.setattr(auto_quantize, "time_format", lambda *a: pytest.fail("timed an explicit format"))
    loaded = loading.load_model(str(tiny_dirs["target"]), quantize="int4")
    assert loaded.quantize == "int4" and "[quantize auto]" not in capsys.readouterr().err


def test_auto_decodes_as_plain_decoding_of_the_format_it_chose(tiny_dirs, curves, capsys):
    """Timed for real on the tiny model (which format wins is this machine's business, not the test's)."""
    auto = loading.load_model(str(tiny_dirs["target"]), quantize="auto")
    chosen = auto.quantize
    err = capsys.readouterr().err
    assert chosen in candidate_formats() and f"[quantize auto] {chosen} for " in err and err.count("\n") == 1
    assert all(f" {mode} " in err for mode in candidate_formats() if mode != "w4a8")  # w4a8 may fail to build
    quantized = any(isinstance(m, QuantizedLinear) for m in auto.backend.model.modules())
    assert quantized == (chosen != "none")
    reference = loading.load_model(str(tiny_dirs["target"]), quantize=chosen)
    for prompt in PROMPTS:
        plain, _ = run(reference, create_drafter("none", reference), prompt, max_new_tokens=24)
        for drafter in ("none", "pld"):
            tokens, _ = run(auto, create_drafter(drafter, auto), prompt, max_new_tokens=24, num_draft_tokens=3)
            assert tokens == plain, f"{drafter} under auto ({chosen}) left plain decoding of {chosen}"
    again = loading.load_model(str(tiny_dirs["target"]), quantize="auto")
    assert again.quantize == chosen and "cached in" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--quantize", "--quantize-draft"])
def test_the_command_line_names_the_format_auto_chose(tiny_dirs, curves, monkeypatch, capsys, flag):
    monkeypatch.setattr(auto_quantize, "time_format", lambda model, mode, fast_path: XEON_QWEN.get(mode))
    target, draft = str(tiny_dirs["target"]), str(tiny_dirs["draft"])
    drafting = ["--drafter", "draft-model", "--draft-model", draft] if flag == "--quantize-draft" else []
    argv = ["generate", "w1 w2", "--model", target, *drafting, flag, "auto", "--max-new-tokens", "4", "--json"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    named = draft if flag == "--quantize-draft" else target
    lines = [line for line in captured.err.splitlines() if line.startswith("[quantize auto]")]
    assert lines == [f"[quantize auto] int4 for {named}: " + lines[0].split(": ", 1)[1]]
    assert len(json.loads(captured.out)["token_ids"]) == 4


def test_auto_is_one_of_the_values_every_quantize_flag_lists(capsys):
    for argv in (["generate", "--help"], ["serve", "--help"], ["bench", "forward-cost", "--help"]):
        with pytest.raises(SystemExit):
            main(argv)
        assert "w4a8,auto}" in capsys.readouterr().out
    assert "auto" not in QUANTIZE_MODES  # a format is what auto resolves to


def test_the_python_api_takes_auto_and_says_what_it_chose(tiny_dirs, curves, monkeypatch, capsys):
    import specdecode

    monkeypatch.setattr(auto_quantize, "time_format", lambda model, mode, fast_path: XEON_QWEN.get(mode))
    generator = specdecode.load(str(tiny_dirs["target"]), quantize="auto", max_new_tokens=4)
    assert generator.target.quantize == "int4" and "[quantize auto] int4 for " in capsys.readouterr().err


def test_a_benchmark_of_auto_reports_the_format_it_chose(tiny_dirs, curves, monkeypatch, tmp_path):
    from specdecode.bench.runner import run_benchmark
    from specdecode.bench.suites import resolve_settings
    from specdecode.data.tasks import Prompt, Task

    monkeypatch.setattr(auto_quantize, "time_format", lambda model, mode, fast_path: XEON_QWEN.get(mode))
    settings = resolve_settings(
        "quick",
        model=str(tiny_dirs["target"]),
        methods="none,pld:k=3",
        tasks="edit",
        prompts_per_task=1,
        max_new_tokens=4,
        repeats=1,
        threads=1,
        draft_lengths="none",
        peers=False,
        quantize="auto",
        out=str(tmp_path / "bench"),
    )
    results = run_benchmark(settings, tasks=[Task("edit", "edit", [Prompt("edit/0", "w1 w2 w1 w2", True)])])
    assert results["settings"]["quantize"] == "auto" and results["environment"]["quantize"] == "int4"
    assert "(auto: int4 weights)" in (tmp_path / "bench" / "results.md").read_text()
