"""Speculative sampling must reproduce the target's distribution exactly — checked statistically
(chi-square over ``DRAWS`` = 25,000 draws, stratified), never by equality.  A deliberately broken verifier
must fail the same tests, which shows they have the power to catch a real bug: resampling from p instead
of the residual fails with p-values below 1e-16 at 5,000 draws through the engine and below 1e-90 at the
verifier alone, so 25,000 draws keep a wide margin."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import specdecode.verify.rejection
from helpers import DRAWS, FAIL_P, PASS_P, BigramLM, V, chain_pvalues, chi2_pvalue
from specdecode.batch_engine import BatchEngine, BatchRequest
from specdecode.config import GenerationConfig
from specdecode.draft_length.factory import make_policy
from specdecode.drafters.base import Drafter, DraftRequest, DraftSession
from specdecode.engine import speculative_decode
from specdecode.sampling import sample, sampling_probs
from specdecode.sampling_params import SamplingParams
from specdecode.types import Draft
from specdecode.verify.rejection import verify_speculative_sampling


def break_verifier(monkeypatch) -> None:
    """The classic bug: on rejection, resample from p instead of the residual max(p - q, 0)."""
    monkeypatch.setattr(specdecode.verify.rejection, "_residual", lambda p, q, token: p)


def first_token_counts(
    p: torch.Tensor, q: torch.Tensor | None, draws: int, siblings: int = 1, replacement: bool = True
) -> np.ndarray:
    """Distribution of the first emitted token when ``siblings`` alternatives are drafted at the root:
    drawn from q with or without replacement, or (q None) fixed distinct tokens."""
    generator = torch.Generator().manual_seed(0)
    target = p.expand(siblings + 1, -1)
    counts = np.zeros(len(p))
    for _ in range(draws):
        if q is None:
            tokens, rows = list(range(siblings)), None
        else:
            tokens, rows, remaining = [], [], q.clone()
            for _ in range(siblings):
                drawn_from = remaining / remaining.sum()
                token = sample(drawn_from, generator)
                tokens.append(token)
                rows.append(drawn_from)
                if not replacement:
                    remaining[token] = 0.0
            rows = torch.stack(rows)
        draft = Draft(tokens=tokens, probs=rows, parents=[-1] * siblings)
        verdict = verify_speculative_sampling(target, draft, generator)
        counts[tokens[verdict.path[0]] if verdict.path else verdict.next_token] += 1
    return counts


def random_dist(v: int, seed: int, sharpness: float = 1.5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(sharpness * torch.randn(v, generator=g), -1)


PROPOSALS = {
    "chain-sampled": dict(siblings=1, point_mass=False, replacement=True),
    "chain-point-mass": dict(siblings=1, point_mass=True, replacement=True),
    "tree-iid-siblings": dict(siblings=3, point_mass=False, replacement=True),
    "tree-without-replacement": dict(siblings=3, point_mass=False, replacement=False),
    "tree-point-mass-siblings": dict(siblings=3, point_mass=True, replacement=True),
}


@pytest.mark.parametrize("case", list(PROPOSALS))
def test_verifier_reproduces_target_distribution(case):
    spec = PROPOSALS[case]
    p, q = random_dist(6, 1), random_dist(6, 2)
    counts = first_token_counts(p, None if spec["point_mass"] else q, DRAWS, spec["siblings"], spec["replacement"])
    assert chi2_pvalue(counts, p.numpy()) > PASS_P


@pytest.mark.parametrize("case", ["chain-sampled", "tree-without-replacement", "tree-point-mass-siblings"])
def test_broken_verifier_fails_the_same_test(case, monkeypatch):
    break_verifier(monkeypatch)
    spec = PROPOSALS[case]
    p, q = random_dist(6, 1), random_dist(6, 2)
    counts = first_token_counts(p, None if spec["point_mass"] else q, DRAWS, spec["siblings"], spec["replacement"])
    assert chi2_pvalue(counts, p.numpy()) < FAIL_P


# --- end to end: a toy Markov-chain "model" and drafter through the real engine -------------------


class BigramDrafter(Drafter):
    """Samples from a *different* bigram table and reports the probabilities it used."""

    def __init__(self, table: torch.Tensor, with_probs: bool, branches: int = 1) -> None:
        super().__init__(target=None)
        self.table, self.with_probs, self.branches = table, with_probs, branches
        self._rows: dict[tuple, torch.Tensor] = {}

    def rows(self, sampling: SamplingParams) -> torch.Tensor:
        """[V, V] the processed draft distribution after every token, computed once per setting: the
        verifier under test runs per draw, the drafter's own arithmetic need not."""
        key = (sampling.temperature, sampling.top_k, sampling.top_p)
        if key not in self._rows:
            self._rows[key] = sampling_probs(self.table, sampling)
        return self._rows[key]

    def session(self, request: DraftRequest) -> BigramSession:
        return BigramSession(self, request)


