"""Automatic prefix caching: a prompt that shares whole chunks with one read before (running or finished) takes
their keys and values instead of reading them, and gets bitwise the output it gets without the cache — alone, in
a batch, with every drafter.  A broken control that adopts a prefix whose tokens differ changes the output.  Where the
backend reads a chunk row by row (heads of 64 floats on the CPU fast path), a prefix of any length is taken, and
holds bitwise the keys and values reading the prompt gives; a broken control that takes one whose rest of a chunk
attends in the other kernel holds other bits."""

from __future__ import annotations

import httpx
import pytest
import torch

from specdecode import prefix_cache
from specdecode.config import GenerationConfig
from specdecode.drafters import create_drafter
from specdecode.engine import PREFILL_CHUNK
from specdecode.models.attention_kernel import FEW_ROWS
from specdecode.models.loading import load_model
from specdecode.prefix_cache import PrefixCache, PrefixSource, shared_length, whole_chunks
from test_batch import batch_drafters
from test_chunked_prefill import QUANTIZED, prompt_of, solo, staggered
from test_server import RunningServer, _scrape, make_service
from tiny_models import save_tiny

CHUNK = 8
SHARED = prompt_of(3 * CHUNK + 2, seed=40)  # three whole chunks and a bit


def requests() -> list[tuple[list[int], GenerationConfig]]:
    """Prompts that share 0, 1, 2 and 3 whole chunks with ``SHARED`` (and one that repeats it exactly)."""
    prompts = [
        SHARED,
        SHARED[: 2 * CHUNK + 3] + prompt_of(9, seed=41),  # two whole chunks in common
        list(SHARED),  # the same prompt again
        SHARED + prompt_of(CHUNK + 4, seed=42),  # extends it
        SHARED[:CHUNK] + prompt_of(2, seed=43),  # one chunk, then its last token
        prompt_of(3 * CHUNK, seed=44),  # nothing in common
        SHARED[: CHUNK - 1] + prompt_of(CHUNK, seed=45),  # less than a whole chunk in common
    ]
    return [
        (p, GenerationConfig(max_new_tokens=10 + i, num_draft_tokens=3, ignore_eos=True)) for i, p in enumerate(prompts)
    ]


def run(target, drafter, reqs, arrivals, slots=None):
    """Each request's output and the prompt tokens it took from the prefix cache, in a batch of three."""
    cached: dict[int, int] = {}
    outputs = staggered(target, drafter, reqs, CHUNK, arrivals, batch_size=3, slots=slots, cached=cached)
    return outputs, cached


def test_whole_chunks_only():
    assert whole_chunks(prompt_length=26, read=26, chunk=8) == 24  # the last token is never read with the prompt
    assert whole_chunks(prompt_length=25, read=24, chunk=8) == 24
    assert whole_chunks(prompt_length=25, read=16, chunk=8) == 16  # still reading
    assert whole_chunks(prompt_length=24, read=23, chunk=8) == 16  # 16..23 is a partial chunk
    source = PrefixSource(list(range(40)), cache=None, length=32)
    assert shared_length(list(range(40)), source, 8) == 32
    assert shared_length(list(range(20)) + [99] * 20, source, 8) == 16
    assert shared_length(list(range(17)), source, 8) == 16  # the prompt's own whole chunks bound it
    assert shared_length(list(range(16)), source, 8) == 8


def test_kept_prompts_are_bounded_and_a_covered_one_gives_way():
    released = []

    class Cache:
        def release(self):
            released.append(self)

    cache = PrefixCache(chunk=4, capacity=2)
    a, b, c = Cache(), Cache(), Cache()
    assert not cache.keep(PrefixSource([1, 2, 3], a, 0))  # no whole chunk: the caller releases it
    assert cache.keep(PrefixSource(list(range(9)), a, 8))
    assert cache.keep(PrefixSource(list(range(13)), b, 12)) and released == [a]  # b holds all of a
    assert cache.keep(PrefixSource([7] * 9, c, 8)) and len(cache) == 2
    found, length = cache.best(list(range(30)), running=[])
    assert found.cache is b and length == 12
    cache.keep(PrefixSource([8] * 9, Cache(), 8))  # over capacity: the least recently used (c) goes
    assert released == [a, c]
    cache.clear()
    assert len(cache) == 0 and len(released) == 4


ONE_BY_ONE = [0, 40, 80, 120, 160, 200, 240]  # each request finished before the next arrives
OVERLAPPING = [0, 1, 1, 2, 30, 31, 31]  # prefixes taken from prompts still being read, too


