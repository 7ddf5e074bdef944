"""End-to-end behaviour of the decode loop on tiny models: lossless greedy output for every drafter,
rollback, stopping, streaming."""

from __future__ import annotations

import pytest
import torch

from helpers import PROMPTS, RASD_OPTIONS, hf_greedy, run, tiny_gemma3, tiny_qwen2
from specdecode.config import GenerationConfig
from specdecode.drafters import available_drafters, create_drafter, drafter_class
from specdecode.drafters._tree_size import TreeBudget
from specdecode.drafters.base import Drafter, DraftRequest, StatelessSession
from specdecode.engine import DecodeOutcome, ancestor_mask, speculative_decode
from specdecode.generator import SpeculativeGenerator
from specdecode.sampling_params import SamplingParams
from specdecode.types import Draft
from tiny_models import TINY_VOCAB


def drafters_under_test(target, draft):
    """Every registered drafter that works out of the box (trained ones have their own tests); those
    that need a second model get the tiny draft model."""
    options = {"draft-model": {"draft_model": draft}, "hsd": {"draft_model": draft}, "rasd": RASD_OPTIONS}
    return {
        name: create_drafter(name, target, **options.get(name, {}))
        for name in available_drafters()
        if not drafter_class(name).needs_training
    }


@pytest.mark.parametrize("k", [1, 3, 6, "auto", "heuristic"])
def test_greedy_output_equals_plain_and_transformers_for_every_drafter(tiny_target, tiny_draft, k):
    for prompt in PROMPTS:
        expected = hf_greedy(tiny_target, prompt, 48)
        for name, drafter in drafters_under_test(tiny_target, tiny_draft).items():
            tokens, outcome = run(tiny_target, drafter, prompt, max_new_tokens=48, num_draft_tokens=k)
            assert tokens == expected, f"drafter {name} (k={k}) diverged from plain greedy decoding"
            assert outcome.stats.new_tokens == 48


def test_draft_equal_to_target_accepts_everything(tiny_target):
    k = 4
    drafter = create_drafter("draft-model", tiny_target, draft_model=tiny_target)
    tokens, outcome = run(tiny_target, drafter, PROMPTS[0], max_new_tokens=10 * (k + 1), num_draft_tokens=k)
    assert outcome.stats.mean_accepted_tokens == k + 1
    assert outcome.stats.acceptance_rate == 1.0
    assert outcome.stats.acceptance_by_position == [1.0] * k
    assert outcome.stats.steps == 10
    assert tokens == hf_greedy(tiny_target, PROMPTS[0], 10 * (k + 1))


def test_draft_model_with_a_trimmed_vocabulary(tiny_target, tiny_draft):
    """VocabTrim: drafting over the draft model's most frequent ids (and the prompt's) keeps greedy output
    exact, and sampling works over the subset."""
    for prompt in PROMPTS:
        drafter = create_drafter("draft-model", tiny_target, draft_model=tiny_draft, draft_vocab=48)
        tokens, _ = run(tiny_target, drafter, prompt, max_new_tokens=32, num_draft_tokens=3)
        assert tokens == hf_greedy(tiny_target, prompt, 32)
    sampled = SamplingParams(temperature=0.8, seed=3)
    tokens, _ = run(tiny_target, drafter, PROMPTS[0], max_new_tokens=12, num_draft_tokens=3, sampling=sampled)
    assert len(tokens) == 12


def test_a_trimmed_head_widens_to_the_tokens_the_text_uses(tiny_target, tiny_draft):
    """VocabTrim's rows grow by every token of the text outside them (so a token the answer keeps using, missing
    from the ranking, is drafted from its second use on), computing the full head's logits for them; output stays
    exact."""
    drafter = create_drafter("draft-model", tiny_target, draft_model=tiny_draft, draft_vocab=16)
    rows = drafter.head.for_prompt(PROMPTS[0])
    assert rows.covering(PROMPTS[0]) is rows  # nothing new
    outside = [t for t in range(tiny_draft.backend.vocab_size) if t not in set(rows.ids.tolist())][:3]
    wider = rows.covering([*PROMPTS[0], *outside])
    assert set(wider.ids.tolist()) == set(rows.ids.tolist()) | set(outside)
    backend = tiny_draft.backend
    normed = torch.randn(2, backend.config.hidden_size)
    full = backend.head_logits(normed)
    assert torch.allclose(backend.head_logits(normed, wider), full[:, wider.ids], atol=1e-4)
    session = drafter.session(DraftRequest(tuple(PROMPTS[0])))
    context = [*PROMPTS[0], *outside]
    session.propose(context, 3)
    assert set(outside) <= set(session.vocab.rows.ids.tolist())
    tokens, _ = run(tiny_target, drafter, PROMPTS[1], max_new_tokens=32, num_draft_tokens=3)
    assert tokens == hf_greedy(tiny_target, PROMPTS[1], 32)


