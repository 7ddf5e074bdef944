"""The CLI contract: flags, the --json object, and one clear line (exit 2, no traceback) for bad input."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specdecode.cli import main

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # an unknown name must fail fast, not wait on a network


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_json_contract(capsys, tiny_dirs):
    code, out, err = run_cli(
        capsys,
        "generate",
        "w1 w2 w3 w1 w2",
        "--model",
        str(tiny_dirs["target"]),
        "--drafter",
        "pld",
        "--num-draft-tokens",
        "3",
        "--max-new-tokens",
        "12",
        "--ignore-eos",
        "--json",
    )
    assert code == 0, err
    result = json.loads(out)
    assert set(result) >= {"text", "token_ids", "stats"}
    stats_fields = {
        "new_tokens",
        "steps",
        "mean_accepted_tokens",
        "acceptance_rate",
        "tokens_per_s",
        "wall_s",
        "forward_s",
        "overhead_fraction",
    }
    assert set(result["stats"]) >= stats_fields
    assert len(result["token_ids"]) == result["stats"]["new_tokens"] == 12


def test_generate_streams_text_and_prints_stats(capsys, tiny_dirs):
    code, out, err = run_cli(
        capsys,
        "generate",
        "w5 w6",
        "--model",
        str(tiny_dirs["target"]),
        "--drafter",
        "none",
        "--max-new-tokens",
        "5",
        "--chat",
        "--temperature",
        "0.7",
        "--top-p",
        "0.9",
        "--top-k",
        "20",
        "--seed",
        "1",
    )
    assert code == 0, err
    assert out.strip() and "tok/s" in err and "engine overhead" in err


def test_draft_model_flag(capsys, tiny_dirs):
    code, out, err = run_cli(
        capsys,
        "generate",
        "w1 w2",
        "--model",
        str(tiny_dirs["target"]),
        "--drafter",
        "draft-model",
        "--draft-model",
        str(tiny_dirs["draft"]),
        "--max-new-tokens",
        "8",
        "--ignore-eos",
        "--json",
    )
    assert code == 0, err
    assert json.loads(out)["stats"]["new_tokens"] == 8


@pytest.mark.parametrize("command", ["generate", "batch"])
def test_no_coupled_verifies_seeded_sampling_by_rejection(command, capsys, tiny_dirs, tmp_path, monkeypatch):
    import specdecode.verify.exact

    calls: dict[str, int] = {}

    def counted(name: str, verify):
        def wrapper(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return verify(*args, **kwargs)

        return wrapper

    exact = specdecode.verify.exact
    monkeypatch.setattr(exact, "verify_coupled", counted("coupled", exact.verify_coupled))
    rejection = counted("rejection", exact.verify_speculative_sampling)
    monkeypatch.setattr(exact, "verify_speculative_sampling", rejection)
    source = "w1 w2 w3 w1 w2"
    if command == "batch":
        (tmp_path / "prompts.jsonl").write_text(json.dumps({"prompt": source}) + "\n")
        source = str(tmp_path / "prompts.jsonl")
    argv = [command, source, "--model", str(tiny_dirs["target"]), "--temperature", "0.8", "--seed", "1"]
    argv += ["--max-new-tokens", "3", "--ignore-eos", "--json"]
    for flags, verifier in (([], "coupled"), (["--no-coupled"], "rejection")):
        calls.clear()
        code, out, err = run_cli(capsys, *argv, *flags)
        assert code == 0, err
        assert set(calls) == {verifier} and len(json.loads(out)["token_ids"]) == 3


BAD_INPUTS = {
    "empty prompt": (["generate", ""], "prompt is empty"),
    "blank prompt": (["generate", " \n\t "], "prompt is blank (only whitespace)"),
    "max-new-tokens 0": (["generate", "w1", "--max-new-tokens", "0"], "max-new-tokens must be a positive"),
    "max-new-tokens negative": (["generate", "w1", "--max-new-tokens", "-3"], "max-new-tokens must be a positive"),
    "temperature < 0": (["generate", "w1", "--temperature", "-0.5"], "temperature must be >= 0"),
    "top-p 0": (["generate", "w1", "--top-p", "0"], "top-p must be in (0, 1]"),
    "top-p > 1": (["generate", "w1", "--top-p", "1.5"], "top-p must be in (0, 1]"),
    "top-k < 0": (["generate", "w1", "--top-k", "-1"], "top-k must be an integer >= 0"),
    "num-draft-tokens < 0": (["generate", "w1", "--num-draft-tokens", "-2"], "num-draft-tokens must be"),
    "unknown drafter": (["generate", "w1", "--drafter", "telepathy"], "unknown drafter 'telepathy'"),
    "unknown model": (["generate", "w1", "--model", "no-such-org/no-such-model"], "cannot load model"),
    "missing model path": (["generate", "w1", "--model", "./no/such/dir"], "neither a transformers model directory"),
    "draft-model without --draft-model": (["generate", "w1", "--drafter", "draft-model"], "needs --draft-model"),
    "option a drafter does not take": (["generate", "w1", "--draft-model", "x"], "does not take option(s)"),
    "bad pld option": (["generate", "w1", "--drafter-option", "max_ngram=0"], "n-gram sizes"),
    "malformed drafter option": (["generate", "w1", "--drafter-option", "oops"], "KEY=VALUE"),
    "train a head with lr 0": (["train", "hydra", "--lr", "0"], "--lr must be positive"),
    "train a head with negative lr": (["train", "eagle", "--lr=-0.001"], "--lr must be positive"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS), ids=list(BAD_INPUTS))
def test_bad_input_gives_one_clear_line(capsys, tiny_dirs, case):
    argv, message = BAD_INPUTS[case]
    if "--model" not in argv:
        argv = [*argv, "--model", str(tiny_dirs["target"])]
    code, out, err = run_cli(capsys, *argv)
    assert code == 2
    assert err.startswith("specdecode: error: ") and message in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


USAGE_MISTAKES = {
    "not a number": ["generate", "w1", "--max-new-tokens", "abc"],
    "no prompt": ["generate"],
    "unknown flag": ["bench", "--no-such-flag"],
    "unknown command": ["decode", "w1"],
    "subcommand's flag": ["train", "eagle", "--epochs", "many"],
}


@pytest.mark.parametrize("argv", list(USAGE_MISTAKES.values()), ids=list(USAGE_MISTAKES))
def test_usage_mistakes_caught_by_argparse_give_one_line_too(capsys, argv):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("specdecode") and "error: " in err and " -h)" in err


def test_prompt_longer_than_context(capsys, tiny_dirs):
    code, _, err = run_cli(capsys, "generate", " ".join(["w1"] * 400), "--model", str(tiny_dirs["target"]))
    assert code == 2 and "has a context of 256 tokens" in err


def test_vocabulary_mismatch_names_both_tokenizers(capsys, tiny_dirs):
    """hsd needs the target's vocabulary; draft-model drafts across vocabularies (text mapping by default)."""
    argv = ["generate", "w1 w2", "--model", str(tiny_dirs["target"]), "--draft-model", str(tiny_dirs["other-vocab"])]
    code, _, err = run_cli(capsys, *argv, "--drafter", "hsd")
    assert code == 2 and "vocabulary mismatch" in err
    assert str(tiny_dirs["other-vocab"]) in err and str(tiny_dirs["target"]) in err
    code, _, err = run_cli(capsys, *argv, "--drafter", "draft-model", "--max-new-tokens", "4", "--json")
    assert code == 0, err