@pytest.mark.parametrize("arrivals", [ONE_BY_ONE, OVERLAPPING], ids=["one-by-one", "overlapping"])
def test_every_drafter_gives_each_prompt_its_output_without_the_cache(tiny_target, tiny_draft, arrivals):
    reqs = requests()
    expected = [solo(tiny_target, prompt, config, CHUNK) for prompt, config in reqs]
    for name, drafter in batch_drafters(tiny_target, tiny_draft).items():
        outputs, cached = run(tiny_target, drafter, reqs, arrivals)
        for index, want in enumerate(expected):
            assert outputs[index] == want, f"{name}: request {index} differs from its output without the cache"
        if arrivals == OVERLAPPING and name in ("none", "pld", "draft-model"):  # (heads read the prompt's features)
            assert any(cached.values()), f"{name}: no prompt took a prefix"
        elif name == "none":
            # Prompts that share whole chunks with one read before took them (from a kept one).
            assert cached[2] == 3 * CHUNK and cached[3] == 3 * CHUNK
            assert cached[1] == 2 * CHUNK and cached[4] == CHUNK
            assert cached[0] == cached[5] == cached[6] == 0


def test_off_reads_every_prompt(tiny_target):
    reqs = requests()
    outputs, cached = run(tiny_target, create_drafter("pld", tiny_target), reqs, ONE_BY_ONE, slots=0)
    assert set(cached.values()) == {0}
    assert outputs[2] == solo(tiny_target, *reqs[2], CHUNK)


def test_broken_control_adopting_other_tokens_changes_the_output(tiny_target, monkeypatch):
    """The equality above can fail: a cache that hands out a prefix whatever its tokens gives other outputs."""
    reqs = [
        (SHARED, GenerationConfig(max_new_tokens=12, ignore_eos=True)),
        (prompt_of(3 * CHUNK + 2, seed=50), GenerationConfig(max_new_tokens=12, ignore_eos=True)),
    ]
    expected = solo(tiny_target, *reqs[1], CHUNK)

    def any_tokens(prompt_ids, source, chunk, rows_alone):
        return min(source.length, whole_chunks(len(prompt_ids), len(prompt_ids), chunk))

    monkeypatch.setattr(prefix_cache, "shared_length", any_tokens)
    outputs, cached = run(tiny_target, create_drafter("none", tiny_target), reqs, [0, 40])
    assert cached[1] == 3 * CHUNK
    assert outputs[1] != expected


@pytest.mark.parametrize("mode", QUANTIZED)
def test_a_quantized_target_gives_each_prompt_its_output_without_the_cache(tiny_dirs, mode):
    """A quantized target reads a prompt's chunks through kernels that are not batch invariant, each chunk in calls of
    its own: a chunk taken from another prompt's cache still holds the bits reading it would give."""
    target = load_model(str(tiny_dirs["target"]), quantize=mode)
    reqs = requests()
    expected = [solo(target, prompt, config, CHUNK) for prompt, config in reqs]
    for arrivals in (ONE_BY_ONE, OVERLAPPING):
        outputs, cached = run(target, create_drafter("pld", target), reqs, arrivals)
        assert [outputs[i] for i in range(len(reqs))] == expected
        assert any(cached.values())


def test_the_server_reuses_a_prompt_counts_it_and_resets_on_request(tiny_target):
    prompt = prompt_of(PREFILL_CHUNK + 30, seed=60)
    with RunningServer(make_service(tiny_target)) as running:
        client = running.client()

        def complete() -> tuple[str, float]:
            hits = _scrape(running.url).get("specdecode:prefix_cache_hits_total", 0.0)
            text = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0).choices[0].text
            return text, _scrape(running.url)["specdecode:prefix_cache_hits_total"] - hits

        first, first_hits = complete()
        again, again_hits = complete()
        assert (first_hits, again_hits) == (0, PREFILL_CHUNK) and again == first
        assert httpx.post(f"{running.url}/reset_prefix_cache").status_code == 200
        after_reset, after_reset_hits = complete()
        assert after_reset_hits == 0 and after_reset == first
        assert _scrape(running.url)["specdecode:prefix_cache_queries_total"] == 3 * len(prompt)


# A prefix of any length, where the backend reads a chunk row by row.

WIDE_CHUNK = 64  # more than FEW_ROWS: a whole chunk attends in the chunk kernel
ALONE = FEW_ROWS + 1


@pytest.fixture(scope="module")
def wide_target(tmp_path_factory):
    """A tiny Llama with heads of 64 floats (4 heads, 256 wide): on the CPU fast path its layers are written out and a
    prompt's chunk attends in the chunk kernel, so it reads a chunk row by row."""
    target = load_model(str(save_tiny(tmp_path_factory.mktemp("wide") / "target", seed=3, hidden=256)))
    if target.backend.rows_read_alone() is None:
        pytest.skip("the CPU kernels are not built here: chunks are shared whole only")
    return target


