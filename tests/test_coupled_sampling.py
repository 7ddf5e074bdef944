"""Drafter-invariant (Gumbel-max coupled) sampling: with a seed the sampled tokens are a function of the
seed and the target alone — identical with every drafter, draft length and batch, plain decoding
included — and still exactly the target's distribution (chi-square, with deliberately broken coupled
verifiers failing the same test)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import specdecode.sampling
import specdecode.verify.coupled
import specdecode.verify.exact
from helpers import DRAWS, FAIL_P, PASS_P, PROMPTS, RASD_OPTIONS, BigramLM, V, chain_pvalues, chi2_pvalue, run
from specdecode.batch_engine import BatchEngine, BatchRequest
from specdecode.config import GenerationConfig
from specdecode.draft_length.factory import make_policy
from specdecode.drafters import available_drafters, create_drafter, drafter_class
from specdecode.drafters.base import Drafter, DraftRequest, DraftSession
from specdecode.engine import speculative_decode
from specdecode.sampling import (
    argmax_last,
    coupled_argmax,
    coupled_sample,
    gumbel_noise,
    sample,
    sampling_log_weights,
    sampling_probs,
)
from specdecode.sampling_params import SamplingParams
from specdecode.types import Draft
from specdecode.verify.coupled import verify_coupled

# --- the keyed noise ---------------------------------------------------------------------------------


def test_noise_is_keyed_by_seed_and_position_alone():
    first = gumbel_noise(7, 12, 1000).clone()
    specdecode.sampling._noise.cache_clear()  # drawn afresh, after other keys: no hidden state
    gumbel_noise(7, 13, 1000), gumbel_noise(8, 12, 1000)
    torch.testing.assert_close(gumbel_noise(7, 12, 1000), first, rtol=0, atol=0)
    assert not torch.equal(gumbel_noise(7, 13, 1000), first)
    assert not torch.equal(gumbel_noise(8, 12, 1000), first)
    # Entry v does not depend on the vocabulary size asked for (a padded draft head reads the same noise).
    torch.testing.assert_close(gumbel_noise(7, 12, 1500)[:1000], first, rtol=0, atol=0)


def test_noise_is_standard_gumbel():
    noise = torch.cat([gumbel_noise(3, position, 20_000) for position in range(5)]).double()
    assert torch.isfinite(noise).all()
    assert abs(float(noise.mean()) - 0.5772) < 0.02  # Euler-Mascheroni constant
    assert abs(float(noise.var()) - torch.pi**2 / 6) < 0.05


def test_log_weights_have_the_support_and_shape_of_the_processed_distribution():
    logits = 3 * torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    for params in [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=1.3, top_p=0.8),
        SamplingParams(temperature=0.9, top_k=4, top_p=0.9),
    ]:
        weights = sampling_log_weights(logits, params)
        torch.testing.assert_close(weights.softmax(-1), sampling_probs(logits, params), rtol=1e-5, atol=1e-6)
        assert torch.equal(torch.isfinite(weights), sampling_probs(logits, params) > 0)


def test_coupled_sample_with_greedy_params_is_the_argmax():
    logits = torch.tensor([0.1, 2.0, -1.0])
    assert coupled_sample(logits, SamplingParams(seed=1), seed=1, position=5) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_last_is_torchs_argmax_first_among_ties(dtype):
    values = torch.randn(6, 3000, generator=torch.Generator().manual_seed(0)).to(dtype)
    values[2, [7, 1500, 2999]] = 50.0  # a three-way tie: the first index wins
    assert argmax_last(values) == values.argmax(-1).tolist()
    assert argmax_last(values)[2] == 7
    assert argmax_last(values[:, ::2]) == values[:, ::2].argmax(-1).tolist()  # a strided view
    assert argmax_last(values[4]) == int(values[4].argmax())


# --- the verifier alone: the emitted token follows p, whatever was drafted -----------------------------


def random_dist(v: int, seed: int, sharpness: float = 1.5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(sharpness * torch.randn(v, generator=g), -1)


def first_token_counts(p: torch.Tensor, q: torch.Tensor, draws: int, siblings: int, coupled_draft: bool) -> np.ndarray:
    """Distribution over seeds of the first token the coupled verifier emits when ``siblings`` root
    alternatives are drafted from q: the top ``siblings`` of q's perturbed scores (the drafter reads the
    same keyed noise: Gumbel-max list sampling), or independent draws without replacement."""
    generator = torch.Generator().manual_seed(0)
    target_logits = torch.log(p).expand(siblings + 1, -1)
    params = SamplingParams(temperature=1.0, seed=0)
    counts = np.zeros(len(p))
    for seed in range(draws):
        if coupled_draft:
            tokens = torch.topk(torch.log(q) + gumbel_noise(seed, 0, len(q)), siblings).indices.tolist()
        else:
            tokens, remaining = [], q.clone()
            for _ in range(siblings):
                tokens.append(sample(remaining / remaining.sum(), generator))
                remaining[tokens[-1]] = 0.0
        draft = Draft(tokens=tokens, parents=[-1] * siblings)
        verdict = verify_coupled(target_logits, draft, params, seed, first_position=0)
        counts[tokens[verdict.path[0]] if verdict.path else verdict.next_token] += 1
    return counts


@pytest.mark.parametrize("siblings", [1, 3])
@pytest.mark.parametrize("coupled_draft", [True, False], ids=["shared-noise-draft", "independent-draft"])
def test_coupled_verifier_reproduces_target_distribution(siblings, coupled_draft):
    p, q = random_dist(6, 1), random_dist(6, 2)
    counts = first_token_counts(p, q, DRAWS // 2, siblings, coupled_draft)
    assert chi2_pvalue(counts, p.numpy()) > PASS_P


# --- end to end on the toy bigram backend -------------------------------------------------------------


class BigramDrafter(Drafter):
    """Drafts from a *different* bigram table: the coupled Gumbel-max sample (``shared_noise``, reading
    the verifier's keyed noise) or an independent draw; ``branches`` > 1 makes a tree whose root
    alternatives are the top ``branches`` perturbed tokens (or independent draws without replacement),
    each continued by a chain."""

    def __init__(self, table: torch.Tensor, shared_noise: bool, branches: int = 1) -> None:
        super().__init__(target=None)
        self.table, self.shared_noise, self.branches = table, shared_noise, branches
        self._weights: dict[tuple, torch.Tensor] = {}

    def log_weights(self, sampling: SamplingParams) -> torch.Tensor:
        """[V, V] processed log-weights after every token, computed once per setting: the verifier under
        test runs per draw, the drafter's own arithmetic need not."""
        key = (sampling.temperature, sampling.top_k, sampling.top_p)
        if key not in self._weights:
            self._weights[key] = sampling_log_weights(self.table, sampling)
        return self._weights[key]

    def session(self, request: DraftRequest) -> BigramSession:
        return BigramSession(self, request)


class BigramSession(DraftSession):
    def __init__(self, drafter: BigramDrafter, request: DraftRequest) -> None:
        self.drafter, self.seed = drafter, request.seed
        self.weights = drafter.log_weights(request.sampling)
        self.probs = self.weights.softmax(-1)
        self.generator = request.torch_generator()

    def _next(self, previous: int, position: int) -> int:
        if self.drafter.shared_noise:
            return coupled_argmax(self.weights[previous], self.seed, position)
        return sample(self.probs[previous], self.generator)

    def propose(self, context, max_tokens) -> Draft:
        branches, position = self.drafter.branches, len(context)
        weights = self.weights[context[-1]]
        if self.drafter.shared_noise:
            scores = weights + gumbel_noise(self.seed, position, V)
            roots = torch.topk(scores, min(branches, int(torch.isfinite(weights).sum()))).indices.tolist()
        else:
            roots, remaining = [], self.probs[context[-1]].clone()
            for _ in range(min(branches, int((remaining > 0).sum()))):
                roots.append(sample(remaining / remaining.sum(), self.generator))
                remaining[roots[-1]] = 0.0
        tokens: list[int] = []
        parents: list[int] = []
        for root in roots:
            tokens.append(root), parents.append(-1)
            for depth in range(1, max_tokens):
                parents.append(len(tokens) - 1)
                tokens.append(self._next(tokens[-1], position + depth))
        return Draft(tokens, None, parents if branches > 1 else None)


def bigram_tables() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    target_table = 2.0 * torch.randn(V, V, generator=g)
    return target_table, target_table + 1.5 * torch.randn(V, V, generator=g)


def transition_counts(
    sampling: SamplingParams, tokens_wanted: int, shared_noise: bool = True, branches: int = 1
) -> tuple[np.ndarray, np.ndarray, float]:
    """Counts [position in step, previous token, next token] over many seeded runs; the exact rows; the
    mean tokens per step."""
    target_table, draft_table = bigram_tables()
    model, drafter = BigramLM(target_table), BigramDrafter(draft_table, shared_noise, branches)
    counts = np.zeros((4, V, V))
    produced = steps = run_ = 0
    while produced < tokens_wanted:
        config = GenerationConfig(
            max_new_tokens=1000, num_draft_tokens=3, sampling=dataclasses.replace(sampling, seed=run_)
        )
        previous = 0
        for chunk in speculative_decode(model, drafter, [0], config):
            for position, token in enumerate(chunk):
                counts[position, previous, token] += 1
                previous = token
            produced += len(chunk)
            steps += 1
        run_ += 1
    return counts, sampling_probs(target_table, sampling).numpy(), produced / steps


SAMPLING_CASES = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=3),
    SamplingParams(temperature=1.3, top_p=0.8),
]


