"""Structured outputs on the real default model (SmolLM2-135M-Instruct, fp32): every drafter's constrained greedy
output equals plain constrained decoding's, alone and in a batch of 8 that mixes constrained and free requests, and
every JSON answer that completes validates under its schema."""

from __future__ import annotations

import json

import jsonschema
import pytest

from helpers import untrained_drafter_options
from specdecode.data.structured import STRUCTURED_PROMPTS
from specdecode.drafters import available_drafters
from specdecode.generator import SpeculativeGenerator

pytestmark = pytest.mark.real_model

BY_ID = {prompt.id: prompt for prompt in STRUCTURED_PROMPTS}
SOLO = [BY_ID["person-1"], BY_ID["sentiment-2"]]
NEW_TOKENS = 48


@pytest.fixture(scope="module")
def drafter_options(smollm2) -> dict[str, dict]:
    """Trained drafters with untrained weights: greedy output is exact whatever they draft."""
    return untrained_drafter_options(smollm2, smollm2, draft_vocab=4096, exit_layer=20)


def assert_valid(result, schema) -> None:
    if result.finish_reason == "stop":
        jsonschema.validate(json.loads(result.text), schema)


MIXED = [(prompt, True) for prompt in STRUCTURED_PROMPTS[:5]] + [(prompt, False) for prompt in STRUCTURED_PROMPTS[5:8]]


def config(generator, prompt, constrained: bool):
    constraint = {"json_schema": prompt.schema} if constrained else None
    return generator.config_for(max_new_tokens=NEW_TOKENS, constraint=constraint)


@pytest.fixture(scope="module")
def plain(smollm2) -> tuple[dict, list]:
    """Plain constrained decoding's outputs: each solo prompt's tokens, the mixed requests' results one at a time."""
    generator = SpeculativeGenerator.build(smollm2, "none")
    solo = {}
    for prompt in SOLO:
        result = generator.generate(
            prompt.text, chat=True, max_new_tokens=NEW_TOKENS, constraint={"json_schema": prompt.schema}
        )
        assert result.finish_reason == "stop"
        assert_valid(result, prompt.schema)
        solo[prompt.id] = result.token_ids
    requests = [(p.text, config(generator, p, c)) for p, c in MIXED]
    return solo, generator.run_batch(requests, chat=True, batch_size=1)


# One test per drafter, so that the suite's workers share them.
@pytest.mark.parametrize("name", available_drafters())
def test_every_drafter_gives_plain_constrained_output_alone_and_in_a_mixed_batch(smollm2, plain, drafter_options, name):
    solo, expected = plain
    generator = SpeculativeGenerator.build(smollm2, name, **drafter_options.get(name, {}))
    for prompt in SOLO:
        result = generator.generate(
            prompt.text, chat=True, max_new_tokens=NEW_TOKENS, constraint={"json_schema": prompt.schema}
        )
        assert result.token_ids == solo[prompt.id], f"{name} on {prompt.id}"
    batch = generator.run_batch([(p.text, config(generator, p, c)) for p, c in MIXED], chat=True, batch_size=8)
    for index, (want, got) in enumerate(zip(expected, batch)):
        assert got.token_ids == want.token_ids, f"{name}: sequence {index} differs from plain"
        assert got.finish_reason == want.finish_reason
        if MIXED[index][1]:
            assert_valid(got, MIXED[index][0].schema)