def draw(probs: torch.Tensor, rng: np.random.Generator) -> int:
    """One token from [V] probabilities by inverse CDF (a zero-probability token is never drawn)."""
    cdf = np.cumsum(probs.numpy(), dtype=np.float64)
    return min(int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right")), len(cdf) - 1)


class BigramSession(DraftSession):
    def __init__(self, drafter: BigramDrafter, request: DraftRequest) -> None:
        self.drafter, self.table = drafter, drafter.rows(request.sampling)
        self.rng = request.numpy_rng()

    def propose(self, context, max_tokens) -> Draft:
        """``branches`` > 1: that many root alternatives drawn without replacement, each continued
        by a sampled chain — a tree that exercises multi-draft verification and cache compaction."""
        table, branches = self.table, self.drafter.branches
        tokens, rows, parents = [], [], []
        q_root = table[context[-1]]
        remaining = q_root.clone()
        for _ in range(min(branches, int((q_root > 0).sum()))):
            drawn_from = remaining / remaining.sum()
            last = draw(drawn_from, self.rng)
            remaining[last] = 0.0
            tokens.append(last), rows.append(drawn_from), parents.append(-1)
            for _ in range(max_tokens - 1):
                q = table[last]
                last = draw(q, self.rng)
                parents.append(len(tokens) - 1)
                tokens.append(last), rows.append(q)
        probs = torch.stack(rows) if self.drafter.with_probs and rows else None
        return Draft(tokens, probs, parents if branches > 1 else None)


def transition_counts(
    sampling: SamplingParams, with_probs: bool, tokens_wanted: int, branches: int = 1
) -> tuple[np.ndarray, np.ndarray]:
    """Counts [position-in-step, previous token, next token] over many generated tokens."""
    g = torch.Generator().manual_seed(3)
    target_table = 2.0 * torch.randn(V, V, generator=g)
    draft_table = target_table + 1.5 * torch.randn(V, V, generator=g)
    model, drafter = BigramLM(target_table), BigramDrafter(draft_table, with_probs, branches)
    counts = np.zeros((4, V, V))
    produced, run = 0, 0
    while produced < tokens_wanted:
        config = GenerationConfig(
            max_new_tokens=1000,
            num_draft_tokens=3,
            sampling=SamplingParams(sampling.temperature, sampling.top_k, sampling.top_p, seed=run, coupled=False),
        )
        previous = 0
        for chunk in speculative_decode(model, drafter, [0], config):
            for position, token in enumerate(chunk):
                counts[position, previous, token] += 1
                previous = token
            produced += len(chunk)
        run += 1
    expected_rows = sampling_probs(target_table, sampling).numpy()
    return counts, expected_rows


SAMPLING_CASES = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=3),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=0.9, top_k=4, top_p=0.9),
]


@pytest.mark.parametrize("sampling", SAMPLING_CASES, ids=lambda s: f"T{s.temperature}-k{s.top_k}-p{s.top_p}")
def test_engine_samples_exactly_from_the_target(sampling):
    counts, expected = transition_counts(sampling, with_probs=True, tokens_wanted=DRAWS)
    pvalues = chain_pvalues(counts, expected)
    assert len(pvalues) >= 8
    # Bonferroni over the strata: every conditional distribution, at every position in a step, is p.
    assert min(pvalues) > PASS_P / len(pvalues), pvalues


def test_engine_with_point_mass_drafter_is_lossless():
    counts, expected = transition_counts(SamplingParams(temperature=1.0), with_probs=False, tokens_wanted=DRAWS)
    pvalues = chain_pvalues(counts, expected)
    assert min(pvalues) > PASS_P / len(pvalues), pvalues


@pytest.mark.parametrize("with_probs", [True, False], ids=["sampled-tree", "point-mass-tree"])
def test_engine_tree_drafts_are_lossless(with_probs):
    sampling = SamplingParams(temperature=0.9, top_k=4)
    counts, expected = transition_counts(sampling, with_probs=with_probs, tokens_wanted=DRAWS, branches=3)
    pvalues = chain_pvalues(counts, expected)
    assert min(pvalues) > PASS_P / len(pvalues), pvalues