def test_a_prefix_of_any_length_where_chunks_are_read_row_by_row():
    source = PrefixSource(list(range(200)), cache=None, length=199)
    other = [999] * 100
    assert shared_length(list(range(40)) + other, source, 64, ALONE) == 40  # the rest of [0, 64) is 24 tokens
    assert shared_length(list(range(40)) + other, source, 64) == 0  # whole chunks only
    assert shared_length(list(range(94)) + other, source, 64, ALONE) == 94
    assert shared_length(list(range(50)) + other, source, 64, ALONE) == 0  # its rest, 14 tokens, attends otherwise
    assert shared_length(list(range(30)), source, 64, ALONE) == 29  # all but its last token: nothing left to read
    short = PrefixSource(list(range(15)), cache=None, length=14)  # read as a chunk of 14 tokens
    assert shared_length(list(range(100)), short, 64, ALONE) == 0
    cache = PrefixCache(chunk=64, capacity=2, rows_alone=ALONE)
    assert cache.shareable(prompt_length=30, read=29) == 29 and cache.shareable(prompt_length=100, read=64) == 64


def test_the_fast_path_reads_chunks_row_by_row_and_other_backends_do_not(wide_target, tiny_target, tiny_dirs):
    assert wide_target.backend.rows_read_alone() == ALONE
    assert tiny_target.backend.rows_read_alone() is None  # heads of 16 floats: SDPA reads its chunks
    assert load_model(str(tiny_dirs["target"]), quantize="int8").backend.rows_read_alone() is None


def read_chunks(backend, prompt: list[int], cache, start: int = 0) -> None:
    """``prompt`` from ``start`` into ``cache`` in the engine's chunks: each ends at a multiple of the chunk size."""
    while start < len(prompt) - 1:
        stop = min((start // WIDE_CHUNK + 1) * WIDE_CHUNK, len(prompt) - 1)
        tokens = torch.tensor(prompt[start:stop])
        backend.forward(tokens, cache, logits_rows=torch.empty(0, dtype=torch.long), invariant=False)
        start = stop


def cached_bits(cache, length: int) -> list[torch.Tensor]:
    return [tensor[cache.slot, :, :length] for stored in cache.pool.layers.values() for tensor in stored]


@pytest.mark.parametrize("shared,same", [(40, True), (100, True), (52, False)], ids=["40", "100", "52-broken"])
def test_a_prompt_taking_part_of_a_chunk_holds_the_bits_reading_it_gives(wide_target, shared, same):
    backend = wide_target.backend
    first = prompt_of(150, seed=70)
    second = first[:shared] + prompt_of(150 - shared, seed=71)
    pool = backend.new_pool()
    alone, source, taking = pool.allocate(), pool.allocate(), pool.allocate()
    read_chunks(backend, second, alone)
    read_chunks(backend, first, source)
    rule = shared_length(second, PrefixSource(first, source, len(first) - 1), WIDE_CHUNK, ALONE)
    assert rule == (shared if same else 0)  # the cache would take 52 tokens as none: [52, 64) attends otherwise
    assert taking.adopt_prefix(source, shared)
    read_chunks(backend, second, taking, start=shared)
    pairs = list(zip(cached_bits(alone, len(second) - 1), cached_bits(taking, len(second) - 1)))
    assert all(torch.equal(a, b) for a, b in pairs) == same


@pytest.mark.parametrize("arrivals", [ONE_BY_ONE, OVERLAPPING], ids=["one-by-one", "overlapping"])
def test_prompts_sharing_part_of_a_chunk_give_each_its_output_without_the_cache(wide_target, tiny_draft, arrivals):
    first = prompt_of(150, seed=80)
    prompts = [
        first,
        first[:40] + prompt_of(90, seed=81),  # part of the first chunk
        first[:100] + prompt_of(30, seed=82),  # a whole chunk and part of the second
        first[:50] + prompt_of(60, seed=83),  # 50 would leave 14 tokens of the chunk: it takes the 40 of the second
        list(first),  # all but the last token
        prompt_of(20, seed=84),
        first[:30],  # a short prompt: one chunk of 29 tokens
    ]
    configs = [GenerationConfig(max_new_tokens=8 + i, num_draft_tokens=3, ignore_eos=True) for i in range(len(prompts))]
    reqs = list(zip(prompts, configs))
    expected = [solo(wide_target, prompt, config, WIDE_CHUNK) for prompt, config in reqs]
    for name, drafter in batch_drafters(wide_target, tiny_draft).items():
        cached = {}
        outputs = staggered(wide_target, drafter, reqs, WIDE_CHUNK, arrivals, batch_size=3, slots=8, cached=cached)
        for index, want in enumerate(expected):
            assert outputs[index] == want, f"{name}: request {index} differs from its output without the cache"
        if arrivals == ONE_BY_ONE and name in ("none", "pld"):
            assert [cached[i] for i in range(len(reqs))] == [0, 40, 100, 40, 149, 0, 29]
