"""Prompts read in chunks at fixed offsets, riding in the running sequences' verification forward: a request
joining a batch gets exactly its solo output (read alone in the same chunks), and the running sequences keep
gaining tokens while its prompt is read."""

from __future__ import annotations

import pytest
import torch

from helpers import fixed_depth_engine, hf_greedy, random_eagle_head, tiny_gemma3
from specdecode.batch_engine import BatchEngine, BatchRequest
from specdecode.config import GenerationConfig
from specdecode.draft_length.factory import make_policy
from specdecode.drafters import create_drafter
from specdecode.engine import speculative_decode, verification_input
from specdecode.models.base import SequenceInput
from specdecode.models.loading import load_model
from specdecode.models.quantize import quantize_supported
from specdecode.types import Draft
from test_batch import batch_drafters

CHUNK = 8
#: Prompt lengths around and across several chunk boundaries (the prompt but its last token is read).
LENGTHS = [1, 2, CHUNK, CHUNK + 1, CHUNK + 2, 3 * CHUNK + 1, 4 * CHUNK + 5, 7 * CHUNK - 1]


def prompt_of(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 60, (length,), generator=generator).tolist()


def solo(target, prompt, config, chunk):
    drafter = create_drafter("none", target)
    decoded = speculative_decode(target.backend, drafter, prompt, config, frozenset(), prefill_chunk=chunk)
    return [token for tokens in decoded for token in tokens]


def staggered(target, drafter, requests, chunk, arrivals, batch_size=4, budget=None, slots=None, cached=None):
    """Run ``requests`` through one engine, request i submitted before step ``arrivals[i]``; ``slots``: the prefix
    cache's (default the batch size); ``cached``, when given, gets each request's prompt tokens taken from it."""
    policies = {}
    engine = BatchEngine(
        target.backend,
        drafter,
        lambda config, drafter: policies.setdefault(config.num_draft_tokens, make_policy(config.num_draft_tokens)),
        frozenset(),
        batch_size,
        prefill_chunk=chunk,
        prefill_budget=budget,
        prefix_cache_slots=slots,
    )
    outputs: dict[int, list[int]] = {index: [] for index in range(len(requests))}
    done: set[int] = set()
    steps = 0
    while len(done) < len(requests):
        for index, when in enumerate(arrivals):
            if when == steps:
                engine.submit(BatchRequest(*requests[index], tag=index))
        for event in engine.step():
            outputs[event.tag].extend(event.new_tokens)
            if event.finished:
                done.add(event.tag)
                if cached is not None:
                    cached[event.tag] = event.sequence.stats.cached_tokens
        assert engine.pool.active == len(engine.running) + len(engine.prefix_cache)  # kept prefixes hold the rest
        assert len(engine.prefix_cache) <= engine.prefix_cache.capacity
        steps += 1
    return outputs


@pytest.mark.parametrize("k", [3, "auto"])
def test_prompts_across_chunks_joining_a_running_batch_give_each_its_solo_output(tiny_target, tiny_draft, k):
    requests = [
        (prompt_of(length, seed), GenerationConfig(max_new_tokens=12 + 3 * seed, num_draft_tokens=k, ignore_eos=True))
        for seed, length in enumerate(LENGTHS)
    ]
    arrivals = [0, 0, 2, 3, 3, 5, 9, 14]
    expected = [solo(tiny_target, prompt, config, CHUNK) for prompt, config in requests]
    for name, drafter in batch_drafters(tiny_target, tiny_draft).items():
        outputs = staggered(tiny_target, drafter, requests, CHUNK, arrivals)
        for index, want in enumerate(expected):
            assert outputs[index] == want, f"{name} (k={k}): request {index} differs from its solo output"


@pytest.mark.parametrize("chunk", [3, 5, 16])
def test_chunks_shorter_and_longer_than_a_sliding_window_read_the_prompt_exactly(chunk):
    """A chunk after the first attends to the cache through its own mask, the window's included."""
    from tiny_models import wrap

    torch.manual_seed(0)
    loaded = wrap(tiny_gemma3().eval(), tokenizer=None)  # a window of 8 tokens
    prompt = prompt_of(41, 3)
    config = GenerationConfig(max_new_tokens=20, ignore_eos=True)
    assert solo(loaded, prompt, config, chunk) == hf_greedy(loaded, prompt, 20)


QUANTIZED = [
    "int8",
    "int4",
    pytest.param("bf16", marks=pytest.mark.skipif(not quantize_supported("bf16"), reason="no oneDNN bf16 matmul")),
]


@pytest.mark.parametrize("mode", QUANTIZED)
def test_a_chunk_reads_the_same_bits_alone_and_beside_a_verification(tiny_dirs, mode):
    """Quantized layers are batch invariant, bitwise, but a prompt's rows take faster kernels that are not (block
    copies, uncut bf16 calls): a chunk's rows must still come out bitwise the same beside other sequences' rows."""
    backend = load_model(str(tiny_dirs["target"]), quantize=mode).backend
    chunk_tokens = torch.tensor(prompt_of(40, 1))  # past 32 rows: the bf16 kernel's invariant calls are cut
    final = (backend.num_layers,)

    def read(with_others: bool) -> torch.Tensor:
        pool = backend.new_pool()
        no_rows = torch.empty(0, dtype=torch.long)
        chunk = SequenceInput(chunk_tokens, pool.allocate(), logits_rows=no_rows, hidden_layers=final, invariant=False)
        if not with_others:
            return backend.forward_batch([chunk])[0].hidden
        other = pool.allocate()
        backend.forward(torch.tensor(prompt_of(20, 2)), other, invariant=False)
        verifying = verification_input([*prompt_of(20, 2), 9], Draft(tokens=[4, 5, 6]), other)
        return backend.forward_batch([verifying, chunk, SequenceInput(torch.tensor([7, 8]), pool.allocate())])[1].hidden

    assert torch.equal(read(with_others=True), read(with_others=False))


