"""How many threads torch's intra-op pool uses: as many CPUs as this process can really have right now.

Why: torch's OpenMP threads meet at a barrier after every parallel region.  When another process keeps one
of two cores busy, a two-thread forward waits at each barrier for the thread that lost its core to get it
back, many times per forward: beside one busy process, two-thread decoding keeps a tenth of its idle speed or less
and one thread keeps most of it (``docs/results/contention-smollm2-135m``).  (OpenMP's passive wait policy avoids
the collapse but costs a large share of the idle speed, so it is no answer.)

So the :class:`ThreadGovernor` looks, before a forward and at most every ``interval_s``, at how much CPU the
other processes used since its last look (the busy time of our CPUs in ``/proc/stat`` minus this process's
own) and gives torch the CPUs they left: the CPUs this process may use (torch's default count — physical
cores, or ``OMP_NUM_THREADS`` — capped by the process's affinity and a cgroup quota) minus the others'
share, rounded, at least one.  A change is made only after two looks agree, so a
short burst elsewhere does not flap the thread count.

A thread count chosen by the user is left alone: ``SPECDECODE_THREADS=N``, :func:`fixed_threads` (what the
benchmarks use), or ``torch.set_num_threads`` called after the governor last set it.  Where ``/proc/stat``
does not exist (not Linux) or a cgroup quota caps the process (the host's load is then not ours to
share), the count is the available CPUs and does not move.

Thread counts change the order of floating-point sums inside some kernels, as batch shapes already do:
greedy speculative output stays the target's greedy output; a run's logits can differ in the last bits.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from specdecode.errors import SpecDecodeError

THREADS_ENV = "SPECDECODE_THREADS"
PROC_STAT = Path("/proc/stat")
CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def process_cpus() -> list[int]:
    """The CPU ids this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def cgroup_quota(path: Path = CGROUP_CPU_MAX) -> float | None:
    """CPUs' worth of time a cgroup (v2) quota allows this process per period, or None if unlimited."""
    try:
        quota, period = path.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


@dataclass(frozen=True)
class CpuSample:
    """Busy CPU-seconds of a set of CPUs and of this process, at one moment."""

    when: float
    busy_s: float
    own_s: float


def read_sample(cpus: list[int], stat_text: str, own_s: float, when: float) -> CpuSample:
    """Parse ``/proc/stat``: a ``cpuN`` line's fields are user, nice, system, idle, iowait, irq, softirq, steal
    (in clock ticks); busy is everything but idle and iowait."""
    wanted = {f"cpu{cpu}" for cpu in cpus}
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    busy = 0
    for line in stat_text.splitlines():
        fields = line.split()
        if fields and fields[0] in wanted:
            values = [int(v) for v in fields[1:9]]
            busy += sum(values) - values[3] - values[4]
    return CpuSample(when, busy / ticks, own_s)


def others_cpus(previous: CpuSample, sample: CpuSample) -> float:
    """CPUs' worth of time other processes kept busy between two samples (one busy process: 1.0)."""
    elapsed = sample.when - previous.when
    if elapsed <= 0:
        return 0.0
    return max(0.0, (sample.busy_s - previous.busy_s) - (sample.own_s - previous.own_s)) / elapsed


def sample_cpus(cpus: list[int], when: float) -> CpuSample:
    """A sample of ``cpus`` and of this process now (``/proc/stat``; OSError where it cannot be read)."""
    times = os.times()
    return read_sample(cpus, PROC_STAT.read_text(), times.user + times.system, when)


class OthersLoad:
    """Over a ``with`` block: the share of this process's CPUs that other processes kept busy (0 where
    ``/proc/stat`` cannot be read).  Above ``MAX_OTHERS_SHARE`` the block's timings are not this machine's alone:
    a cost curve timed beside a training job priced a two-token forward at 2.03 one-token ones where it costs
    1.2 (so such timings are not kept on disk, :mod:`specdecode.models.cost`)."""

    MAX_OTHERS_SHARE = 0.25

    def __enter__(self) -> OthersLoad:
        self.share = 0.0
        self._cpus = process_cpus()
        self._start = self._sample()
        return self

    def __exit__(self, *exc: object) -> None:
        end = self._sample()
        if self._start is not None and end is not None:
            self.share = others_cpus(self._start, end) / len(self._cpus)

    def _sample(self) -> CpuSample | None:
        try:
            return sample_cpus(self._cpus, time.monotonic())
        except OSError:
            return None

    @property
    def busy(self) -> bool:
        return self.share > self.MAX_OTHERS_SHARE


