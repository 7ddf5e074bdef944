import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdecode.bench.peers import (
    PeerResult,
    hf_assisted,
    hf_plain,
    hf_prompt_lookup,
    tokens_per_second,
)
from specdecode.errors import SpecDecodeError, VocabularyMismatchError

# A repeated pattern gives prompt lookup n-gram matches to draft from.
PROMPT = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]
MAX_NEW = 24


def _tiny_llama(vocab_size: int = 128) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # A tiny model on shared cores runs ~40x faster on one thread than with threads fighting for cores.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return _tiny_llama()


@pytest.fixture(scope="module")
def reference(model: LlamaForCausalLM) -> list[int]:
    return hf_plain(model, PROMPT, MAX_NEW, ignore_eos=True).token_ids


def test_plain_ignore_eos_gives_exactly_max_new_tokens(model, reference):
    result = hf_plain(model, PROMPT, MAX_NEW, ignore_eos=True)
    assert result.method == "hf-plain"
    assert result.new_tokens == len(result.token_ids) == MAX_NEW
    assert result.token_ids == reference
    assert all(0 <= t < 128 for t in result.token_ids)


def test_eos_stops_unless_ignored(model, reference):
    # Make the 4th greedy token the EOS: a normal run stops there (keeping it), ignore_eos runs on unchanged.
    eos = reference[3]
    first_eos = reference.index(eos)
    original = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = eos
    try:
        for run in (
            lambda **kw: hf_plain(model, PROMPT, MAX_NEW, **kw),
            lambda **kw: hf_assisted(model, model, PROMPT, MAX_NEW, **kw),
            lambda **kw: hf_prompt_lookup(model, PROMPT, MAX_NEW, **kw),
        ):
            assert run().token_ids == reference[: first_eos + 1]
            assert run(ignore_eos=True).token_ids == reference
    finally:
        model.generation_config.eos_token_id = original


def test_assisted_with_same_model_matches_plain(model, reference):
    result = hf_assisted(model, model, PROMPT, MAX_NEW, num_assistant_tokens=4, ignore_eos=True)
    assert result.method == "hf-assisted"
    assert result.token_ids == reference


def test_assisted_restores_assistant_config(model, reference):
    assistant = _tiny_llama()
    before = assistant.generation_config.to_dict()
    result = hf_assisted(
        model,
        assistant,
        PROMPT,
        MAX_NEW,
        num_assistant_tokens=3,
        num_assistant_tokens_schedule="heuristic",
        assistant_confidence_threshold=0.0,
        ignore_eos=True,
    )
    assert result.token_ids == reference
    assert assistant.generation_config.to_dict() == before


@pytest.mark.parametrize("num_tokens", [3, 10])
def test_prompt_lookup_matches_plain(model, reference, num_tokens):
    # transformers 4.57.6 overshoots max_new_tokens here (the draft runs past max_length); we trim.
    result = hf_prompt_lookup(model, PROMPT, MAX_NEW, prompt_lookup_num_tokens=num_tokens, ignore_eos=True)
    assert result.method == "hf-prompt-lookup"
    assert result.token_ids == reference
    assert result.new_tokens == MAX_NEW


def test_tokens_per_second_arithmetic(model):
    result = hf_plain(model, PROMPT, 5, ignore_eos=True)
    assert result.wall_s > 0
    assert result.tokens_per_s == pytest.approx(result.new_tokens / result.wall_s)
    assert tokens_per_second(10, 2.0) == 5.0
    assert tokens_per_second(3, 0.0) == 0.0
    assert PeerResult("x", [1, 2], 0.5, 2, tokens_per_second(2, 0.5)).tokens_per_s == 4.0


def test_bad_arguments_raise_one_line_errors(model):
    with pytest.raises(SpecDecodeError, match="max-new-tokens"):
        hf_plain(model, PROMPT, 0)
    with pytest.raises(SpecDecodeError, match="prompt"):
        hf_plain(model, [], 4)
    with pytest.raises(SpecDecodeError, match="schedule"):
        hf_assisted(model, model, PROMPT, 4, num_assistant_tokens_schedule="fast")
    with pytest.raises(VocabularyMismatchError):
        hf_assisted(model, _tiny_llama(vocab_size=96), PROMPT, 4)