def batched_transition_counts(sampling: SamplingParams, tokens_per_sequence: int) -> tuple[np.ndarray, np.ndarray]:
    """Four sequences decoding together, each with its own draft depth (0, 1, 3, 5) and seed: counts
    [sequence, position-in-step, previous token, next token]."""
    g = torch.Generator().manual_seed(3)
    target_table = 2.0 * torch.randn(V, V, generator=g)
    draft_table = target_table + 1.5 * torch.randn(V, V, generator=g)
    model, drafter = BigramLM(target_table), BigramDrafter(draft_table, with_probs=True)
    depths = (0, 1, 3, 5)
    counts = np.zeros((len(depths), max(depths) + 1, V, V))
    previous = [0] * len(depths)
    engine = BatchEngine(model, drafter, lambda config, drafter: make_policy(config.num_draft_tokens), frozenset(), 4)
    for round_ in range(tokens_per_sequence // 1000):
        for index, k in enumerate(depths):
            seed = round_ * len(depths) + index
            config = GenerationConfig(
                max_new_tokens=1000,
                num_draft_tokens=k,
                sampling=dataclasses.replace(sampling, seed=seed, coupled=False),
            )
            engine.submit(BatchRequest([previous[index]], config, tag=index))
        for event in engine.run():
            for position, token in enumerate(event.new_tokens):
                counts[event.tag, position, previous[event.tag], token] += 1
                previous[event.tag] = token
    return counts, sampling_probs(target_table, sampling).numpy()


def test_batched_engine_samples_exactly_from_the_target_per_sequence():
    sampling = SamplingParams(temperature=0.9, top_k=4)
    counts, expected = batched_transition_counts(sampling, DRAWS // 4)
    pvalues = [p for sequence in counts for p in chain_pvalues(sequence, expected)]
    assert len(pvalues) >= 12
    assert min(pvalues) > PASS_P / len(pvalues), pvalues


def test_batched_engine_with_broken_verifier_fails(monkeypatch):
    break_verifier(monkeypatch)
    counts, expected = batched_transition_counts(SamplingParams(temperature=1.0), DRAWS // 2)
    assert min(p for sequence in counts[1:] for p in chain_pvalues(sequence, expected)) < FAIL_P


def test_engine_with_broken_verifier_fails(monkeypatch):
    break_verifier(monkeypatch)
    counts, expected = transition_counts(SamplingParams(temperature=1.0), with_probs=True, tokens_wanted=DRAWS // 4)
    assert min(chain_pvalues(counts, expected)) < FAIL_P


@pytest.mark.parametrize("params", SAMPLING_CASES[1:], ids=str)
def test_processed_distribution_matches_transformers_warpers(params):
    logits = 3 * torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    warpers = LogitsProcessorList([TemperatureLogitsWarper(params.temperature)])
    if params.top_k:
        warpers.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1:
        warpers.append(TopPLogitsWarper(params.top_p))
    theirs = torch.softmax(warpers(None, logits.clone()), -1)
    torch.testing.assert_close(sampling_probs(logits, params), theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.99])
def test_nucleus_found_among_the_top_candidates_is_the_full_sorts(top_p):
    """Rows whose nucleus is a few tokens, about a thousand, and most of a 20k vocabulary, in one batch:
    the first candidates, the next size and the whole sort all give transformers' (sorting) warper."""
    logits = torch.randn(3, 20_000, generator=torch.Generator().manual_seed(1)) * torch.tensor([[8.0], [3.0], [0.5]])
    theirs = torch.softmax(TopPLogitsWarper(top_p)(None, logits.clone()), -1)
    ours = sampling_probs(logits, SamplingParams(temperature=1.0, top_p=top_p))
    assert torch.equal(ours > 0, theirs > 0)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_greedy_params_give_one_hot():
    logits = torch.tensor([[0.1, 2.0, -1.0]])
    assert sampling_probs(logits, SamplingParams()).tolist() == [[0.0, 1.0, 0.0]]


@pytest.mark.parametrize("temperature", [5e-324, 1e-30, 1e-21])
def test_a_vanishing_temperature_is_its_limit_not_nan(temperature):
    """logits / 5e-324 overflows float32 (the temperature itself rounds to 0): the distribution is the limit, the
    argmax set, ties sharing it; the Gumbel weights keep the same support."""
    from specdecode.sampling import sampling_log_weights, sampling_probs

    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0], [0.5, -1.0, 4.0, 0.0]])
    params = SamplingParams(temperature=temperature, top_p=0.95)
    expected = torch.tensor([[0.0, 0.5, 0.0, 0.5], [0.0, 0.0, 1.0, 0.0]])
    assert torch.equal(sampling_probs(logits, params), expected)
    assert torch.equal(torch.isfinite(sampling_log_weights(logits, params)), expected > 0)
