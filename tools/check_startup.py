"""How long the commands that load no model take to answer, in fresh processes (a benchmark, not a test:
timings depend on the machine and its load, so the test suite only checks that torch is not imported).

    python tools/check_startup.py                 # median of 5 runs of each command, fails over --limit
    python tools/check_startup.py --runs 9 --limit 0.5

``specdecode --help``, ``models`` and ``drafters`` should answer in well under a second: importing torch and
transformers alone takes seconds on a small machine (far longer under load), so they must not be imported.
Exits 1 when a command's median exceeds ``--limit`` seconds or a command imported torch or transformers.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

COMMANDS = (["--help"], ["models"], ["drafters"], ["generate", "--help"])
HEAVY = ("torch", "transformers")


def wall_times(argv: list[str], runs: int) -> list[float]:
    """Wall time of ``python -m specdecode argv`` in ``runs`` fresh processes."""
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "specdecode", *argv], check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    return times


def heavy_imports(argv: list[str]) -> list[str]:
    """The heavy top-level packages ``python -X importtime -m specdecode argv`` imported."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "specdecode", *argv], check=True, capture_output=True, text=True
    )
    names = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    return sorted(name for name in names if name in HEAVY)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="fresh processes per command (the median counts)")
    parser.add_argument("--limit", type=float, default=1.0, help="seconds a command's median may take")
    args = parser.parse_args()
    failed = False
    for argv in COMMANDS:
        times = wall_times(argv, args.runs)
        heavy = heavy_imports(argv)
        median = statistics.median(times)
        ok = median <= args.limit and not heavy
        failed |= not ok
        command = " ".join(["specdecode", *argv])
        print(
            f"{command:<26} median {median:.2f} s (min {min(times):.2f}, max {max(times):.2f}) "
            f"heavy imports: {', '.join(heavy) or 'none'}  {'ok' if ok else 'TOO SLOW'}"
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