def test_draft_model_trims_its_head_by_default_where_the_vocabulary_is_larger(tiny_target, tiny_draft, monkeypatch):
    assert create_drafter("draft-model", tiny_target, draft_model=tiny_draft).head is None  # 96 ids: nothing to trim
    monkeypatch.setattr("specdecode.drafters.draft_model.DEFAULT_DRAFT_MODEL_VOCAB", 48)
    assert len(create_drafter("draft-model", tiny_target, draft_model=tiny_draft).head.base) == 48
    assert create_drafter("draft-model", tiny_target, draft_model=tiny_draft, draft_vocab=0).head is None


def test_plain_decoding_takes_one_step_per_token(tiny_target):
    tokens, outcome = run(tiny_target, create_drafter("none", tiny_target), PROMPTS[0], max_new_tokens=20)
    assert outcome.stats.steps == 20 and outcome.stats.mean_accepted_tokens == 1.0
    assert outcome.stats.acceptance_rate == 0.0


def test_kv_cache_rollback_matches_a_fresh_forward(tiny_target):
    backend = tiny_target.backend
    ids = torch.tensor([3, 9, 27, 81 % 96, 50, 51, 52, 53, 54])
    fresh = backend.forward(ids, backend.new_cache()).logits
    cache = backend.new_cache()
    backend.forward(ids[:5], cache)
    backend.forward(torch.tensor([60, 61, 62]), cache)  # a rejected draft
    cache.crop(5)
    assert cache.length == 5
    resumed = backend.forward(ids[5:], cache).logits
    torch.testing.assert_close(resumed, fresh[5:], rtol=1e-5, atol=1e-5)


def test_tree_mask_forward_matches_separate_branches(tiny_target):
    backend = tiny_target.backend
    prefix = torch.tensor([4, 8, 15, 16])
    cache = backend.new_cache()
    backend.forward(prefix, cache)
    # Two branches after the prefix: [23, 42] and [33]; positions by depth.
    tree = backend.forward(
        torch.tensor([23, 42, 33]),
        cache,
        positions=torch.tensor([4, 5, 4]),
        tree_mask=torch.tensor([[1, 0, 0], [1, 1, 0], [0, 0, 1]], dtype=torch.bool),
    ).logits
    chain = backend.forward(torch.tensor([4, 8, 15, 16, 23, 42]), backend.new_cache()).logits
    other = backend.forward(torch.tensor([4, 8, 15, 16, 33]), backend.new_cache()).logits
    torch.testing.assert_close(tree[:2], chain[4:], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(tree[2], other[4], rtol=1e-4, atol=1e-4)


def test_eos_stops_generation(tiny_target):
    plain = hf_greedy(tiny_target, PROMPTS[0], 30)
    eos = plain[7]
    outcome = DecodeOutcome()
    chunks = list(
        speculative_decode(
            tiny_target.backend,
            create_drafter("pld", tiny_target),
            PROMPTS[0],
            GenerationConfig(max_new_tokens=30),
            eos_ids=frozenset({eos}),
            outcome=outcome,
        )
    )
    tokens = [t for c in chunks for t in c]
    assert tokens == plain[: plain.index(eos) + 1]
    assert outcome.finish_reason == "eos"


def test_context_limit_ends_generation_cleanly(tiny_target):
    prompt = list(range(3, 90)) * 2 + list(range(3, 70))  # 241 tokens of a 256-token context
    tokens, outcome = run(tiny_target, create_drafter("pld", tiny_target), prompt, max_new_tokens=100)
    assert len(prompt) + len(tokens) == tiny_target.backend.max_context
    assert outcome.finish_reason == "length"


def test_seeded_sampling_is_reproducible(tiny_target, tiny_draft):
    drafter = create_drafter("draft-model", tiny_target, draft_model=tiny_draft)
    sampling = SamplingParams(temperature=0.8, top_p=0.9, seed=123)
    first, _ = run(tiny_target, drafter, PROMPTS[0], max_new_tokens=40, num_draft_tokens=3, sampling=sampling)
    second, _ = run(tiny_target, drafter, PROMPTS[0], max_new_tokens=40, num_draft_tokens=3, sampling=sampling)
    assert first == second


def test_stream_concatenates_to_generate_and_stop_strings_cut(tiny_target):
    generator = SpeculativeGenerator.build(tiny_target, "pld")
    prompt = "w1 w2 w3 w4 w1 w2 w3"
    full = generator.generate(prompt, max_new_tokens=40, ignore_eos=True)
    assert "".join(generator.stream(prompt, max_new_tokens=40, ignore_eos=True)) == full.text
    words = full.text.split()
    stop = " ".join(words[10:12])
    cut = generator.generate(prompt, max_new_tokens=40, ignore_eos=True, stop=[stop])
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(stop)]
    assert "".join(generator.stream(prompt, max_new_tokens=40, ignore_eos=True, stop=[stop])) == cut.text
    assert stop in generator._decode(cut.token_ids) and stop not in generator._decode(cut.token_ids[:-1])


