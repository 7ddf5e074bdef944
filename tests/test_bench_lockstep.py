"""The benchmark's lockstep: our methods decode a prompt in turns, each timed over its own turns, each request
reading a clock that stands still while the others take theirs."""

from __future__ import annotations

import time

from specdecode import clock
from specdecode.bench import contestants, runner
from specdecode.bench.lockstep import run_lockstep
from specdecode.bench.methods import parse_method
from specdecode.generator import GenerationResult, SpeculativeGenerator, StreamEvent
from specdecode.stats import GenerationStats


def _sleeping_request(step_s: float, steps: int, order: list[str], name: str, elapsed: list[float]):
    """A stand-in request: ``steps`` steps of ``step_s`` seconds, noting its turns and its own clock's reading."""
    started = clock.now()
    for _ in range(steps):
        order.append(name)
        time.sleep(step_s)
        yield StreamEvent("", [1])
    elapsed.append(clock.now() - started)
    yield StreamEvent("", [], GenerationResult("", [1] * steps, 3, "length", GenerationStats()))


def test_turns_alternate_and_each_clock_excludes_the_others_turns():
    order: list[str] = []
    quick_clock: list[float] = []
    slow_clock: list[float] = []
    measured = run_lockstep(
        {
            "quick": _sleeping_request(0.002, 3, order, "quick", quick_clock),
            "slow": _sleeping_request(0.05, 5, order, "slow", slow_clock),
        }
    )
    assert order == ["quick", "slow"] * 3 + ["slow"] * 2  # one step each in turn; the slower one goes on alone
    assert measured["quick"].token_ids == [1, 1, 1] and measured["slow"].token_ids == [1] * 5
    # The quick request ran 3 ms steps beside 50 ms ones: its own time and its clock leave the others' out.
    assert measured["quick"].wall_s < 0.1 and quick_clock[0] < 0.1
    assert measured["slow"].wall_s >= 0.25 and slow_clock[0] >= 0.25
    assert clock.now() - time.perf_counter() < 1e-3  # outside the turns nothing was held


def test_lockstep_output_equals_each_methods_own_and_the_engine_reads_its_own_clock(tiny_target):
    """Real requests sharing one target in turns: each produces what it produces alone, and its stats' wall
    time is its own turns (the engine's clock was held during the other's), not the whole lockstep."""
    prompt, new = [5, 17, 22, 9, 30, 41, 5, 17, 22], 24
    plain = SpeculativeGenerator.build(tiny_target, "none")
    pld = SpeculativeGenerator.build(tiny_target, "pld")
    alone = plain.generate(prompt, max_new_tokens=new, ignore_eos=True).token_ids
    streams = {
        name: gen.stream_events(prompt, max_new_tokens=new, ignore_eos=True)
        for name, gen in (("none", plain), ("pld", pld))
    }
    started = time.perf_counter()
    measured = run_lockstep(streams)
    total = time.perf_counter() - started
    assert measured["none"].token_ids == measured["pld"].token_ids == alone
    assert measured["none"].wall_s + measured["pld"].wall_s <= total
    for one in measured.values():
        assert one.stats.wall_s <= one.wall_s  # the engine's part of the request's own time


def test_a_drafter_working_between_steps_is_timed_request_by_request(tiny_target, tiny_draft):
    ours = contestants._ours(tiny_target, parse_method("pld:k=3"), {})
    parallel = contestants._ours(tiny_target, parse_method("draft-model:tiny:k=3:parallel=true"), {"tiny": tiny_draft})
    assert ours.stream is not None and parallel.stream is None
    records = runner.run_group([ours, parallel], [[5, 17, 22, 9, 30, 41]], 16, repeats=2)
    assert records["pld:k=3"][0]["token_ids"] == records["draft-model:tiny:k=3:parallel=true"][0]["token_ids"]
    assert all(len(r[0]["wall_s"]) == 2 for r in records.values())
