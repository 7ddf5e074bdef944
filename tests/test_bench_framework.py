"""What every ``specdecode bench`` command does alike (:mod:`specdecode.bench.benchmark`): its help, its one-line
errors on bad values before anything is loaded, the flags ``bench`` passes down, and its refusal to resume a
results directory of other settings; and a toy sub-command, one test-local class, run through the CLI."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from helpers import assert_one_line_error, bench_parser
from specdecode.bench import benchmark
from specdecode.bench.arguments import SHARED, Flag
from specdecode.bench.benchmark import Benchmark, benchmarks, register_benchmark
from specdecode.bench.commands.suite import BenchSuite
from specdecode.cli import main
from specdecode.errors import SpecDecodeError

COMMANDS = [BenchSuite(), *(cls() for cls in benchmarks().values())]
#: Flags that keep a run small, should it get as far as its prompts (it must not get further).
SMALL = {"bench": ["--tasks", "edit"], "throughput": ["--tasks", "edit"], "serve": ["--tasks", "edit"]}
SMALL |= {"contention": ["--tasks", "edit"], "quality": ["--tasks", "2"], "adapt": ["--requests", "2"]}


def argv_of(command: Benchmark, *flags: str) -> list[str]:
    return ["bench", *([command.name] if command.name else []), *flags]


def flags_of(command: Benchmark) -> set[str]:
    return set(command.arguments())


@pytest.fixture
def nothing_loads(monkeypatch):
    """Every command's model loading fails the test: what is checked here is refused before any load."""
    for command in COMMANDS:
        if hasattr(command.implementation, "load_model"):  # a benchmark of toy models (multidraft) loads none
            monkeypatch.setattr(command.implementation, "load_model", lambda *a, **k: pytest.fail("nothing may load"))


def test_every_sub_command_is_registered():
    assert set(benchmarks()) == {
        *(
            "adapt",
            "contention",
            "coupling",
            "forward-cost",
            "multidraft",
            "quality",
            "serve",
            "structured",
            "throughput",
        )
    }


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c.label)
def test_help_shows_every_flag(command, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv_of(command, "--help"))
    assert info.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: specdecode {command.label}")
    for name, spec in command.arguments().items():
        flag = SHARED[name] if isinstance(spec, str) else spec
        assert (flag.option or "--" + name.replace("_", "-")) in text


def test_no_help_loads_torch():
    """The parser is built from the commands' declarations alone: what measures is imported when it runs."""
    argvs = [argv_of(command, "--help") for command in COMMANDS]
    code = (
        "import contextlib, io, sys\n"
        "from specdecode.cli import main\n"
        f"for argv in {argvs!r}:\n"
        "    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "        main(argv)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in {'torch', 'transformers'}))\n"
    )
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": src}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c.label)
def test_an_unknown_flag_is_a_one_line_usage_error(command, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv_of(command, "--no-such-flag"))
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "unrecognized arguments: --no-such-flag" in err and "\n" not in err


@pytest.mark.parametrize(
    ("command", "flag", "value"),
    [
        pytest.param(command, flag, "0", id=f"{command.label} {flag}")
        for command in COMMANDS
        for flag in ("max_new_tokens", "threads", "prompts_per_task", "requests", "repeats")
        if flag in flags_of(command)
    ],
)
def test_a_count_below_one_is_a_one_line_error_before_any_load(command, flag, value, capsys, nothing_loads):
    option = "--" + flag.replace("_", "-")
    assert_one_line_error(capsys, argv_of(command, option, value), "must be a positive integer")


@pytest.mark.parametrize("command", [c for c in COMMANDS if c.name], ids=lambda c: c.label)
def test_flags_given_to_bench_reach_the_sub_command(command):
    args = bench_parser().parse_args(["bench", "--model", "m", "--out", "o", command.name])
    assert (args.model, args.bench_command, args.run.__name__) == ("m", command.name, command.entry)
    if "out" in flags_of(command):
        assert args.out == "o"
    if "model" in flags_of(command):  # a benchmark of toy models (multidraft) takes none
        again = bench_parser().parse_args(["bench", "--model", "m", command.name, "--model", "m2"])
        assert again.model == "m2"  # repeated after the sub-command: its own value


@pytest.mark.parametrize("command", [c for c in COMMANDS if (c.name or "bench") in SMALL], ids=lambda c: c.label)
def test_resume_refuses_results_of_other_settings(command, tmp_path, capsys, nothing_loads):
    other = {"schema_version": 0, "fingerprint": {"model": "another", "max_new_tokens": 1, "prompts": []}}
    (tmp_path / "results.json").write_text(json.dumps(other))
    small = SMALL[command.name or "bench"]
    assert_one_line_error(capsys, argv_of(command, *small, "--out", str(tmp_path), "--no-progress"), "holds results")
    assert json.loads((tmp_path / "results.json").read_text()) == other  # never overwritten


# --------------------------------------------------------------------------------------------------------
# A new sub-command is one class


@dataclass(frozen=True)
class ToySettings:
    rounds: int
    out: Path


class Toy(Benchmark):
    """Counts to ``--rounds`` and writes what it counted."""

    name = "toy"
    help = "count to N"
    files = "results.md"

    def arguments(self) -> dict[str, Any]:
        return {
            "rounds": Flag(type=int, metavar="N", help="how far (default 3)"),
            "out": "output directory",
            "progress": "no progress bar",
        }

    def resolve(self, given: dict[str, Any]) -> ToySettings:
        rounds = given["rounds"] if given["rounds"] is not None else 3
        if rounds < 1:
            raise SpecDecodeError(f"--rounds must be a positive integer, got {rounds}")
        return ToySettings(rounds, Path(given["out"] or "bench-out/toy"))

    def measure(self, settings: ToySettings, progress: bool) -> dict[str, Any]:
        settings.out.mkdir(parents=True, exist_ok=True)
        (settings.out / "results.md").write_text(f"# toy\n\ncounted to {settings.rounds}, progress {progress}\n")
        return {"rounds": settings.rounds}


@pytest.fixture
def toy_registered(monkeypatch):
    monkeypatch.setattr(benchmark, "_REGISTRY", dict(benchmarks()))
    register_benchmark(Toy)


def test_a_toy_sub_command_runs_through_the_cli(toy_registered, tmp_path, capsys):
    assert "toy" in benchmarks()
    assert main(["bench", "toy", "--rounds", "4", "--out", str(tmp_path), "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("# toy\n\ncounted to 4, progress False")
    assert f"[bench toy] wrote {tmp_path}/ (results.md) in " in captured.err
    assert_one_line_error(capsys, ["bench", "toy", "--rounds", "0"], "--rounds must be a positive integer, got 0")
    args = bench_parser().parse_args(["bench", "toy"])
    assert args.run.__name__ == "run_toy" and args.bench_command == "toy"
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    assert "toy" in capsys.readouterr().out


def test_a_name_registered_twice_is_refused(toy_registered):
    other = type("OtherToy", (Toy,), {})
    with pytest.raises(ValueError, match="registered twice"):
        register_benchmark(other)


def test_a_benchmark_declares_its_flags_once(toy_registered):
    parser = argparse.ArgumentParser(prog="specdecode")
    Toy().add_to(parser, keep_given=False)
    args = parser.parse_args([])
    assert (args.rounds, args.out, args.run.__name__) == (None, None, "run_toy")