def test_tokens_a_stop_string_cut_from_a_step_are_not_counted(tiny_target):
    """A step can accept tokens past the one that completes a stop string; they are not returned, so tokens/s
    and the usage must not count them (plain decoding, which stops at once, would not have made them)."""
    # The target drafting for itself: every draft is accepted, every step gives 5 tokens.
    generator = SpeculativeGenerator.build(tiny_target, "draft-model", draft_model=tiny_target)
    params = {"max_new_tokens": 40, "ignore_eos": True, "num_draft_tokens": 4}
    steps = [e.token_ids for e in generator.stream_events("w1 w2 w3", **params) if e.token_ids]
    done, candidates = [], []
    for step in steps:
        if len(step) >= 3:  # a stop completed by this step's first token leaves two tokens after it
            candidates.append(generator._decode(done + step[:1]))
        done += step
    full = generator._decode(done)
    stop = next(c[-5:] for c in candidates if full.find(c[-5:]) == len(c) - 5 and c[-5:].strip())
    cut = generator.generate("w1 w2 w3", stop=[stop], **params)
    stats = cut.stats
    assert cut.finish_reason == "stop" and len(cut.token_ids) < len(done)
    assert stats.new_tokens == len(cut.token_ids) == stats.steps + stats.accepted_tokens
    assert sum(stats.accepted_at) == stats.accepted_tokens


def test_chat_template_is_applied(tiny_target):
    generator = SpeculativeGenerator.build(tiny_target, "none")
    ids = generator.encode_prompt("w5 w6", chat=True)
    assert ids == tiny_target.tokenizer.apply_chat_template(
        [{"role": "user", "content": "w5 w6"}], add_generation_prompt=True, tokenize=True
    )


@pytest.mark.parametrize("build", [tiny_qwen2, tiny_gemma3], ids=["qwen2", "gemma3-sliding-window"])
def test_greedy_equality_on_other_architectures(build):
    from tiny_models import wrap

    torch.manual_seed(0)
    loaded = wrap(build().eval(), tokenizer=None)
    prompt = [5, 6, 7, 5, 6, 7, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]
    expected = hf_greedy(loaded, prompt, 60)
    for name in ("none", "pld"):
        tokens, _ = run(loaded, create_drafter(name, loaded), prompt, max_new_tokens=60, num_draft_tokens=4)
        assert tokens == expected, name


