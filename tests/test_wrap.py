"""``specdecode.wrap``: a model and tokenizer the user already loaded with transformers, in one call."""

from __future__ import annotations

import pytest
import torch

import specdecode
from specdecode.errors import SpecDecodeError
from tiny_models import tiny_llama, tiny_tokenizer, tiny_words

PROMPT = " ".join(["w5 w6 w7 w8 w9"] * 4)
NEW_TOKENS = 24


def transformers_greedy(model, tokenizer, prompt: str) -> list[int]:
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=[],
            pad_token_id=tokenizer.pad_token_id,
        )
    return out[0, ids.shape[1] :].tolist()


@pytest.mark.parametrize("drafter", ["pld", "none"])
def test_wrapped_model_decodes_as_its_own_greedy_generate(drafter):
    model, tokenizer = tiny_llama(seed=3), tiny_tokenizer(tiny_words())
    expected = transformers_greedy(model, tokenizer, PROMPT)
    generator = specdecode.wrap(model, tokenizer, drafter=drafter, name="tiny", num_draft_tokens=4)
    result = generator.generate(PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    assert result.token_ids == expected
    assert result.stats.new_tokens == NEW_TOKENS


def test_wrap_with_the_fast_path_matches_plain_decoding_through_the_packed_model():
    model, tokenizer = tiny_llama(seed=4), tiny_tokenizer(tiny_words())
    generator = specdecode.wrap(model, tokenizer, drafter="pld", fast_path=True, num_draft_tokens=4)
    speculative = generator.generate(PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    plain = generator.generate(PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True, num_draft_tokens=0)
    assert speculative.token_ids == plain.token_ids
    assert speculative.token_ids == transformers_greedy(model, tokenizer, PROMPT)  # generate runs the packed model


def test_wrap_refuses_what_is_not_a_causal_lm_or_tokenizer_and_unknown_drafters():
    model, tokenizer = tiny_llama(seed=0), tiny_tokenizer(tiny_words())
    with pytest.raises(SpecDecodeError, match="causal LM"):
        specdecode.wrap(torch.nn.Linear(2, 2), tokenizer)
    with pytest.raises(SpecDecodeError, match="tokenizer"):
        specdecode.wrap(model, "not a tokenizer")
    with pytest.raises(SpecDecodeError, match="drafter"):
        specdecode.wrap(model, tokenizer, drafter="no-such-drafter")
    with pytest.raises(SpecDecodeError, match="fp32"):
        specdecode.wrap(tiny_llama(seed=0).to(torch.bfloat16), tokenizer, fast_path=True)
