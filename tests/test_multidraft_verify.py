"""The multi-draft verifiers ``spectr`` and ``optimal-md`` must emit the target's distribution exactly: chi-square over
10^5 verifications of k i.i.d. drafts (k = 2, 4; temperatures 0.5, 1.0, 1.5), drawn all at once through the same
decision code the verifiers run per node, with broken controls (a wrong keeping ratio, a skipped residual) that the
same test rejects; then through the engine on the bigram toy (chains and i.i.d. trees), and greedy equality at
temperature 0."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

import specdecode.verify.optimal_md
import specdecode.verify.spectr
from helpers import FAIL_P, PASS_P, BigramLM, V, chain_pvalues, chi2_pvalue
from specdecode.config import GenerationConfig
from specdecode.drafters.base import DraftSession
from specdecode.engine import speculative_decode
from specdecode.errors import SpecDecodeError
from specdecode.generator import SpeculativeGenerator
from specdecode.sampling import sampling_probs
from specdecode.sampling_params import SamplingParams
from specdecode.types import Draft
from specdecode.verify.optimal_md import TransportPlan, optimal_acceptance
from specdecode.verify.registry import is_lossless, parse_verifier, verifier_listing
from specdecode.verify.spectr import KSequential
from test_sampling_lossless import BigramDrafter, draw

SAMPLES = 100_000
VOCAB = 6
TEMPERATURES = [0.5, 1.0, 1.5]
PLANS = {"spectr": KSequential.solve, "optimal-md": lambda p, q, k: TransportPlan.solve(p, q, k, max_multisets=2000)}


def toy_pair(temperature: float, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """A target p and a draft q over ``VOCAB`` tokens at ``temperature``, from correlated random logits."""
    g = torch.Generator().manual_seed(seed)
    target = 1.5 * torch.randn(VOCAB, generator=g, dtype=torch.float64)
    drafted = target + 2.5 * torch.randn(VOCAB, generator=g, dtype=torch.float64)
    return torch.softmax(target / temperature, -1).numpy(), torch.softmax(drafted / temperature, -1).numpy()


def emitted(plan, q: np.ndarray, k: int, samples: int = SAMPLES) -> tuple[np.ndarray, float]:
    """Counts of the token emitted over ``samples`` verifications of k i.i.d. drafts from q, and how often a draft
    was kept."""
    rng = np.random.default_rng(0)
    tokens = rng.choice(len(q), size=(samples, k), p=q)
    uniforms = rng.random((samples, k)) if isinstance(plan, KSequential) else rng.random(samples)
    index, token = plan.choose(tokens, uniforms, rng.random(samples))
    kept = index >= 0
    assert np.array_equal(token[kept], tokens[np.flatnonzero(kept), index[kept]])  # a kept draft is its own token
    return np.bincount(token, minlength=len(q)), float(kept.mean())


@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("name", list(PLANS))
def test_the_emitted_token_follows_the_target(name, k, temperature):
    p, q = toy_pair(temperature)
    plan = PLANS[name](p, q, k)
    counts, kept = emitted(plan, q, k)
    assert chi2_pvalue(counts, p) > PASS_P
    assert abs(kept - plan.acceptance) < 5 * np.sqrt(plan.acceptance * (1 - plan.acceptance) / SAMPLES)


@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("k", [2, 4])
def test_optimal_md_reaches_the_optimum_and_spectr_stays_within_one_minus_one_over_e(k, temperature):
    p, q = toy_pair(temperature)
    optimum = optimal_acceptance(p, q, k)
    assert PLANS["optimal-md"](p, q, k).acceptance == pytest.approx(optimum, abs=1e-7)
    assert (1 - 1 / np.e) * optimum <= PLANS["spectr"](p, q, k).acceptance <= optimum + 1e-9


def keep_without_rho(p, q, k):
    """The wrong ratio: keep each draft with min(1, p / q), as if it were the only one."""
    return 1.0


def residual_is_p(p, kept):
    """The residual not corrected for what keeping a draft already emitted."""
    return np.cumsum(p)


BROKEN = {
    "spectr-wrong-ratio": ("spectr", specdecode.verify.spectr, "smallest_rho", keep_without_rho),
    "spectr-no-residual": ("spectr", specdecode.verify.spectr, "residual_cdf", residual_is_p),
    "optimal-md-no-residual": ("optimal-md", specdecode.verify.optimal_md, "residual_cdf", residual_is_p),
}


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("broken", list(BROKEN))
def test_a_broken_verifier_fails_the_same_test(broken, k, monkeypatch):
    name, module, function, replacement = BROKEN[broken]
    monkeypatch.setattr(module, function, replacement)
    p, q = toy_pair(1.0)
    counts, _ = emitted(PLANS[name](p, q, k), q, k)
    assert chi2_pvalue(counts, p) < FAIL_P


def test_a_programme_too_large_for_the_support_keeps_only_its_tokens_and_stays_exact():
    p, q = toy_pair(1.0)
    plan = TransportPlan.solve(p, q, 4, max_multisets=70)  # C(4 + 4, 4): four tokens and the blank
    assert (plan.classes < 4).sum() == 4 and not plan.complete and plan.acceptance < optimal_acceptance(p, q, 4)
    counts, _ = emitted(plan, q, 4)
    assert chi2_pvalue(counts, p) > PASS_P


# --- through the engine: the bigram toy, chains and trees of i.i.d. siblings ------------------------------


class IidTreeDrafter(BigramDrafter):
    """``branches`` i.i.d. children at every node, ``depth`` levels deep (a chain when ``branches`` is 1), each
    reporting the row it was drawn from."""

    def __init__(self, table: torch.Tensor, branches: int, depth: int) -> None:
        super().__init__(table, with_probs=True, branches=branches)
        self.depth = depth

    def session(self, request) -> IidTreeSession:
        return IidTreeSession(self, request)


class IidTreeSession(DraftSession):
    def __init__(self, drafter: IidTreeDrafter, request) -> None:
        self.drafter, self.table, self.rng = drafter, drafter.rows(request.sampling), request.numpy_rng()

    def propose(self, context, max_tokens) -> Draft:
        tokens, rows, parents = [], [], []
        level = [(-1, context[-1])]
        for _ in range(min(self.drafter.depth, max_tokens)):
            next_level = []
            for parent, last in level:
                for _ in range(self.drafter.branches):
                    token = draw(self.table[last], self.rng)
                    next_level.append((len(tokens), token))
                    tokens.append(token), rows.append(self.table[last]), parents.append(parent)
            level = next_level
        return Draft(tokens, torch.stack(rows), parents if self.drafter.branches > 1 else None)


def engine_counts(verifier: str, sampling: SamplingParams, branches: int, tokens_wanted: int):
    """Counts [1, previous token, next token] over ``tokens_wanted`` tokens decoded with ``verifier``, and the
    target's rows."""
    g = torch.Generator().manual_seed(3)
    target_table = 2.0 * torch.randn(V, V, generator=g)
    draft_table = target_table + 1.5 * torch.randn(V, V, generator=g)
    model, drafter = BigramLM(target_table), IidTreeDrafter(draft_table, branches, depth=2 if branches > 1 else 3)
    counts = np.zeros((1, V, V))
    produced, run, accepted = 0, 0, 0
    while produced < tokens_wanted:
        params = SamplingParams(sampling.temperature, sampling.top_k, seed=run, coupled=False)
        config = GenerationConfig(max_new_tokens=500, num_draft_tokens=3, sampling=params, verifier=verifier)
        previous = 0
        for chunk in speculative_decode(model, drafter, [0], config):
            for token in chunk:
                counts[0, previous, token] += 1
                previous = token
            produced += len(chunk)
            accepted += len(chunk) - 1
        run += 1
    assert accepted > produced / 4  # drafts were kept
    return counts, sampling_probs(target_table, sampling).numpy()