class OracleTreeDrafter(Drafter):
    """Knows the plain greedy continuation and hides it in a tree among wrong branches, sometimes
    behind a wrong sibling, sometimes cut short — so greedy tree verification and cache compaction
    must find and keep exactly the right path."""

    def __init__(self, target, truth: list[int], prompt_len: int) -> None:
        super().__init__(target)
        self.truth, self.prompt_len, self.step = truth, prompt_len, 0

    def session(self, request):
        return StatelessSession(self.propose)

    def propose(self, context, max_tokens) -> Draft:
        done = len(context) - self.prompt_len
        right = self.truth[done : done + max_tokens]
        self.step += 1
        wrong = [(t + 1) % TINY_VOCAB for t in right]
        if self.step % 3 == 0:  # right branch first, wrong sibling subtree after it
            tokens, parents = right + wrong[:2], [*range(-1, len(right) - 1), -1, len(right)]
        else:  # wrong sibling first; the right branch is one token short
            keep = max(1, len(right) - 1)
            tokens = wrong[:1] + right[:keep]
            parents = [-1, -1, *range(1, keep)]
        return Draft(tokens=tokens, parents=parents)


def test_greedy_tree_verification_and_cache_compaction(tiny_target):
    prompt = PROMPTS[0]
    expected = hf_greedy(tiny_target, prompt, 48)
    drafter = OracleTreeDrafter(tiny_target, expected, len(prompt))
    tokens, outcome = run(tiny_target, drafter, prompt, max_new_tokens=48, num_draft_tokens=4)
    assert tokens == expected
    assert outcome.stats.mean_accepted_tokens > 3.0  # the right branch was found behind wrong siblings


def test_draft_limits_keep_a_valid_tree():
    draft = Draft(tokens=[10, 11, 12, 13, 14], parents=[-1, 0, 1, -1, 3])
    limited = draft.limited(max_nodes=10, max_depth=1)
    assert limited.tokens == [10, 13] and limited.parents == [-1, -1]
    assert draft.limited(max_nodes=4, max_depth=2).parents == [-1, 0, -1, 2]
    assert draft.limited(max_nodes=3, max_depth=2).tokens == [10, 11, 13]
    assert ancestor_mask(Draft(tokens=[1, 2, 3], parents=[-1, 0, -1])).int().tolist() == [
        [1, 0, 0, 0],
        [1, 1, 0, 0],
        [1, 1, 1, 0],
        [1, 0, 0, 1],
    ]


# Drafters that learn across requests: (least gain in mean accepted tokens on a repeat, size of their state).
LEARNERS = {
    "suffix": (2.0, None),
    "cacheback": (2.0, None),
    "recycling": (0.0, lambda drafter: drafter.state_bytes),
    "stand": (0.0, lambda drafter: drafter.num_entries),
}


@pytest.mark.parametrize("name", list(LEARNERS))
def test_learning_across_requests_raises_acceptance_and_reset_forgets(tiny_target, name):
    margin, state_size = LEARNERS[name]
    drafter = create_drafter(name, tiny_target)
    # What is under test is the drafter's memory, not its tree cut: a flat cost keeps every node, so the
    # calibration the first request teaches (a random model accepts almost nothing) cannot hide it.
    drafter.trees.budget = TreeBudget(None, "auto", draft_share=0.0)
    first_tokens, first = run(tiny_target, drafter, PROMPTS[0], max_new_tokens=48, num_draft_tokens=5)
    again_tokens, again = run(tiny_target, drafter, PROMPTS[0], max_new_tokens=48, num_draft_tokens=5)
    assert again_tokens == first_tokens
    assert again.stats.mean_accepted_tokens > first.stats.mean_accepted_tokens + margin
    drafter.reset()
    if state_size is not None:
        assert state_size(drafter) == 0
    drafter.trees.budget = TreeBudget(None, "auto", draft_share=0.0)  # as above (reset made a new one)
    _, fresh = run(tiny_target, drafter, PROMPTS[0], max_new_tokens=48, num_draft_tokens=5)
    assert fresh.stats.mean_accepted_tokens == first.stats.mean_accepted_tokens


