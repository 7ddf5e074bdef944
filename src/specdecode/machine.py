"""The machine the numbers were measured on, as the benchmark reports it and the cost-curve cache keys it."""

from __future__ import annotations

import functools
import platform
from pathlib import Path


def _cpuinfo(field: str) -> str | None:
    """The first ``field`` line's value in ``/proc/cpuinfo`` (Linux), or None."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(field):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    return _cpuinfo("model name") or platform.processor() or platform.machine()


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux names them (``/proc/cpuinfo``: ``avx512_vnni``, ``avx_vnni``...); empty
    where that file is not there."""
    return frozenset((_cpuinfo("flags") or "").split())
