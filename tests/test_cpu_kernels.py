"""Our CPU kernels build, and keep their rows' bits, at every instruction-set level torch dispatches to on this CPU
below its own: a machine with AVX2 only builds them from the same sources as an AVX-512 one, with other flags
(``ISA_FLAGS``), and a construct that compiles at one level only (a 16-float vector in one register) leaves such a
machine on torch's kernels with nothing but a logged warning."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specdecode.models.cpu_kernels import ISA_FLAGS, cpu_kernels_built

pytestmark = pytest.mark.skipif(not cpu_kernels_built(), reason="the CPU kernels are not built here")

#: torch's dispatch levels, lowest first, as ATEN_CPU_CAPABILITY names them.
LEVELS = ("AVX2", "AVX512")
HERE = str(torch.backends.cpu.get_cpu_capability())
BELOW = [level for level in LEVELS[: LEVELS.index(HERE)] if level in ISA_FLAGS] if HERE in LEVELS else []
TESTS = Path(__file__).parent


def at_level(level: str, *command: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "ATEN_CPU_CAPABILITY": level.lower()}
    return subprocess.run([sys.executable, *command], env=env, capture_output=True, text=True, timeout=600)


def test_the_levels_below_this_cpus_are_known():
    assert HERE not in LEVELS or all(level in ISA_FLAGS for level in LEVELS[: LEVELS.index(HERE) + 1])


@pytest.mark.slow
@pytest.mark.parametrize("level", BELOW)
def test_the_kernels_build_and_keep_each_rows_bits_at_a_lower_level(level):
    check = "import torch; from specdecode.models.cpu_kernels import cpu_kernels_built as b; "
    check += "print(torch.backends.cpu.get_cpu_capability(), b())"
    built = at_level(level, "-c", check)
    assert built.stdout.split() == [level, "True"], built.stderr[-2000:]
    files = [str(TESTS / name) for name in ("test_attention_kernel.py", "test_panel_linear.py")]
    rows = at_level(level, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", *files)
    assert rows.returncode == 0 and " skipped" not in rows.stdout.splitlines()[-1], rows.stdout[-3000:]