@pytest.mark.parametrize("sampling", SAMPLING_CASES, ids=lambda s: f"T{s.temperature}-k{s.top_k}-p{s.top_p}")
def test_engine_coupled_sampling_is_exactly_the_target(sampling):
    counts, expected, per_step = transition_counts(sampling, DRAWS)
    pvalues = chain_pvalues(counts, expected)
    assert len(pvalues) >= 8
    assert min(pvalues) > PASS_P / len(pvalues), pvalues  # Bonferroni over the strata
    assert per_step > 1.3  # drafts were accepted: later positions in a step were tested too


@pytest.mark.parametrize("shared_noise", [True, False], ids=["shared-noise-tree", "independent-tree"])
def test_engine_coupled_trees_are_exactly_the_target(shared_noise):
    sampling = SamplingParams(temperature=0.9, top_k=4)
    counts, expected, _ = transition_counts(sampling, DRAWS, shared_noise=shared_noise, branches=3)
    pvalues = chain_pvalues(counts, expected)
    assert min(pvalues) > PASS_P / len(pvalues), pvalues


def forgot_the_log(logits, params, seed, position) -> int:
    """A plausible bug: Gumbel noise added to probabilities instead of log-probabilities."""
    return coupled_argmax(sampling_probs(logits, params), seed, position)


