"""Automatic prefix caching: a prompt that shares whole chunks with one read before (running or finished) takes
their keys and values instead of reading them, and gets bitwise the output it gets without the cache — alone, in
a batch, with every drafter.  A broken control that adopts a prefix whose tokens differ changes the output."""

from __future__ import annotations

import httpx
import pytest

from specdecode import prefix_cache
from specdecode.config import GenerationConfig
from specdecode.drafters import create_drafter
from specdecode.engine import PREFILL_CHUNK
from specdecode.models.loading import load_model
from specdecode.prefix_cache import PrefixCache, PrefixSource, shared_length, whole_chunks
from test_batch import batch_drafters
from test_chunked_prefill import QUANTIZED, prompt_of, solo, staggered
from test_server import RunningServer, _scrape, make_service

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

    def any_tokens(prompt_ids, source, chunk):
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