def test_corrupted_cached_model_is_refused(capsys, tmp_path, monkeypatch, tiny_dirs):
    """A registered model whose cached checkpoint was altered after conversion: clear error, no load."""
    import shutil

    from specdecode.models import registry

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    monkeypatch.setattr(registry, "build_model", lambda spec, model_dir, progress: _fake_build(model_dir, tiny_dirs))
    assert registry.ensure_model("smollm2-135m", progress=False).is_dir()
    weights = next((tmp_path / "models" / "smollm2-135m" / "hf").glob("*.safetensors"))
    with open(weights, "r+b") as handle:
        handle.seek(100)
        handle.write(b"\x00\xff\x00\xff")
    code, _, err = run_cli(capsys, "generate", "hello", "--model", "smollm2-135m")
    last_line = err.strip().splitlines()[-1]  # above it: the verification progress bar
    assert code == 2 and last_line.startswith("specdecode: error: ") and "SHA-256" in last_line
    assert "Traceback" not in err
    shutil.rmtree(tmp_path / "models")


def _fake_build(model_dir, tiny_dirs):
    """Stand-in for download + conversion: copy a tiny checkpoint and write its manifest like a real build."""
    import shutil

    from specdecode.models import conversion, registry

    out = model_dir / "hf"
    shutil.copytree(tiny_dirs["target"], out)
    files = {}
    for path in sorted(p for p in out.rglob("*") if p.is_file()):
        import hashlib

        files[path.relative_to(out).as_posix()] = {
            "size": path.stat().st_size,
            "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        }
    spec = next(s for s in registry.MODELS if s.name == "smollm2-135m")
    manifest = {
        "name": spec.name,
        "source": spec.filename,
        "source_sha256": spec.sha256,
        "conversion": conversion.CONVERSION_VERSION,
        "files": files,
    }
    (out / "manifest.json").write_text(json.dumps(manifest))


def test_models_and_drafters_listing(capsys):
    code, out, _ = run_cli(capsys, "models")
    assert code == 0 and "smollm2-135m" in out and "qwen2.5-coder-1.5b" in out
    code, out, _ = run_cli(capsys, "drafters")
    assert code == 0 and {"none", "pld", "draft-model"} <= {line.split()[0] for line in out.splitlines()}


def test_real_process_exit_code_and_no_traceback():
    src = str(Path(__file__).resolve().parents[1] / "src")
    proc = subprocess.run(
        [sys.executable, "-m", "specdecode.cli", "generate", "hi", "--top-p", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": src},
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == "specdecode: error: top-p must be in (0, 1], got 2.0"


def test_help_models_and_drafters_import_neither_torch_nor_transformers():
    """They must answer at once: torch + transformers take seconds to import (tools/check_startup.py times it)."""
    code = (
        "import sys, contextlib, io\n"
        "from specdecode.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    for argv in (['models'], ['drafters'], ['--help'], ['generate', '--help'], ['bench', '--help']):\n"
        "        try:\n"
        "            main(argv)\n"
        "        except SystemExit:\n"
        "            pass\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in {'torch', 'transformers'}))\n"
    )
    src = str(Path(__file__).resolve().parents[1] / "src")
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": src}
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"


def test_drafter_listing_read_from_source_matches_the_registry():
    from specdecode.cli import drafter_summaries
    from specdecode.drafters import available_drafters, drafter_class

    expected = {}
    for name in available_drafters():
        cls = drafter_class(name)
        doc = (cls.__doc__ or sys.modules[cls.__module__].__doc__ or "").strip()
        expected[name] = doc.splitlines()[0] if doc else ""
    assert drafter_summaries() == expected


def test_every_command_runs_a_function_that_exists():
    """A command's module is imported only when it runs: a misspelt name would otherwise show only then."""
    from specdecode.cli import build_parser
    from specdecode.deferred import Deferred

    def runs(parser: argparse.ArgumentParser):
        if "run" in parser._defaults:
            yield parser.prog, parser._defaults["run"]
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for command in action.choices.values():
                    yield from runs(command)

    found = dict(runs(build_parser()))
    assert {"specdecode generate", "specdecode serve", "specdecode export eagle", "specdecode train judge"} <= set(
        found
    )
    for prog, run in found.items():
        assert callable(run.function() if isinstance(run, Deferred) else run), prog


def test_batch_refuses_blank_prompts_line_by_line(tmp_path, capsys, tiny_dirs):
    path = tmp_path / "prompts.jsonl"
    lines = [{"prompt": "  "}, {"prompt": "w1 w2"}, {"messages": [{"role": "user", "content": "\t"}]}]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    argv = ["batch", str(path), "--model", str(tiny_dirs["target"]), "--json", "--max-new-tokens", "3"]
    code, out, err = run_cli(capsys, *argv)
    rows = [json.loads(line) for line in out.splitlines()]
    assert code == 2 and [row.get("error") for row in rows] == [
        "line 1: prompt is blank (only whitespace)",
        None,
        "line 3: prompt is blank (only whitespace)",
    ]
    assert rows[1]["token_ids"] and err.count("specdecode: error: line") == 2 and "Traceback" not in err


@pytest.fixture(scope="module")
def no_template_dir(tiny_dirs, tmp_path_factory) -> Path:
    """The tiny target without a chat template (like gemma3-270m, a base model)."""
    import shutil

    path = tmp_path_factory.mktemp("plain") / "target"
    shutil.copytree(tiny_dirs["target"], path, ignore=shutil.ignore_patterns("chat_template.jinja"))
    return path


def _prompt_tokens(capsys, *argv: str) -> int:
    code, out, err = run_cli(capsys, "generate", *argv, "--max-new-tokens", "2", "--json")
    assert code == 0, err
    return json.loads(out)["prompt_tokens"]


def test_chat_template_is_the_default_for_text_prompts(capsys, tiny_dirs, no_template_dir):
    """As llama.cpp and most chat CLIs: an instruct model given a bare prompt often answers nothing."""
    model = ["--model", str(tiny_dirs["target"])]
    templated = _prompt_tokens(capsys, "w1 w2", *model)
    assert (
        templated == _prompt_tokens(capsys, "w1 w2", *model, "--chat") == 9  # <s> user : w1 w2 </s> <s> assistant :
    )
    assert _prompt_tokens(capsys, "w1 w2", *model, "--no-chat") == 2  # w1 w2 (this tokenizer adds no BOS)
    # A model without a template takes the text as it is, unless --chat insists on one.
    assert _prompt_tokens(capsys, "w1 w2", "--model", str(no_template_dir)) == 2
    code, _, err = run_cli(capsys, "generate", "w1 w2", "--model", str(no_template_dir), "--chat")
    assert code == 2 and "has no chat template" in err and len(err.strip().splitlines()) == 1


def test_batch_and_demo_apply_the_chat_template_by_default(tmp_path, capsys, tiny_dirs):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "w1 w2"}) + "\n")
    argv = ["batch", str(path), "--model", str(tiny_dirs["target"]), "--json", "--max-new-tokens", "2"]
    rows = [json.loads(run_cli(capsys, *argv, *chat)[1]) for chat in ([], ["--no-chat"])]
    assert [row["prompt_tokens"] for row in rows] == [9, 2]  # as in the test above
    code, out, err = run_cli(capsys, "demo", "--model", str(tiny_dirs["target"]), "--max-new-tokens", "3", "--no-chat")
    assert code == 0 and "speedup" in out, err