@pytest.mark.parametrize("branches", [1, 2], ids=["chain", "iid-tree"])
@pytest.mark.parametrize("verifier", [*PLANS, "optimal-md:max-multisets=6"])  # k = 2: 2 of 5 tokens, or K-SEQ
def test_the_engine_samples_exactly_from_the_target(verifier, branches):
    counts, expected = engine_counts(verifier, SamplingParams(temperature=0.9), branches, tokens_wanted=6_000)
    pvalues = chain_pvalues(counts, expected)
    assert len(pvalues) == V
    assert min(pvalues) > PASS_P / len(pvalues), pvalues


# --- chosen per request; greedy is exact matching ---------------------------------------------------------

PROMPT = "w1 w2 w3 w4 w1 w2 w3 w4 w1 w2 w3"


def test_listed_as_lossless():
    listed = {info.name: info.lossless for info in verifier_listing()}
    assert listed["spectr"] is listed["optimal-md"] is True and is_lossless("spectr") and is_lossless("optimal-md")


@pytest.mark.parametrize("verifier", list(PLANS))
@pytest.mark.parametrize("drafter", ["draft-model", "recycling"], ids=["chain-of-itself", "point-mass-tree"])
def test_greedy_output_equals_plain(tiny_target, verifier, drafter):
    params = {"max_new_tokens": 24, "num_draft_tokens": 3, "ignore_eos": True}
    plain = SpeculativeGenerator.build(tiny_target, "none").generate(PROMPT, **params)
    options = {"draft_model": tiny_target} if drafter == "draft-model" else {}
    result = SpeculativeGenerator.build(tiny_target, drafter, **options).generate(PROMPT, verifier=verifier, **params)
    assert result.token_ids == plain.token_ids
    assert result.stats.to_json()["verifier"] == verifier and result.stats.to_json()["lossless"] is True
    if drafter == "draft-model":  # the target drafting for itself: every greedy draft is kept
        assert result.stats.accepted_tokens == result.stats.drafted_tokens > 0


@pytest.mark.parametrize("verifier", list(PLANS))
def test_a_sampled_request_with_a_draft_model_runs(tiny_target, tiny_draft, verifier):
    generator = SpeculativeGenerator.build(tiny_target, "draft-model", draft_model=tiny_draft)
    result = generator.generate(PROMPT, max_new_tokens=16, temperature=0.8, seed=1, verifier=verifier)
    assert len(result.token_ids) > 0 and result.stats.to_json()["verifier"] == verifier


def test_optimal_md_without_scipy_is_refused_in_one_line(tiny_target, monkeypatch):
    monkeypatch.setitem(sys.modules, "scipy.optimize", None)  # what an install without scipy gives: ImportError
    with pytest.raises(SpecDecodeError, match=r"pip install 'specdecode\[multidraft\]'"):
        parse_verifier("optimal-md").prepare(tiny_target.backend)
