"""The benchmark's per-prompt check of issue 17's "never slower": speed-ups paired repeat by repeat."""

from __future__ import annotations

import pytest

from specdecode.bench import report
from specdecode.bench.cells import prompt_speedups, slowest_prompts
from specdecode.bench.metrics import paired_speedups


def timed(*wall_s: float, tokens: int = 64) -> dict:
    return {"new_tokens": tokens, "wall_s": list(wall_s)}


def test_a_repeat_is_compared_with_the_same_repeat_of_the_baseline():
    # The host slowed by half in the second repeat: each ratio is 1.0, though the medians' ratio would not be.
    assert paired_speedups(timed(4.0, 6.0), timed(4.0, 6.0)) == [1.0, 1.0]
    assert paired_speedups(timed(2.0, 3.0, tokens=32), timed(5.0, 6.0)) == pytest.approx([1.25, 1.0])


def test_each_method_is_judged_by_its_slowest_prompt():
    plain = {"chat": {"chat/1": timed(5.0, 5.0), "chat/2": timed(5.0, 7.0)}, "edit": {"edit/1": timed(6.0, 6.0)}}
    runs = {
        "none": plain,
        "pld": {"chat": {"chat/1": timed(4.0, 4.0), "chat/2": timed(5.0, 7.0)}, "edit": {"edit/1": timed(3.0, 3.0)}},
        "layer-skip": {
            "chat": {"chat/1": timed(5.5, 5.5), "chat/2": timed(5.0, 7.5)},
            "edit": {"edit/1": timed(6.0, 6.0)},
        },
    }
    results = {
        "settings": {"methods": ["none", "pld", "layer-skip"], "baseline": "none"},
        "prompts": {"chat": [{"id": "chat/1"}, {"id": "chat/2"}], "edit": [{"id": "edit/1"}]},
        "runs": runs,
    }
    slowest = {p.method: p for p in slowest_prompts(prompt_speedups(results))}
    assert set(slowest) == {"pld", "layer-skip"}
    assert (slowest["pld"].prompt, slowest["pld"].median) == ("chat/2", 1.0)
    assert (slowest["layer-skip"].prompt, slowest["layer-skip"].median) == ("chat/1", pytest.approx(5 / 5.5))
    lines = report._never_slower_lines(prompt_speedups(results))
    assert "**not met** by 1 of 2 methods" in lines[0]
    assert lines[1:3] == [
        "  - `layer-skip`: 0.909x on chat/1 (0.91–0.91x over 2 repeats)",
        "  - `pld`: 1.000x on chat/2 (1.00–1.00x over 2 repeats)",
    ]


def test_cells_that_drafted_nothing_are_reported_as_the_noise_floor():
    plain = {"chat": {"chat/1": timed(5.0, 5.0, 5.0)}, "edit": {"edit/1": timed(6.0, 6.0, 6.0)}}
    drafted = {**timed(4.0, 4.0, 4.0), "drafted_tokens": 30}
    runs = {
        "none": plain,
        "none:k=1": {"chat": {"chat/1": timed(5.2, 5.6, 4.9)}, "edit": {"edit/1": timed(6.0, 6.1, 6.0)}},
        "draft-model": {"chat": {"chat/1": timed(5.5, 5.4, 5.6)}, "edit": {"edit/1": drafted}},
    }
    results = {
        "settings": {"methods": ["none", "none:k=1", "draft-model"], "baseline": "none"},
        "prompts": {"chat": [{"id": "chat/1"}], "edit": [{"id": "edit/1"}]},
        "runs": runs,
    }
    measured = prompt_speedups(results)
    assert [p.drafted for p in measured] == [0, 0, 0, 30]
    lines = report._never_slower_lines(measured)
    assert lines[-1].startswith("- 3 cells drafted nothing (plain decoding under another name")
    assert f"read {5.0 / 5.5:.3f}–{1.0:.3f}x, the lowest `draft-model` on chat/1" in lines[-1]
