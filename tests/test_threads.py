"""The thread governor: parsing the kernel's CPU counters, the thread count it derives, its hysteresis, and
that a thread count chosen by the user always stands (pure functions and scripted samples; no timing)."""

from __future__ import annotations

import os

import pytest
import torch

from specdecode.errors import SpecDecodeError
from specdecode.threads import (
    THREADS_ENV,
    CpuSample,
    ThreadGovernor,
    cgroup_quota,
    default_threads,
    read_sample,
    threads_for,
)

STAT = """cpu  300 0 100 900 50 0 0 0 0 0
cpu0 100 0 50 400 20 0 0 0 0 0
cpu1 200 0 50 500 30 5 5 10 0 0
intr 12345
"""


@pytest.fixture(autouse=True)
def restore_torch_threads():
    previous = torch.get_num_threads()
    yield
    torch.set_num_threads(previous)


def test_read_sample_sums_the_busy_ticks_of_our_cpus_only():
    ticks = read_sample([1], STAT, own_s=0.5, when=2.0)
    # cpu1: user 200 + system 50 + irq 5 + softirq 5 + steal 10; idle and iowait are not busy.
    assert ticks.busy_s * _clock_ticks() == pytest.approx(270)
    assert (ticks.own_s, ticks.when) == (0.5, 2.0)
    both = read_sample([0, 1], STAT, own_s=0.0, when=0.0)
    assert both.busy_s * _clock_ticks() == pytest.approx(270 + 150)


def _clock_ticks() -> int:
    import os

    return os.sysconf("SC_CLK_TCK")


@pytest.mark.parametrize(
    ("available", "others", "threads"),
    [(2, 0.0, 2), (2, 0.3, 2), (2, 0.93, 1), (2, 1.0, 1), (2, 3.0, 1), (4, 1.0, 3), (4, 0.6, 3), (1, 0.0, 1)],
)
def test_threads_leave_the_others_their_share(available, others, threads):
    assert threads_for(available, others) == threads


def test_cgroup_quota(tmp_path):
    cpu_max = tmp_path / "cpu.max"
    assert cgroup_quota(cpu_max) is None  # no file: no cgroup v2 limit
    cpu_max.write_text("max 100000\n")
    assert cgroup_quota(cpu_max) is None
    cpu_max.write_text("150000 100000\n")
    assert cgroup_quota(cpu_max) == 1.5


class ScriptedGovernor(ThreadGovernor):
    """A governor of two CPUs whose samples say others used ``others[i]`` CPUs during interval i."""

    def __init__(self, others: list[float]) -> None:
        super().__init__(interval_s=0.0)
        self.available, self.adaptive = 2, True
        self._torch_default = torch.get_num_threads()
        self._script = iter(others)
        self._clock = 0.0
        self._busy = 0.0

    def _sample(self, now: float) -> CpuSample:
        if self._last is not None:
            self._clock += 1.0
            self._busy += next(self._script)  # our own time is left at zero: all busy time is theirs
        return CpuSample(self._clock, self._busy, 0.0)


def run(governor: ThreadGovernor, forwards: int) -> list[int]:
    counts = []
    for _ in range(forwards):
        governor.before_forward()
        counts.append(torch.get_num_threads())
    return counts


def test_one_busy_process_takes_one_of_two_threads_after_two_agreeing_looks(monkeypatch):
    monkeypatch.delenv(THREADS_ENV, raising=False)
    governor = ScriptedGovernor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    # First look (no interval yet), busy, busy → 1, busy, idle (a proposal only), busy, idle, idle → 2.
    assert run(governor, 8) == [2, 2, 1, 1, 1, 1, 1, 2]


def test_a_count_the_user_chose_stands(monkeypatch):
    monkeypatch.delenv(THREADS_ENV, raising=False)
    governor = ScriptedGovernor([1.0] * 10)
    assert run(governor, 3) == [2, 2, 1]
    torch.set_num_threads(2)  # the user (or a benchmark) chose two threads after the governor acted
    assert run(governor, 5) == [2] * 5
    assert (governor.pinned, torch.get_num_threads()) == (2, 2)


def test_environment_variable_pins_and_is_checked(monkeypatch):
    monkeypatch.setenv(THREADS_ENV, "1")
    governor = ScriptedGovernor([0.0] * 5)
    assert run(governor, 4) == [1, 1, 1, 1]
    monkeypatch.setenv(THREADS_ENV, "two")
    with pytest.raises(SpecDecodeError, match=THREADS_ENV):
        ScriptedGovernor([]).before_forward()


def test_benchmarks_run_with_the_environment_count_unless_told(monkeypatch):
    from specdecode.bench.suites import resolve_settings

    monkeypatch.setenv(THREADS_ENV, "1")
    assert default_threads() == 1
    assert resolve_settings(suite="quick").threads == 1
    assert resolve_settings(suite="quick", threads=2).threads == 2
    monkeypatch.delenv(THREADS_ENV)
    assert default_threads() == os.cpu_count()


def test_a_bad_environment_value_is_refused_when_a_model_loads(monkeypatch, tiny_dirs):
    from specdecode.models.loading import load_model

    monkeypatch.setenv(THREADS_ENV, "0")
    with pytest.raises(SpecDecodeError, match=f"{THREADS_ENV} must be a positive integer, got '0'"):
        load_model(str(tiny_dirs["target"]))


def test_pin_and_release(monkeypatch):
    monkeypatch.delenv(THREADS_ENV, raising=False)
    governor = ScriptedGovernor([1.0] * 10)
    assert governor.pin(1) is None
    assert run(governor, 3) == [1, 1, 1]
    assert governor.pin(None) == 1
    assert torch.get_num_threads() == 2  # back to the available count, governed again
