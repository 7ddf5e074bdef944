"""Speculative sampling must reproduce the target's distribution exactly — checked statistically
(chi-square over >= 10^5 draws), never by equality.  A deliberately broken verifier must fail the
same tests, which shows they have the power to catch a real bug."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import specdecode.engine
from specdecode.config import GenerationConfig, SamplingParams
from specdecode.drafters.base import Draft, Drafter
from specdecode.engine import speculative_decode
from specdecode.models.base import CausalLM, ForwardOutput, KVCache
from specdecode.verify.base import Verdict
from specdecode.verify.logits import sample, sampling_probs
from specdecode.verify.sampling import verify_speculative_sampling

DRAWS = 100_000
PASS_P = 1e-3  # seeded, so deterministic; a correct verifier passes comfortably
FAIL_P = 1e-6


def chi2_pvalue(observed: np.ndarray, probs) -> float:
    """Chi-square goodness of fit of counts against a distribution (renormalised in float64)."""
    expected = np.asarray(probs, dtype=np.float64)
    return float(chisquare(observed, expected / expected.sum() * observed.sum()).pvalue)


def broken_verify(target_probs, draft_tokens, draft_probs, generator) -> Verdict:
    """Forgets to subtract the draft distribution from the residual: biased towards draft tokens."""
    for i, token in enumerate(draft_tokens):
        p, q = target_probs[i], draft_probs[i] if draft_probs is not None else None
        q_token = float(q[token]) if q is not None else 1.0
        if float(torch.rand((), generator=generator)) * q_token < float(p[token]):
            continue
        return Verdict(i, sample(p, generator))
    return Verdict(len(draft_tokens), sample(target_probs[len(draft_tokens)], generator))


def first_token_counts(verify, p: torch.Tensor, q: torch.Tensor | None, draws: int) -> np.ndarray:
    """Distribution of the first emitted token of a one-token draft, drawn from q (or fixed)."""
    generator = torch.Generator().manual_seed(0)
    target = torch.stack([p, p])
    counts = np.zeros(len(p))
    drafts = torch.multinomial(q if q is not None else p, draws, replacement=True, generator=generator).tolist()
    for drafted in drafts:
        fixed = q is None
        verdict = verify(target, [drafted], None if fixed else q.view(1, -1), generator)
        counts[drafted if verdict.num_accepted else verdict.next_token] += 1
    return counts


def random_dist(v: int, seed: int, sharpness: float = 1.5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(sharpness * torch.randn(v, generator=g), -1)


@pytest.mark.parametrize("point_mass", [False, True])
def test_verifier_reproduces_target_distribution(point_mass):
    p, q = random_dist(6, 1), random_dist(6, 2)
    counts = first_token_counts(verify_speculative_sampling, p, None if point_mass else q, DRAWS)
    assert chi2_pvalue(counts, p.numpy()) > PASS_P


def test_broken_verifier_fails_the_same_test():
    p, q = random_dist(6, 1), random_dist(6, 2)
    counts = first_token_counts(broken_verify, p, q, DRAWS)
    assert chi2_pvalue(counts, p.numpy()) < FAIL_P


# --- end to end: a toy Markov-chain "model" and drafter through the real engine -------------------

V = 5


class ListCache(KVCache):
    def __init__(self) -> None:
        self.tokens: list[int] = []

    @property
    def length(self) -> int:
        return len(self.tokens)

    def crop(self, length: int) -> None:
        del self.tokens[length:]


class BigramLM(CausalLM):
    """Next-token logits depend on the current token only: the exact distribution is known."""

    def __init__(self, table: torch.Tensor) -> None:
        self.table = table
        self.name, self.vocab_size, self.max_context, self.num_layers = "bigram", V, 10**9, 1
        self.eos_token_ids = ()

    def new_cache(self) -> ListCache:
        return ListCache()

    def forward(self, tokens, cache, **_) -> ForwardOutput:
        cache.tokens.extend(tokens.tolist())
        return ForwardOutput(logits=self.table[tokens])


class BigramDrafter(Drafter):
    """Samples from a *different* bigram table and reports the probabilities it used."""

    def __init__(self, table: torch.Tensor, with_probs: bool) -> None:
        super().__init__(target=None)
        self.table, self.with_probs = table, with_probs
        self.generator = torch.Generator().manual_seed(7)

    def start(self, prompt_ids, sampling) -> None:
        self.sampling = sampling

    def propose(self, context, max_tokens) -> Draft:
        tokens, rows, last = [], [], context[-1]
        for _ in range(max_tokens):
            q = sampling_probs(self.table[last], self.sampling)
            last = sample(q, self.generator)
            tokens.append(last)
            rows.append(q)
        return Draft(tokens, torch.stack(rows) if self.with_probs and rows else None)


def transition_counts(sampling: SamplingParams, with_probs: bool, tokens_wanted: int) -> tuple[np.ndarray, np.ndarray]:
    """Counts [position-in-step, previous token, next token] over many generated tokens."""
    g = torch.Generator().manual_seed(3)
    target_table = 2.0 * torch.randn(V, V, generator=g)
    draft_table = target_table + 1.5 * torch.randn(V, V, generator=g)
    model, drafter = BigramLM(target_table), BigramDrafter(draft_table, with_probs)
    counts = np.zeros((4, V, V))
    produced, run = 0, 0
    while produced < tokens_wanted:
        config = GenerationConfig(
            max_new_tokens=1000, num_draft_tokens=3,
            sampling=SamplingParams(sampling.temperature, sampling.top_k, sampling.top_p, seed=run),
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


def chain_pvalues(counts: np.ndarray, expected_rows: np.ndarray) -> list[float]:
    """One chi-square test per (position in step, previous token) with enough samples."""
    pvalues = []
    for position in range(counts.shape[0]):
        for prev in range(V):
            row = counts[position, prev]
            support = expected_rows[prev] > 0
            assert row[~support].sum() == 0, "a token outside top-k/top-p was emitted"
            if row.sum() >= 500 and support.sum() > 1:
                pvalues.append(chi2_pvalue(row[support], expected_rows[prev][support]))
    return pvalues


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


def test_engine_with_broken_verifier_fails(monkeypatch):
    monkeypatch.setattr(specdecode.engine, "verify_speculative_sampling", broken_verify)
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


def test_greedy_params_give_one_hot():
    logits = torch.tensor([[0.1, 2.0, -1.0]])
    assert sampling_probs(logits, SamplingParams()).tolist() == [[0.0, 1.0, 0.0]]