def test_draft_confidence_is_optional_checked_and_kept_by_limits():
    assert Draft(tokens=[1, 2]).confidence is None
    with pytest.raises(ValueError, match="confidence"):
        Draft(tokens=[1, 2], confidence=[0.5])
    assert Draft(tokens=[1, 2, 3], confidence=[0.9, 0.8, 0.7]).limited(10, 2).confidence == [0.9, 0.8]
    tree = Draft(tokens=[10, 11, 12], parents=[-1, 0, -1], confidence=[0.9, 0.5, 0.1])
    assert tree.limited(max_nodes=10, max_depth=1).confidence == [0.9, 0.1]


def test_draft_model_reports_confidence_and_obeys_the_stop_rule(tiny_target, tiny_draft):
    drafter = create_drafter("draft-model", tiny_target, draft_model=tiny_draft)
    full = drafter.session(DraftRequest(tuple(PROMPTS[0]))).propose(PROMPTS[0], 6)
    assert len(full.confidence) == 6 and all(0.0 < c <= 1.0 for c in full.confidence)
    stopping = drafter.session(DraftRequest(tuple(PROMPTS[0]), stop_rule=lambda confidences: len(confidences) >= 2))
    assert stopping.propose(PROMPTS[0], 6).tokens == full.tokens[:2]


class ConfidentOracle(Drafter):
    """Knows the greedy continuation; proposes two right tokens, then wrong ones it says it doubts."""

    name = "confident-oracle"

    def __init__(self, target, expected: list[int], prompt_len: int) -> None:
        super().__init__(target)
        self.expected, self.prompt_len = expected, prompt_len

    def session(self, request):
        return StatelessSession(self.propose)

    def propose(self, context, max_tokens):
        right = self.expected[len(context) - self.prompt_len :][:2]
        tokens = (right + [0] * max_tokens)[:max_tokens]
        return Draft(tokens=tokens, confidence=[0.95] * len(right) + [0.01] * (len(tokens) - len(right)))


def test_auto_trims_doubted_tokens_before_verification_and_stays_lossless(tiny_target):
    expected = hf_greedy(tiny_target, PROMPTS[0], 30)
    drafter = ConfidentOracle(tiny_target, expected, len(PROMPTS[0]))
    tokens, outcome = run(tiny_target, drafter, PROMPTS[0], max_new_tokens=30, num_draft_tokens="auto")
    assert tokens == expected
    stats = outcome.stats
    assert stats.drafted_tokens == stats.accepted_tokens  # the doubted tails were never sent to the target
    assert stats.mean_accepted_tokens > 2.5


def test_stats_split_wall_time_into_forwards_drafting_and_engine_overhead(tiny_target):
    _, outcome = run(tiny_target, create_drafter("pld", tiny_target), PROMPTS[1], max_new_tokens=20)
    stats = outcome.stats
    assert 0.0 < stats.forward_s <= stats.prefill_s + stats.verify_s
    assert stats.overhead_s == pytest.approx(stats.wall_s - stats.forward_s - stats.draft_s, abs=1e-9)
    assert 0.0 <= stats.overhead_fraction < 1.0
    data = stats.to_json()
    assert {"forward_s", "overhead_s", "overhead_fraction", "other_s", "verify_s"} <= set(data)
    assert "engine overhead" in stats.summary()


def test_generator_auto_uses_the_measured_cost_curve_and_keeps_it_across_resets(tiny_target):
    from specdecode.draft_length.cost_model import CostModel
    from specdecode.models.cost import relative_cost_curve

    generator = SpeculativeGenerator.build(tiny_target, "pld")
    plain = generator.generate(PROMPTS[1], max_new_tokens=24, ignore_eos=True, num_draft_tokens=0)
    auto = generator.generate(PROMPTS[1], max_new_tokens=24, ignore_eos=True, num_draft_tokens="auto")
    assert auto.token_ids == plain.token_ids
    policy = generator.draft_length_policy("auto")
    assert isinstance(policy, CostModel)
    measured = relative_cost_curve(tiny_target.backend)
    assert policy.curve.base == pytest.approx(measured)
    generator.reset_drafter()
    generator.generate(PROMPTS[1], max_new_tokens=4, num_draft_tokens="auto")
    assert relative_cost_curve(tiny_target.backend) is measured  # measured once per loaded model


