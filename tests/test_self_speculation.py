"""Self-speculation: the backend's layer-skip / early-exit hook, the cache it leaves behind, and the three
self-drafters (layer-skip, early-exit, kangaroo) decoding exactly like the target alone."""

from __future__ import annotations

import pytest
import torch

from helpers import hf_greedy, run, session_for, tiny_gemma3, tiny_llama3, tiny_qwen2
from specdecode.config import SamplingParams
from specdecode.drafters import create_drafter
from specdecode.drafters._self_draft import DraftHead, SelfDraftSession
from specdecode.drafters.base import DraftRequest
from specdecode.drafters.kangaroo import KangarooAdapter
from specdecode.drafters.layer_skip import initial_skip_set
from specdecode.errors import SpecDecodeError
from specdecode.generator import SpeculativeGenerator
from tiny_models import wrap

IDS = torch.tensor([5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18])

BUILDERS = [tiny_llama3, tiny_qwen2, tiny_gemma3]
BUILD_IDS = ["llama", "qwen2", "gemma3-sliding-window"]


@pytest.fixture(scope="module", params=BUILDERS, ids=BUILD_IDS)
def loaded(request):
    torch.manual_seed(0)
    return wrap(request.param().eval(), tokenizer=None)


def stored(cache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values ``layer`` stored for ``cache``'s sequence, [kv_heads, capacity, head_dim] each
    (zeros where it never wrote: a pool's storage starts zeroed)."""
    keys, values = cache.pool.layers[layer]
    return keys[cache.slot], values[cache.slot]


def written(cache, layer: int) -> int:
    """How many positions ``layer`` wrote keys for in ``cache``'s slot (0 if it never ran on its pool)."""
    if layer not in cache.pool.layers:
        return 0
    return int(stored(cache, layer)[0].ne(0).any(dim=-1).any(dim=0).sum())


def self_drafters(loaded, draft_vocab: int = 0) -> dict:
    backend = loaded.backend
    adapter = KangarooAdapter.for_backend(backend, 1)
    return {
        "layer-skip": create_drafter("layer-skip", loaded, trial_steps=2, draft_vocab=draft_vocab),
        "early-exit": create_drafter("early-exit", loaded, explore=1.0, draft_vocab=draft_vocab),
        "kangaroo": create_drafter("kangaroo", loaded, adapter=adapter, threshold=0.0, draft_vocab=draft_vocab),
    }


def test_skipping_nothing_or_exiting_last_is_the_normal_forward(loaded):
    backend = loaded.backend
    full = backend.forward(IDS, backend.new_cache()).logits
    assert torch.equal(backend.forward_layers(IDS, backend.new_cache(), skip_layers=frozenset()).logits, full)
    assert torch.equal(backend.forward_layers(IDS, backend.new_cache(), exit_layer=backend.num_layers).logits, full)
    out = backend.forward_layers(IDS, backend.new_cache(), exit_layer=backend.num_layers, output_hidden=True)
    torch.testing.assert_close(backend.exit_logits(out.hidden), full, rtol=1e-5, atol=1e-5)


def test_early_exit_equals_a_truncated_model(loaded):
    """Exit after layer L = the same weights with only L layers (embedding scaling, final norm and Gemma's
    logit softcapping included)."""
    model = loaded.backend.model
    softcap = getattr(model.config, "final_logit_softcapping", None)
    if hasattr(model.config, "final_logit_softcapping"):
        model.config.final_logit_softcapping = 2.0  # exercise the softcap on both sides
    try:
        fields = {**model.config.to_dict(), "num_hidden_layers": 1}
        if "layer_types" in fields:
            fields["layer_types"] = fields["layer_types"][:1]
        config = model.config.__class__(**fields)
        shallow = wrap(type(model)(config).eval(), None).backend
        shallow.model.load_state_dict(model.state_dict(), strict=False)
        expected = shallow.forward(IDS, shallow.new_cache()).logits
        backend = loaded.backend
        got = backend.forward_layers(IDS, backend.new_cache(), exit_layer=1).logits
        hidden = backend.forward_layers(IDS, backend.new_cache(), exit_layer=1, output_hidden=True).hidden
        exited = backend.exit_logits(hidden)
    finally:
        if hasattr(model.config, "final_logit_softcapping"):
            model.config.final_logit_softcapping = softcap
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(exited, expected, rtol=1e-5, atol=1e-5)
    if hasattr(model.config, "final_logit_softcapping"):
        assert got.abs().max() <= 2.0


def test_skipped_layers_write_nothing_and_verification_stays_exact(loaded):
    backend = loaded.backend
    full = backend.forward(IDS, backend.new_cache()).logits
    cache = backend.new_cache()
    backend.forward(IDS[:6], cache)
    backend.forward_layers(IDS[6:9], cache, skip_layers=frozenset({1}))  # a draft, layer 1 skipped
    backend.forward_layers(IDS[9:10], cache, exit_layer=1)  # and one more, early exit
    lengths = [written(cache, layer) for layer in range(backend.num_layers)]
    assert lengths[:2] == [10, 6] and all(n == 9 for n in lengths[2:]) and cache.length == 10
    cache.crop(6)  # rollback before verification, as a drafter's cache does
    torch.testing.assert_close(backend.forward(IDS[6:], cache).logits, full[6:], rtol=1e-4, atol=1e-4)


def test_early_exit_cache_entries_are_exact_below_the_exit(loaded):
    """Keys/values of layers below the exit are the full model's, so the exit's cache can be reused."""
    backend = loaded.backend
    shallow, deep = backend.new_cache(), backend.new_cache()
    backend.forward_layers(IDS, shallow, exit_layer=1)
    backend.forward(IDS, deep)
    n = len(IDS)
    torch.testing.assert_close(stored(shallow, 0)[0][:, :n], stored(deep, 0)[0][:, :n], rtol=1e-6, atol=1e-6)
    assert list(shallow.pool.layers) == [0]  # layers above the exit never ran


def test_initial_skip_set_keeps_the_first_and_last_layers():
    skipped = initial_skip_set(30, 0.4)
    assert skipped and 0 not in skipped and 29 not in skipped


def test_drafts_run_on_the_bound_cache_and_leave_it_as_they_found_it(loaded):
    """The draft appends to the target's cache and crops back: the context's entries are untouched, and
    drafting on the engine's cache or on a private copy (synced by full forwards) drafts the same."""
    backend = loaded.backend
    context = IDS[:9].tolist()
    bound = backend.new_cache()
    backend.forward(torch.tensor(context[:-1]), bound)
    n = bound.length

    def entries() -> list[torch.Tensor]:
        return [tensor[:, :n].clone() for layer in range(backend.num_layers) for tensor in stored(bound, layer)]

    def draft(target_cache, skipped: frozenset[int]):
        request = DraftRequest(tuple(context), target_cache=target_cache)
        state = SelfDraftSession(backend, DraftHead(backend, 0), request)
        return state.draft(context, 4, state.skipping(skipped), 0.0)

    before = entries()
    for skipped in (frozenset({1}), frozenset(range(1, backend.num_layers))):
        shared = draft(bound, skipped)
        assert bound.length == len(context) - 1
        for now, then in zip(entries(), before, strict=True):
            assert torch.equal(now, then)
        private = draft(None, skipped)
        assert private.tokens == shared.tokens and len(shared.tokens) == 4


def test_bad_layer_arguments_are_rejected(loaded):
    backend = loaded.backend
    layers = backend.num_layers
    for bad in (
        {"exit_layer": 0},
        {"exit_layer": layers + 1},
        {"skip_layers": frozenset({layers})},
        {"skip_layers": frozenset({-1})},
    ):
        with pytest.raises(ValueError, match=r"must be in"):
            backend.forward_layers(IDS, backend.new_cache(), **bad)
    # Layer 0 may be skipped too: cache lengths are kept per sequence, not read from layer 0.
    cache = backend.new_cache()
    out = backend.forward_layers(IDS, cache, skip_layers=frozenset({0}))
    assert out.logits.shape == (len(IDS), backend.vocab_size) and cache.length == len(IDS)
    assert written(cache, 0) == 0 and written(cache, 1) == len(IDS)


@pytest.mark.parametrize(("k", "draft_vocab"), [(1, 0), (4, 0), (4, 24)])
def test_greedy_output_equals_plain_decoding(loaded, k, draft_vocab):
    """Also with a draft head restricted to 24 ids + the prompt's: drafts miss more, output stays exact."""
    prompt = [5, 6, 7, 5, 6, 7, 5, 6, 7, 8, 9, 10, 11, 12]
    expected = hf_greedy(loaded, prompt, 30)
    for name, drafter in self_drafters(loaded, draft_vocab).items():
        for _ in range(2):  # a second request reuses state learned in the first
            tokens, _ = run(loaded, drafter, prompt, max_new_tokens=30, num_draft_tokens=k)
            assert tokens == expected, f"{name} (k={k}) diverged from plain greedy decoding"


def test_layer_skip_search_tries_masks_and_keeps_a_best(tiny_target):
    drafter = create_drafter("layer-skip", tiny_target, trial_steps=1, search_trials=3, skip_ratio=0.5)
    first = drafter.best
    tried = set()
    for prompt in ([5, 17, 22, 9], [12, 13, 14, 12, 13]):
        for _ in range(8):
            tried.add(drafter.active)
            run(tiny_target, drafter, prompt, max_new_tokens=2, num_draft_tokens=2)
    assert drafter.trials_left == 0 and drafter.best_score is not None
    assert len(tried) >= 2
    drafter.reset()
    assert drafter.best == first and drafter.trials_left == 3


def test_layer_skip_windows_count_only_steps_that_drafted(tiny_target):
    """While the draft-length policy holds drafting off, the search must not move on (a candidate would
    be judged on the rare probes alone)."""
    drafter = create_drafter("layer-skip", tiny_target, trial_steps=1, search_trials=3)
    before = (drafter.best, drafter.candidate, drafter.trials_left)
    run(tiny_target, drafter, [5, 17, 22, 9], max_new_tokens=6, num_draft_tokens=0)
    assert (drafter.best, drafter.candidate, drafter.trials_left) == before
    run(tiny_target, drafter, [5, 17, 22, 9], max_new_tokens=6, num_draft_tokens=2)
    assert drafter.trials_left < before[2]


def test_early_exit_prefers_exits_that_get_accepted(tiny_target):
    drafter = create_drafter("early-exit", tiny_target, exits="1,2", explore=0.0)
    drafter.stats[1].add(0, 50)
    drafter.stats[2].add(50, 52)
    layer, k = drafter.plan(5)
    assert layer == 2 and k >= 1
    drafter.stats[2].add(0, 500)
    assert drafter.plan(5)[1] == 0  # nothing pays: decode plainly


def test_sampled_drafts_carry_their_distributions(tiny_target):
    sampling = SamplingParams(temperature=0.9, top_k=20, seed=3)
    drafters = self_drafters(tiny_target)
    for stats in drafters["early-exit"].stats.values():
        stats.add(100, 100)  # make drafting pay
    for name, drafter in drafters.items():
        draft = session_for(drafter, [5, 6, 7], sampling, seed=sampling.seed).propose([5, 6, 7], 3)
        assert draft.probs is not None and draft.probs.shape == (len(draft.tokens), tiny_target.backend.vocab_size)
        torch.testing.assert_close(draft.probs.sum(-1), torch.ones(len(draft.tokens)))
        assert all(draft.probs[i, t] > 0 for i, t in enumerate(draft.tokens))
        outputs = []
        for _ in range(2):  # the same seed and the same learned state give the same output
            drafter.reset()
            tokens, _ = run(tiny_target, drafter, [5, 6, 7], max_new_tokens=20, num_draft_tokens=3, sampling=sampling)
            outputs.append(tokens)
        assert outputs[0] == outputs[1], name


def test_restricted_draft_head_matches_the_full_head_on_its_rows(tiny_target):
    backend = tiny_target.backend
    head = DraftHead(backend, 16).for_prompt([40, 3, 40, 70])
    assert head.ids.tolist() == [*range(16), 40, 70]
    hidden = torch.randn(2, backend.config.hidden_size)
    full = backend.exit_logits(hidden)
    torch.testing.assert_close(backend.exit_logits(hidden, head), full[:, head.ids], rtol=1e-4, atol=1e-4)
    expanded = head.full_vocab(full[0, head.ids])
    assert torch.isinf(expanded).sum() == backend.vocab_size - 18 and head.token(17) == 70


def test_sampled_drafts_from_a_restricted_head_are_zero_outside_it(tiny_target):
    sampling = SamplingParams(temperature=1.0, seed=5)
    drafter = create_drafter("layer-skip", tiny_target, draft_vocab=10, threshold=0.0)
    draft = session_for(drafter, [50, 51], sampling, seed=sampling.seed).propose([50, 51], 3)
    allowed = torch.zeros(tiny_target.backend.vocab_size, dtype=torch.bool)
    allowed[[*range(10), 50, 51]] = True
    assert draft.probs is not None and not draft.probs[:, ~allowed].any()
    torch.testing.assert_close(draft.probs.sum(-1), torch.ones(len(draft.tokens)))


def test_self_drafters_declare_the_share_of_the_target_a_draft_token_runs(tiny_target):
    """What ``auto`` prices a cold self-draft at (``Drafter.draft_token_share``), before any draft is timed."""
    shares = {name: drafter.draft_token_share() for name, drafter in self_drafters(tiny_target).items()}
    assert all(0.0 < share < 1.0 for share in shares.values()), shares
    generator = SpeculativeGenerator.build(tiny_target, "layer-skip")
    assert generator.draft_length_policy("auto").draft_token_share == generator.drafter.draft_token_share()
    assert SpeculativeGenerator.build(tiny_target, "pld").drafter.draft_token_share() is None


def test_kangaroo_without_adapter_names_the_train_command(tiny_target, tmp_path):
    with pytest.raises(SpecDecodeError, match="specdecode train kangaroo --model"):
        create_drafter("kangaroo", tiny_target)
    with pytest.raises(SpecDecodeError, match="adapter"):
        create_drafter("kangaroo", tiny_target, adapter=str(tmp_path / "missing.pt"))


def test_kangaroo_adapter_round_trips_and_checks_the_model(tiny_target, tiny_draft, tmp_path):
    adapter = KangarooAdapter.for_backend(tiny_target.backend, 2)
    torch.nn.init.normal_(adapter.down.weight)
    adapter.vocab = torch.tensor([0, 3, 9])  # the tokens seen in training: the draft head's base set
    path = tmp_path / "a.pt"
    adapter.save(path, tiny_target.backend)
    drafter = create_drafter("kangaroo", tiny_target, adapter=str(path))
    loaded = drafter.adapter
    h = torch.randn(3, tiny_target.backend.config.hidden_size)
    torch.testing.assert_close(loaded(h), adapter(h))
    assert sorted(session_for(drafter, [5, 3]).state.head.ids.tolist()) == [0, 3, 5, 9]
    with pytest.raises(SpecDecodeError, match="trained for"):
        create_drafter("kangaroo", tiny_draft, adapter=str(path))  # 1 layer, not 3


@pytest.mark.real_model
def test_self_drafters_are_lossless_on_smollm2(smollm2):
    from specdecode.generator import SpeculativeGenerator

    target = smollm2
    prompt = "Explain in a few sentences why the sky is blue."
    plain = SpeculativeGenerator.build(target, "none").generate(prompt, chat=True, max_new_tokens=32)
    for name in ("layer-skip", "early-exit"):
        result = SpeculativeGenerator.build(target, name).generate(prompt, chat=True, max_new_tokens=32)
        assert result.token_ids == plain.token_ids, name
    adapter = KangarooAdapter.for_backend(target.backend, 6)
    kangaroo = SpeculativeGenerator.build(target, "kangaroo", adapter=adapter)
    assert kangaroo.generate(prompt, chat=True, max_new_tokens=32).token_ids == plain.token_ids