def test_registered_draft_model_with_another_vocabulary_is_refused_before_any_download(capsys, monkeypatch, tmp_path):
    from specdecode.decode_commands import check_registry_vocabularies
    from specdecode.models import loading, registry

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))  # nothing cached: any load would download
    for module, name in ((loading, "load_model"), (registry, "ensure_model")):
        monkeypatch.setattr(module, name, lambda *a, **k: pytest.fail("nothing may be loaded or downloaded"))
    argv = ["generate", "hi", "--model", "smollm2-135m", "--drafter", "hsd", "--draft-model", "gemma3-270m"]
    code, _, err = run_cli(capsys, *argv)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert err.startswith("specdecode: error: vocabulary mismatch: draft model 'gemma3-270m' has 262,144 tokens")
    check_registry_vocabularies("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")  # one tokenizer: no error
    check_registry_vocabularies("smollm2-135m", "./my-local-draft")  # not in the registry: checked once loaded


def test_third_party_log_lines_only_with_verbose(tiny_dirs, tmp_path):
    """transformers warns about this model's generation config on load: a line a user cannot act on."""
    import shutil

    model = shutil.copytree(tiny_dirs["target"], tmp_path / "noisy")
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**config, "do_sample": False, "temperature": 0.5}))
    src = str(Path(__file__).resolve().parents[1] / "src")
    argv = [sys.executable, "-m", "specdecode", "generate", "w1", "--model", str(model), "--max-new-tokens", "2"]
    quiet, verbose = (
        subprocess.run(
            [*argv, *flags, "--json"],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "PYTHONPATH": src},
        )
        for flags in ([], ["--verbose"])
    )
    assert quiet.returncode == verbose.returncode == 0, quiet.stderr + verbose.stderr
    assert json.loads(quiet.stdout)["token_ids"] and quiet.stderr == ""
    assert "generation flags are not valid" in verbose.stderr


def test_quiet_third_party_hides_python_warnings_and_restores_what_it_changed():
    import logging
    import warnings

    from transformers.utils import logging as transformers_logging

    from specdecode.verbosity import quiet_third_party

    before, env_before = transformers_logging.get_verbosity(), os.environ.get("TRANSFORMERS_VERBOSITY")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with quiet_third_party():
            warnings.warn("noise from a library", UserWarning, stacklevel=1)
            assert transformers_logging.get_verbosity() == logging.ERROR
        with quiet_third_party(quiet=False):
            warnings.warn("shown with --verbose", UserWarning, stacklevel=1)
    assert [str(w.message) for w in seen] == ["shown with --verbose"]
    assert transformers_logging.get_verbosity() == before and os.environ.get("TRANSFORMERS_VERBOSITY") == env_before