def test_plain_decoding_never_measures_the_cost_curve_and_warm_up_measures_it_once(tiny_target, monkeypatch):
    """The curve costs seconds on a CPU: ``none`` under ``auto`` has no depth to choose, and a server or the
    demo measures it with ``warm_up`` before the first timed or waiting request."""
    import specdecode.generator
    from specdecode.models.cost import relative_cost_curve

    backends = []

    def counting(backend):
        backends.append(backend)
        return relative_cost_curve(backend)

    monkeypatch.setattr(specdecode.generator, "relative_cost_curve", counting)
    plain = SpeculativeGenerator.build(tiny_target, "none")
    plain.generate(PROMPTS[1], max_new_tokens=4, num_draft_tokens="auto")
    assert plain.warm_up() == 0.0 and backends == []
    drafting = SpeculativeGenerator.build(tiny_target, "pld")
    assert drafting.warm_up([plain.drafter]) == 0.0 and backends == []  # only a drafter that drafts needs it
    drafting.warm_up()
    assert backends == [tiny_target.backend]
    fixed = SpeculativeGenerator(tiny_target, drafting.drafter, GenerationConfig(num_draft_tokens=4))
    assert fixed.warm_up() == 0.0 and len(backends) == 1  # a fixed depth reads no curve


def test_warm_up_measures_an_early_exits_agreement_whatever_the_draft_length(tiny_target):
    """An early exit picks its exit from its agreement with the target even at a fixed depth: measured by the
    warm-up, not inside the first request's first step."""
    drafter = create_drafter("early-exit", tiny_target)
    fixed = SpeculativeGenerator(tiny_target, drafter, GenerationConfig(num_draft_tokens=3))
    assert "exit_agreement" not in vars(drafter)
    assert fixed.warm_up() > 0.0 and "exit_agreement" in vars(drafter)


class ProposesFirstOracle(Drafter):
    """Knows the greedy continuation, proposes it with a confidence per token, and records what it was asked."""

    name = "proposes-first-oracle"

    def __init__(self, target, expected: list[int], prompt_len: int) -> None:
        super().__init__(target)
        self.expected, self.prompt_len, self.asked = expected, prompt_len, []

    def session(self, request):
        return StatelessSession(self.propose, proposes_first=True)

    def propose(self, context, max_tokens):
        self.asked.append(max_tokens)
        done = len(context) - self.prompt_len
        right = self.expected[done : done + max_tokens]
        return Draft(tokens=right, confidence=[0.95] * len(right))


def test_a_lookup_drafts_once_per_step_before_the_plan_and_stays_lossless(tiny_target):
    from specdecode.drafters.pld import match_confidence

    expected, _ = run(tiny_target, create_drafter("none", tiny_target), PROMPTS[0], max_new_tokens=24)
    oracle = ProposesFirstOracle(tiny_target, expected, len(PROMPTS[0]))
    tokens, outcome = run(tiny_target, oracle, PROMPTS[0], max_new_tokens=24, num_draft_tokens="auto")
    assert tokens == expected
    # Asked once per step, for as much as the request has room for; the plan then cut what it verifies.
    assert len(oracle.asked) == outcome.stats.steps and oracle.asked[0] >= 16
    assert outcome.stats.new_tokens / outcome.stats.steps > 1.5

    # Prompt lookup copies from the occurrence whose match goes furthest back, surer the longer it is.
    assert match_confidence(8) > match_confidence(5) > match_confidence(3) > match_confidence(2) > match_confidence(1)
    lookup = create_drafter("pld", tiny_target)
    draft = lookup.propose([5, 6, 7, 8, 9, 5, 6, 7], 4)
    assert draft.tokens == [8, 9, 5, 6] and draft.confidence == [match_confidence(3)] * 4
    copied = [1, 2, 3, 4, 5, 6, 7, 8, 60, 0, 6, 7, 8, 50, 0, 1, 2, 3, 4, 5, 6, 7, 8]  # a later, shorter match: 6 7 8 50
    draft = lookup.propose(copied, 2)
    assert draft.tokens == [60, 0] and draft.confidence == [match_confidence(8)] * 2
    assert lookup.propose([1, 2, 3], 4).tokens == []
