"""A drafter is one file: a ``@register_drafter`` class defined here (standing in for that file) is found by name,
its options are checked before anything loads, and it drafts through the engine with the target's own output."""

from __future__ import annotations

import pytest

from specdecode import drafters
from specdecode.drafters import available_drafters, check_drafter_options, create_drafter, register_drafter
from specdecode.drafters.base import Drafter, DraftRequest, DraftSession, StatelessSession
from specdecode.errors import SpecDecodeError
from specdecode.generator import SpeculativeGenerator
from specdecode.types import Draft

PROMPT = "w1 w2 w3 w1 w2 w3 w1 w2"


class RepeatLast(Drafter):
    """Proposes the last context token ``times`` times over (a toy: right only where the text repeats a token)."""

    def __init__(self, target, times: int = 3) -> None:
        super().__init__(target)
        if not isinstance(times, int) or times < 1:
            raise SpecDecodeError(f"times must be a positive integer, got {times!r}")
        self.times = times

    def session(self, request: DraftRequest) -> DraftSession:
        return StatelessSession(self.propose)

    def propose(self, context: list[int], max_tokens: int) -> Draft:
        return Draft(tokens=[context[-1]] * min(self.times, max_tokens))


@pytest.fixture
def repeat_last(monkeypatch):
    available_drafters()  # the package's own drafters first, so the copy below holds them
    monkeypatch.setattr(drafters, "_REGISTRY", dict(drafters._REGISTRY))  # the toy leaves with the test
    register_drafter("repeat-last")(RepeatLast)


def test_a_registered_drafter_is_found_by_name_with_its_options(repeat_last, tiny_target):
    assert "repeat-last" in available_drafters()
    assert check_drafter_options("repeat-last", times=2) == {"times": 2}
    with pytest.raises(SpecDecodeError, match="does not take option"):
        check_drafter_options("repeat-last", window=2)
    assert isinstance(create_drafter("repeat-last", tiny_target, times=2), RepeatLast)


def test_a_registered_drafter_decodes_the_targets_own_output(repeat_last, tiny_target):
    plain = SpeculativeGenerator.build(tiny_target, "none").generate(PROMPT, max_new_tokens=24, ignore_eos=True)
    toy = SpeculativeGenerator.build(tiny_target, "repeat-last", times=2)
    result = toy.generate(PROMPT, max_new_tokens=24, ignore_eos=True, num_draft_tokens=2)
    assert result.token_ids == plain.token_ids
    assert result.stats.drafted_tokens > 0  # it did draft: the equality is not plain decoding's by default


def test_a_name_registered_twice_is_refused(repeat_last):
    with pytest.raises(ValueError, match="registered twice"):
        register_drafter("repeat-last")(type("Other", (RepeatLast,), {}))