def one_noise_for_all_positions(logits, params, seed, position) -> int:
    """A plausible bug: the noise keyed by the seed only, so every position reuses the same draw."""
    return coupled_sample(logits, params, seed, 0)


@pytest.mark.parametrize("broken", [forgot_the_log, one_noise_for_all_positions], ids=lambda f: f.__name__)
def test_broken_coupled_verifier_fails_the_same_test(broken, monkeypatch):
    monkeypatch.setattr(specdecode.verify.coupled, "coupled_sample", broken)
    counts, expected, _ = transition_counts(SamplingParams(temperature=1.0), DRAWS // 4)
    assert min(chain_pvalues(counts, expected)) < FAIL_P


# --- invariance on the tiny model: same seed, same tokens, whatever drafts them -------------------------


@pytest.fixture
def verified(monkeypatch) -> list[Draft]:
    """Every draft the coupled verifier checks (proves it ran, and shows which drafts were trees)."""
    seen: list[Draft] = []

    def spy(logits, draft, *args):
        seen.append(draft)
        return verify_coupled(logits, draft, *args)

    monkeypatch.setattr(specdecode.verify.exact, "verify_coupled", spy)
    return seen


SEEDED = [
    SamplingParams(temperature=0.8, seed=1),
    SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=12345),
]
NEW = 40


def named_drafters(tiny_target, tiny_draft) -> dict[str, Drafter]:
    return {
        "pld": create_drafter("pld", tiny_target),
        "suffix": create_drafter("suffix", tiny_target),
        "draft-model": create_drafter("draft-model", tiny_target, draft_model=tiny_draft),
        "recycling": create_drafter("recycling", tiny_target),
    }


@pytest.mark.parametrize("sampling", SEEDED, ids=lambda s: f"seed{s.seed}")
def test_same_seed_same_tokens_with_every_drafter_and_length(tiny_target, tiny_draft, sampling, verified):
    drafters = named_drafters(tiny_target, tiny_draft)
    for prompt in PROMPTS:
        plain, _ = run(tiny_target, create_drafter("none", tiny_target), prompt, max_new_tokens=NEW, sampling=sampling)
        assert len(plain) == NEW
        for name, drafter in drafters.items():
            for k in (3, "auto"):
                for _ in range(2):  # a second run: drafters that learn across requests draft differently
                    tokens, _ = run(
                        tiny_target, drafter, prompt, max_new_tokens=NEW, num_draft_tokens=k, sampling=sampling
                    )
                    assert tokens == plain, (name, k, prompt)
    assert any(not draft.is_chain for draft in verified)  # suffix / recycling trees were verified too
    assert any(draft.tokens for draft in verified)


def test_every_out_of_the_box_drafter_gives_the_same_tokens(tiny_target, tiny_draft, verified):
    sampling = SEEDED[0]
    prompt = PROMPTS[1]
    plain, _ = run(tiny_target, create_drafter("none", tiny_target), prompt, max_new_tokens=NEW, sampling=sampling)
    options = {"draft-model": {"draft_model": tiny_draft}, "hsd": {"draft_model": tiny_draft}, "rasd": RASD_OPTIONS}
    for name in available_drafters():
        if drafter_class(name).needs_training:
            continue
        drafter = create_drafter(name, tiny_target, **options.get(name, {}))
        for k in (2, 5, "auto"):
            tokens, _ = run(tiny_target, drafter, prompt, max_new_tokens=NEW, num_draft_tokens=k, sampling=sampling)
            assert tokens == plain, (name, k)