@pytest.mark.parametrize("mode", QUANTIZED)
def test_long_prompts_joining_a_quantized_batch_give_each_its_solo_output(tiny_dirs, mode):
    target = load_model(str(tiny_dirs["target"]), quantize=mode)
    chunk = 40
    drafters = {
        "pld": create_drafter("pld", target),
        "eagle": create_drafter("eagle", target, head=random_eagle_head(target.backend, 48)),
    }
    requests = [
        (prompt_of(length, seed), GenerationConfig(max_new_tokens=16, num_draft_tokens="auto", ignore_eos=True))
        for seed, length in enumerate([30, 3 * chunk + 7, 2 * chunk + 1, 5 * chunk - 3])
    ]
    expected = [solo(target, prompt, config, chunk) for prompt, config in requests]
    for name, drafter in drafters.items():
        outputs = staggered(target, drafter, requests, chunk, arrivals=[0, 1, 2, 4])
        for index, want in enumerate(expected):
            assert outputs[index] == want, f"{mode} {name}: request {index} differs from its solo output"


def test_running_sequences_gain_tokens_in_every_step_while_a_long_prompt_is_read(tiny_target):
    engine = fixed_depth_engine(tiny_target, "pld", 2, prefill_chunk=CHUNK)
    config = GenerationConfig(max_new_tokens=200, ignore_eos=True)
    engine.submit(BatchRequest(prompt_of(5, 0), config, tag="running"))
    engine.submit(BatchRequest(prompt_of(6, 1), config, tag="also running"))
    while engine.waiting or any(seq.reading for _, seq in engine.running.values()):
        engine.step()
    long_prompt = prompt_of(6 * CHUNK + 3, 2)  # 7 chunks: a budget of one chunk reads it in 7 steps
    engine.submit(BatchRequest(long_prompt, GenerationConfig(max_new_tokens=10, ignore_eos=True), tag="joining"))
    reading_steps = 0
    while True:
        events = engine.step()
        joining = next(seq for tag, seq in engine.running.values() if tag == "joining")
        gained = {event.tag: len(event.new_tokens) for event in events}
        if not joining.reading and "joining" in gained:
            break
        assert gained.get("running", 0) >= 1 and gained.get("also running", 0) >= 1
        reading_steps += joining.reading
    assert reading_steps == 6  # the 7th chunk's step ends the reading; the request decodes from the next
    assert joining.read == len(long_prompt) - 1


def test_the_budget_reads_as_many_chunks_as_fit_fewest_tokens_left_first(tiny_target):
    engine = fixed_depth_engine(tiny_target, "none", 1, prefill_chunk=CHUNK, prefill_budget=2 * CHUNK + 3)
    config = GenerationConfig(max_new_tokens=4, ignore_eos=True)
    for tag, length in enumerate([3 * CHUNK + 1, 2 * CHUNK + 1, CHUNK + 4]):
        engine.submit(BatchRequest(prompt_of(length, tag), config, tag=tag))
    reads = []
    while any(seq.reading for _, seq in engine.running.values()) or engine.waiting:
        before = {tag: seq.read for tag, seq in engine.running.values()}
        engine.step()
        reads.append([seq.read - before.get(tag, 0) for tag, seq in engine.running.values()])
    # 24, 16 and 11 tokens to read: two chunks fit a step (a third would not), the prompt with the fewest tokens left
    # first; a last short chunk fits beside two whole ones.
    assert reads == [[0, CHUNK, CHUNK], [CHUNK, CHUNK, 3], [CHUNK, 0, 0], [CHUNK, 0, 0]]


def test_the_prompt_with_the_fewest_tokens_left_is_read_first(tiny_target):
    """Many prompts arriving at once: a short one is not read after a long one that arrived before it."""
    config = GenerationConfig(max_new_tokens=4, ignore_eos=True)
    long_prompt, short_prompt = prompt_of(5 * CHUNK, 1), prompt_of(CHUNK - 2, 2)
    expected = solo(tiny_target, short_prompt, config, CHUNK)
    engine = BatchEngine(
        tiny_target.backend,
        create_drafter("none", tiny_target),
        lambda config, drafter: make_policy(config.num_draft_tokens),
        frozenset(),
        4,
        prefill_chunk=CHUNK,
    )
    engine.submit(BatchRequest(long_prompt, config, tag="long"))
    engine.submit(BatchRequest(short_prompt, config, tag="short"))
    engine.step()  # reads the short prompt whole, nothing of the long one
    reading = {tag: seq.read for tag, seq in engine.running.values()}
    assert reading == {"long": 0, "short": len(short_prompt) - 1}
    outputs = {"long": [], "short": []}
    for event in engine.run():
        outputs[event.tag].extend(event.new_tokens)
    assert outputs["short"] == expected
    assert outputs["long"] == solo(tiny_target, long_prompt, config, CHUNK)
