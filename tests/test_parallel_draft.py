"""Drafting while the target verifies (``draft-model`` with ``parallel=true``, PEARL's post-verify): the
worker's tokens are the ones sequential drafting would give, so output is unchanged; pure-function tests of
when its continuation may be used and of the switch that keeps the worker only where it is faster."""

from __future__ import annotations

import threading
import time

import pytest

from helpers import PROMPTS, hf_greedy, run
from specdecode.drafters import create_drafter
from specdecode.drafters._lookahead import Lookahead
from specdecode.drafters._parallel_switch import ParallelSwitch
from specdecode.errors import SpecDecodeError
from specdecode.sampling_params import SamplingParams


def counting(token: int, position: int) -> tuple[int, float]:
    """A stand-in draft model: the next token is the position."""
    return position, 0.5


def test_the_continuation_is_used_only_when_the_target_accepted_everything_and_chose_a0():
    lookahead = Lookahead(counting)
    lookahead.start([1, 2], [3, 4], limit=4)  # assumes context 1 2 3 4, drafts a_0..a_3 at positions 4..7
    assert lookahead.join() == [4, 4, 5, 6]  # fed d_k = 4, then a_0 .. a_2
    assert lookahead.tokens == [4, 5, 6, 7]
    assert lookahead.continuation([1, 2, 3, 4, 4]) == ([5, 6, 7], [0.5] * 3)
    assert lookahead.continuation([1, 2, 3, 4, 9]) == ([], [])  # the target chose another token
    assert lookahead.continuation([1, 2, 3, 5]) == ([], [])  # d_2 rejected
    assert lookahead.continuation([1, 2, 3, 4, 4, 5]) == ([], [])


def test_the_worker_stops_when_asked_and_hands_its_errors_over():
    release = threading.Event()

    def slow(token: int, position: int) -> tuple[int, float]:
        release.wait(5)
        return position, 1.0

    lookahead = Lookahead(slow)
    lookahead.start([0], [1], limit=100)
    lookahead.stop()
    release.set()
    assert len(lookahead.join()) <= 1

    def broken(token: int, position: int) -> tuple[int, float]:
        raise RuntimeError("draft forward failed")

    lookahead = Lookahead(broken)
    lookahead.start([0], [1], limit=3)
    with pytest.raises(RuntimeError, match="draft forward failed"):
        lookahead.join()


@pytest.mark.parametrize("draft_length", [3, "auto"])
def test_parallel_drafting_keeps_greedy_output_and_reuses_drafts(tiny_target, draft_length, monkeypatch):
    used = []
    continuation = Lookahead.continuation

    def counted(self, context):
        tokens, confidence = continuation(self, context)
        used.append(len(tokens))
        return tokens, confidence

    monkeypatch.setattr(Lookahead, "continuation", counted)
    join = Lookahead.join

    def patient_join(self):
        # Verification races the worker: on a busy CPU it can end before the worker drafted the two tokens a reuse
        # needs. The worker is waited for here, so that what is tested is the reuse, not the scheduler.
        while self._thread is not None and self._thread.is_alive() and len(self.tokens) < 2:
            time.sleep(0.0005)
        return join(self)

    monkeypatch.setattr(Lookahead, "stop", lambda self: None)
    monkeypatch.setattr(Lookahead, "join", patient_join)
    # The target drafting for itself: every draft is accepted, so lookaheads get used (always: the switch would
    # rightly find the worker slower here, where the draft model is the target).
    drafter = create_drafter("draft-model", tiny_target, draft_model=tiny_target, parallel="always")
    for prompt in PROMPTS:
        tokens, _ = run(tiny_target, drafter, prompt, max_new_tokens=30, num_draft_tokens=draft_length)
        assert tokens == hf_greedy(tiny_target, prompt, 30)
    if draft_length == 3:  # under auto, drafting pays too rarely here for drafts to follow each other reliably
        assert sum(used) > 0


def test_parallel_drafting_with_another_draft_model_keeps_greedy_and_coupled_output(tiny_target, tiny_draft):
    sequential = create_drafter("draft-model", tiny_target, draft_model=tiny_draft)
    parallel = create_drafter("draft-model", tiny_target, draft_model=tiny_draft, parallel=True)
    coupled = SamplingParams(temperature=0.9, seed=3)
    for prompt in PROMPTS:
        assert run(tiny_target, parallel, prompt, max_new_tokens=30)[0] == hf_greedy(tiny_target, prompt, 30)
        got = [run(tiny_target, d, prompt, max_new_tokens=30, sampling=coupled)[0] for d in (sequential, parallel)]
        assert got[0] == got[1]


def test_parallel_drafting_refuses_what_it_cannot_do(tiny_target, tiny_draft):
    with pytest.raises(SpecDecodeError, match="parallel must be true, false or always"):
        create_drafter("draft-model", tiny_target, draft_model=tiny_draft, parallel="sometimes")
    with pytest.raises(SpecDecodeError, match="parallel drafting needs"):
        create_drafter("draft-model", tiny_target, draft_model=tiny_draft, parallel=True, vocab_mapping="text")


def modes_run(switch: ParallelSwitch, seconds_per_token: dict[bool, float], steps: int) -> list[bool]:
    """The mode of each of ``steps`` steps, each gaining 2 tokens at the given speed per mode."""
    modes = []
    for _ in range(steps):
        mode = switch.parallel
        modes.append(mode)
        switch.record(mode, 2 * seconds_per_token[mode], 2)
    return modes


def test_the_switch_keeps_the_worker_off_where_it_loses_and_times_both_again_now_and_then():
    switch = ParallelSwitch(trial=4, settle=20)
    modes = modes_run(switch, {True: 0.14, False: 0.10}, 8 + 20 + 8 + 20)
    assert modes[:8] == [True, False] * 4  # a trial alternates the modes
    assert modes[8:28] == [False] * 20  # then the faster runs
    assert modes[28:36] == [True, False] * 4 and modes[36:] == [False] * 20  # timed again: it still loses


def test_the_switch_keeps_the_worker_where_it_wins_and_follows_a_change():
    switch = ParallelSwitch(trial=4, settle=20)
    assert modes_run(switch, {True: 0.08, False: 0.10}, 28)[8:] == [True] * 20
    # The machine got busy and the worker now loses: the next trial finds it out.
    modes = modes_run(switch, {True: 0.30, False: 0.10}, 8 + 20)
    assert modes == [False, True] * 4 + [False] * 20
    assert not switch.settled and switch.left == 8  # the next trial is due
    switch.record(True, 0.0, 0)  # nothing gained or no time: not evidence
    assert switch.left == 8


def test_parallel_true_times_both_modes_and_always_never_switches(tiny_target, tiny_draft, monkeypatch):
    timed = create_drafter("draft-model", tiny_target, draft_model=tiny_draft, parallel="true")
    always = create_drafter("draft-model", tiny_target, draft_model=tiny_draft, parallel="always")
    assert isinstance(timed.switch, ParallelSwitch) and always.switch is None
    recorded = []
    record = ParallelSwitch.record
    monkeypatch.setattr(ParallelSwitch, "record", lambda self, *args: (recorded.append(args), record(self, *args)))
    for prompt in PROMPTS:
        for drafter in (timed, always):
            # A fixed depth: the random draft model loses, and ``auto`` would soon stop it drafting at all.
            tokens, _ = run(tiny_target, drafter, prompt, max_new_tokens=40, num_draft_tokens=3)
            assert tokens == hf_greedy(tiny_target, prompt, 40)
    assert {parallel for parallel, _, _ in recorded} == {True, False}
    assert all(tokens > 0 for _, _, tokens in recorded)
