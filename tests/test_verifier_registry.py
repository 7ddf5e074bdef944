"""The verifier registry: the parser of ``NAME[:KEY=VALUE...]``, the listing read from source, and a verifier
registered from one class here decoding through the engine like the built-in ones."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from specdecode.config import GenerationConfig
from specdecode.errors import SpecDecodeError
from specdecode.generator import SpeculativeGenerator
from specdecode.types import Draft, Verdict
from specdecode.verify import registry
from specdecode.verify.base import TargetRows, VerifierMethod, check_integers
from specdecode.verify.fly import FlyOptions
from specdecode.verify.registry import (
    DEFAULT_VERIFIER,
    VerifierChoice,
    is_lossless,
    parse_verifier,
    register_verifier,
    verifier_listing,
    verifiers,
)
from specdecode.verify.typical import TypicalOptions

PROMPT = "w1 w2 w3 w4 w1 w2 w3 w4 w1 w2 w3"


def test_parser_reads_a_name_and_its_options():
    assert parse_verifier("exact") == VerifierChoice() == VerifierChoice(DEFAULT_VERIFIER)
    assert parse_verifier(" fly ") == VerifierChoice("fly", FlyOptions())
    assert parse_verifier("fly:window=2:min-prob=0.1") == VerifierChoice("fly", FlyOptions(window=2, min_prob=0.1))
    assert parse_verifier("fly:window=2", {"window": 4}).options.window == 4  # --verifier-option wins
    assert parse_verifier("typical").with_options({"epsilon": 0.2}).options == TypicalOptions(epsilon=0.2)
    assert GenerationConfig(verifier="fly:window=1").verifier == VerifierChoice("fly", FlyOptions(window=1))


@pytest.mark.parametrize(
    "text, message",
    [
        ("jugde", "unknown verifier 'jugde'; choose from exact, fly, judge, optimal-md, spectr, typical"),
        ("exact:window=2", "verifier 'exact:window=2': exact takes no options"),
        ("fly:window", "verifier 'fly:window': expected OPTION=VALUE after ':', got 'window'"),
        ("fly:=2", "verifier 'fly:=2': expected OPTION=VALUE after ':', got '=2'"),
        ("fly:window=x", "verifier option window must be an integer >= 0, got 'x'"),
        ("fly:entropy=2", "verifier option entropy must be a number in [0, 1], got 2"),
        ("typical:window=2", "unknown verifier option(s) window; known: epsilon, delta"),
        ("judge:judge_threshold=1.5", "verifier option judge_threshold must be a number in [0, 1], got 1.5"),
    ],
)
def test_parser_refuses_bad_input_in_one_line(text, message):
    with pytest.raises(SpecDecodeError) as caught:
        parse_verifier(text)
    assert str(caught.value) == message


def test_a_choice_holds_its_own_verifiers_options():
    with pytest.raises(SpecDecodeError, match="verifier 'fly' takes FlyOptions, got TypicalOptions"):
        VerifierChoice("fly", TypicalOptions())
    with pytest.raises(SpecDecodeError, match="unknown verifier 5"):
        parse_verifier(5)


def test_listing_read_from_source_matches_the_registry():
    listed = {info.name: (info.lossless, info.description) for info in verifier_listing()}
    registered = {name: (method.lossless, method.__doc__.splitlines()[0]) for name, method in verifiers().items()}
    assert listed == registered and next(iter(listed)) == DEFAULT_VERIFIER


def test_a_request_naming_the_default_verifier_keeps_its_options(tiny_target):
    generator = SpeculativeGenerator.build(tiny_target, "none", GenerationConfig(verifier="fly:window=1"))
    assert generator.config_for(verifier="fly").verifier.options == FlyOptions(window=1)
    assert generator.config_for(verifier_options={"entropy": 0.5}).verifier.options == FlyOptions(entropy=0.5, window=1)
    assert generator.config_for(verifier="typical").verifier == VerifierChoice("typical")


@pytest.fixture
def keep_first(monkeypatch):
    """A verifier defined here, registered for this test only."""
    monkeypatch.setattr(registry, "_REGISTRY", verifiers())  # a copy: the toy leaves the registry with the test

    @dataclass(frozen=True)
    class KeepOptions:
        keep: int = 0

        def __post_init__(self) -> None:
            check_integers(self, keep=0)

    @register_verifier("keep-first", lossless=False)
    class KeepFirst(VerifierMethod):
        """keeps the first ``keep`` tokens of a chain whatever the target says (LOSSY)"""

        options = KeepOptions

        @staticmethod
        def verify(rows: TargetRows, draft: Draft, options: KeepOptions) -> Verdict:
            assert draft.is_chain
            kept = min(options.keep, len(draft.tokens))
            return Verdict(tuple(range(kept)), rows.choice(kept, rows.first_position + kept))

    return KeepFirst


def test_a_verifier_registered_from_one_class_decodes(tiny_target, keep_first):
    assert verifiers()["keep-first"] is keep_first and not is_lossless("keep-first")
    with pytest.raises(SpecDecodeError, match="verifier option keep must be an integer >= 0, got -1"):
        parse_verifier("keep-first:keep=-1")
    generator = SpeculativeGenerator.build(tiny_target, "pld")
    params = {"max_new_tokens": 24, "num_draft_tokens": 3, "ignore_eos": True}
    plain = SpeculativeGenerator.build(tiny_target, "none").generate(PROMPT, **params)
    none_kept = generator.generate(PROMPT, verifier="keep-first", **params)
    assert none_kept.token_ids == plain.token_ids and none_kept.stats.accepted_tokens == 0
    stats = none_kept.stats.to_json()
    assert stats["verifier"] == "keep-first" and stats["lossless"] is False and none_kept.stats.drafted_tokens > 0
    generator.reset_drafter()
    kept = generator.generate(PROMPT, verifier="keep-first:keep=2", **params).stats
    assert kept.accepted_tokens > 0 and kept.new_tokens == kept.steps + kept.accepted_tokens