def threads_from_environment() -> int | None:
    """The thread count ``SPECDECODE_THREADS`` fixes (None: not set); a bad value is the user's error, raised
    when a model loads, before any work."""
    value = os.environ.get(THREADS_ENV, "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise SpecDecodeError(f"{THREADS_ENV} must be a positive integer, got {value!r}")
    return int(value)


def default_threads() -> int:
    """A benchmark's thread count when ``--threads`` is not given: ``SPECDECODE_THREADS``, else the number of
    cores."""
    return threads_from_environment() or os.cpu_count() or 1


def threads_for(available: int, others_share: float) -> int:
    """Threads to run with when other processes keep ``others_share`` CPUs busy (one busy process: 1.0)."""
    return max(1, min(available, math.floor(available - others_share + 0.5)))


class ThreadGovernor:
    """Sets ``torch.set_num_threads`` to the CPUs other processes leave free (see the module docstring)."""

    def __init__(self, interval_s: float = 0.25) -> None:
        self.interval_s = interval_s
        self.cpus = process_cpus()
        quota = cgroup_quota()
        # torch's own default (physical cores, or OMP_NUM_THREADS) is the most we ever use.
        self._torch_default = torch.get_num_threads()
        self.available = max(1, min(self._torch_default, len(self.cpus), math.floor(quota or len(self.cpus))))
        self.adaptive = quota is None and PROC_STAT.exists() and self.available > 1
        self.pinned: int | None = None
        self._started = False
        self._set: int | None = None  # the count this governor last gave torch
        self._last: CpuSample | None = None
        self._proposed: int | None = None

    @property
    def threads(self) -> int:
        """The count forwards run with now."""
        return torch.get_num_threads()

    def before_forward(self) -> None:
        """Called before each forward: cheap (a clock read) except once per ``interval_s``."""
        if not self._started:
            self._start()
        if self._set is not None and torch.get_num_threads() != self._set:
            self.pinned = self._set = torch.get_num_threads()  # someone chose a count after us: theirs stands
        if self.pinned is not None:
            self._apply(self.pinned)
            return
        if self._set is None:
            self._apply(self.available)
        if not self.adaptive:
            return
        now = time.monotonic()
        if self._last is not None and now - self._last.when < self.interval_s:
            return
        sample = self._sample(now)
        previous, self._last = self._last, sample
        if previous is None:
            return
        wanted = threads_for(self.available, others_cpus(previous, sample))
        if wanted == self._set:
            self._proposed = None
        elif wanted == self._proposed:
            self._apply(wanted)
            self._proposed = None
        else:
            self._proposed = wanted

    def pin(self, threads: int | None) -> int | None:
        """Run with ``threads`` from now on (None: govern again); returns the previous pin."""
        if not self._started:
            self._start()
        previous, self.pinned = self.pinned, threads
        self._proposed = None
        self._apply(threads if threads is not None else self.available)
        return previous

    def _start(self) -> None:
        """Take the user's choice, if any: the environment variable, or a count set before the first forward."""
        self._started = True
        if (chosen := threads_from_environment()) is not None:
            self.pinned = chosen
        elif torch.get_num_threads() != self._torch_default:
            self.pinned = torch.get_num_threads()

    def _sample(self, now: float) -> CpuSample:
        return sample_cpus(self.cpus, now)

    def _apply(self, threads: int) -> None:
        # Compared with torch's own count, not ``_set``: a pin must hold even if someone changed the count
        # since (``before_forward`` adopts such a change before it gets here).
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        self._set = threads


GOVERNOR = ThreadGovernor()


@contextmanager
def fixed_threads(threads: int | None) -> Iterator[None]:
    """Run with exactly ``threads`` threads (a benchmark's recorded setting; None: as the governor chooses),
    then as before."""
    previous = GOVERNOR.pin(threads)
    try:
        yield
    finally:
        GOVERNOR.pin(previous)