def test_different_seeds_give_different_tokens(tiny_target):
    none = create_drafter("none", tiny_target)
    first, _ = run(tiny_target, none, PROMPTS[0], max_new_tokens=NEW, sampling=SEEDED[0])
    other, _ = run(tiny_target, none, PROMPTS[0], max_new_tokens=NEW, sampling=dataclasses.replace(SEEDED[0], seed=2))
    assert first != other


def test_a_coupled_draft_model_equal_to_the_target_is_always_accepted(tiny_target):
    """The draft model reads the verifier's keyed noise: with the target's own distribution every draft
    token is the target's sample (an independent draw would be accepted about half as often)."""
    k = 4
    drafter = create_drafter("draft-model", tiny_target, draft_model=tiny_target)
    tokens, outcome = run(
        tiny_target, drafter, PROMPTS[0], max_new_tokens=10 * (k + 1), num_draft_tokens=k, sampling=SEEDED[0]
    )
    assert outcome.stats.mean_accepted_tokens == k + 1
    plain, _ = run(
        tiny_target, create_drafter("none", tiny_target), PROMPTS[0], max_new_tokens=10 * (k + 1), sampling=SEEDED[0]
    )
    assert tokens == plain


def test_batched_requests_give_their_solo_tokens(tiny_target, tiny_draft):
    """In a batch each sequence keys its noise by its own seed and positions: what the others draft, and
    which drafter each request uses, changes nothing."""
    drafters = [create_drafter("none", tiny_target), *named_drafters(tiny_target, tiny_draft).values()]
    engine = BatchEngine(
        tiny_target.backend, drafters[0], lambda config, drafter: make_policy(config.num_draft_tokens), frozenset(), 4
    )
    expected, got = {}, {}
    for index, drafter in enumerate(drafters):
        prompt = PROMPTS[index % len(PROMPTS)]
        config = GenerationConfig(
            max_new_tokens=NEW,
            num_draft_tokens=3,
            ignore_eos=True,
            sampling=dataclasses.replace(SEEDED[0], seed=index % 2),
        )
        expected[index], _ = run(tiny_target, drafters[0], prompt, max_new_tokens=NEW, sampling=config.sampling)
        engine.submit(BatchRequest(prompt, config, tag=index, drafter=drafter))
        got[index] = []
    for event in engine.run():
        got[event.tag].extend(event.new_tokens)
    assert got == expected


def test_unseeded_or_opted_out_sampling_keeps_rejection_sampling(tiny_target, verified):
    drafter = create_drafter("pld", tiny_target)
    for sampling in (SamplingParams(temperature=0.8), SamplingParams(temperature=0.8, seed=1, coupled=False)):
        tokens, _ = run(tiny_target, drafter, PROMPTS[1], max_new_tokens=20, num_draft_tokens=3, sampling=sampling)
        assert len(tokens) == 20
    assert verified == []
    assert SamplingParams(temperature=0.8, seed=1).is_coupled
    assert not SamplingParams(seed=1).is_coupled  # greedy needs no noise


# --- the real model ------------------------------------------------------------------------------------


@pytest.mark.real_model
def test_same_seed_same_text_with_every_drafter_on_smollm2(smollm2):
    """``--temperature 0.8 --seed 1``: identical token ids with none, pld, suffix and recycling, at a fixed
    and the ``auto`` draft length (whose depth follows measured timings), run after run.  draft-model is
    left out: no bundled model shares SmolLM2's vocabulary (the tiny-model test above covers it)."""
    from specdecode.generator import SpeculativeGenerator

    prompt = "Repeat this list exactly, then add two more fruits: apple, banana, cherry, date, elderberry, fig."
    params = dict(chat=True, max_new_tokens=16, ignore_eos=True, temperature=0.8, seed=1)
    plain_generator = SpeculativeGenerator.build(smollm2, "none")
    plain = plain_generator.generate(prompt, **params).token_ids
    assert len(plain) == 16
    assert all(plain_generator.generate(prompt, **params).token_ids == plain for _ in range(4))
    for name in ("pld", "suffix", "recycling"):
        generator = SpeculativeGenerator.build(smollm2, name)  # one per drafter: its state carries over runs
        for k in (4, "auto"):
            for run_ in range(5):  # the check: five runs each
                assert generator.generate(prompt, num_draft_tokens=k, **params).token_ids == plain, (name, k, run_)
