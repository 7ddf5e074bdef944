"""Hierarchical drafting (``hsd``): its drafts are exactly the draft model's, made in fewer draft-model
forwards; greedy output is plain output; sampling with it reproduces the target's distribution."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import DRAWS, FAIL_P, PASS_P, BigramLM, V, chain_pvalues, hf_greedy, run
from specdecode.config import GenerationConfig
from specdecode.drafters import create_drafter
from specdecode.drafters.base import Drafter, DraftRequest, DraftSession
from specdecode.drafters.draft_model import DraftModelSession
from specdecode.drafters.hsd import PROBE_EVERY, GuessDepth, HierarchicalSession, LevelChooser, LowerLevel
from specdecode.drafters.pld import PromptLookupDrafter
from specdecode.engine import speculative_decode
from specdecode.errors import SpecDecodeError
from specdecode.sampling import sampling_probs
from specdecode.sampling_params import SamplingParams

PROMPT = [3, 4, 5, 6, 7, 8, 9, 3, 4, 5, 6, 7, 8, 9, 3, 4, 5]


@pytest.mark.parametrize("lower", ["pld", "suffix", "auto"])
@pytest.mark.parametrize("k", [3, 8, "auto"])
def test_greedy_output_equals_plain(tiny_target, tiny_draft, lower, k):
    drafter = create_drafter("hsd", tiny_target, draft_model=tiny_draft, levels=f"{lower},draft-model")
    tokens, outcome = run(tiny_target, drafter, PROMPT, max_new_tokens=40, num_draft_tokens=k)
    assert tokens == hf_greedy(tiny_target, PROMPT, 40)
    assert outcome.stats.new_tokens == 40


def test_drafts_are_the_draft_models_own_in_fewer_forwards(tiny_target, tiny_draft):
    """The lower level only saves draft-model forwards: the draft is what draft-model proposes."""
    request = DraftRequest(prompt_ids=tuple(PROMPT))
    backend = tiny_draft.backend
    lower = PromptLookupDrafter(tiny_draft).session(request)
    hierarchical = HierarchicalSession(backend, LevelChooser([LowerLevel("pld", lower, GuessDepth(8))]), request)
    direct = DraftModelSession(backend, request)
    context = list(PROMPT)
    forwards = drafted = 0
    for _ in range(5):  # resynchronising after each step, as the engine makes it
        ours, theirs = hierarchical.propose(context, 8), direct.propose(context, 8)
        assert ours.tokens == theirs.tokens
        forwards += hierarchical.draft_forwards
        drafted += len(ours.tokens)
        hierarchical.draft_forwards = 0
        context += ours.tokens[:3]  # the target kept three of them
    assert forwards < drafted  # the repetitive context lets prompt lookup guess right


def test_vocab_trim_drafts_what_draft_model_drafts_with_the_same_rows(tiny_target, tiny_draft):
    """``draft_vocab``: the draft-model level drafts over the same VocabTrim rows as ``draft-model`` (the guess
    checked by a forward of several tokens as well as one token at a time), and output stays plain greedy."""
    drafter = create_drafter("hsd", tiny_target, draft_model=tiny_draft, draft_vocab=32)
    assert drafter.head is not None and create_drafter("hsd", tiny_target, draft_model=tiny_draft).head is None
    request = DraftRequest(prompt_ids=tuple(PROMPT))
    rows = drafter.head.for_prompt(PROMPT)
    backend = tiny_draft.backend
    lower = PromptLookupDrafter(tiny_draft).session(request)
    hierarchical = HierarchicalSession(backend, LevelChooser([LowerLevel("pld", lower, GuessDepth(8))]), request, rows)
    direct = DraftModelSession(backend, request, rows)
    checked_rows = []  # per draft-model forward: how many rows it read logits of (1 + the guess's length)
    logits_of = hierarchical._logits
    hierarchical._logits = lambda fed, first: (checked_rows.append(len(fed) - first), logits_of(fed, first))[1]
    context = list(PROMPT)
    for _ in range(4):
        ours, theirs = hierarchical.propose(context, 8), direct.propose(context, 8)
        assert ours.tokens == theirs.tokens and set(ours.tokens) <= set(rows.ids.tolist())
        context += ours.tokens[:3]
    assert max(checked_rows) > 1  # guesses were checked through the trimmed head in forwards of several rows
    tokens, _ = run(tiny_target, drafter, PROMPT, max_new_tokens=40, num_draft_tokens=8)
    assert tokens == hf_greedy(tiny_target, PROMPT, 40)


def test_it_reads_the_context_and_reports_its_prompt_prefill_as_setup(tiny_target, tiny_draft):
    """Like ``draft-model``, so that ``auto`` prices its reading of a prompt and keeps it out of the per-token cost."""
    drafter = create_drafter("hsd", tiny_target, draft_model=tiny_draft)
    assert drafter.reads_context and 0 < drafter.reading_cost() < 5
    seconds = drafter.draft_token_seconds()  # a draft model's token, timed once: what a first draft is priced at
    assert 0 < seconds < 1 and drafter.draft_token_seconds() == seconds
    prompt = PROMPT * 4
    session = drafter.session(DraftRequest(prompt_ids=tuple(prompt)))
    first = session.propose(prompt, 3)
    assert first.setup_s > 0
    assert session.propose([*prompt, *first.tokens[:2]], 3).setup_s == 0.0  # one token to feed: nothing to read


def test_auto_guess_depth_follows_agreement_and_cost():
    cheap = GuessDepth(None, curve=tuple(1.0 + 0.05 * w for w in range(16)))
    for _ in range(20):
        cheap.observe(guessed=12, agreed=12)  # the lower level is always right
    assert cheap.next(room=12) >= 8
    assert cheap.next(room=3) == 3  # never more than the round has room for
    costly = GuessDepth(None, curve=tuple(1.0 + 0.5 * w for w in range(16)))
    for _ in range(20):
        costly.observe(guessed=2, agreed=0)  # always wrong: no guess pays
    rounds = [costly.next(room=8) for _ in range(2 * PROBE_EVERY)]
    assert rounds.count(1) == 2 and set(rounds) == {0, 1}  # a probe every few rounds, plain otherwise
    assert GuessDepth(5).next(room=3) == 3 and GuessDepth(5).next(room=0) == 0


def test_auto_levels_choose_the_level_that_agrees_and_weigh_its_own_cost():
    curve = tuple(1.0 + 0.05 * w for w in range(16))
    good, bad = GuessDepth(None, curve=curve), GuessDepth(None, curve=curve)
    for _ in range(20):
        good.observe(guessed=6, agreed=6)
        bad.observe(guessed=2, agreed=0)
    chooser = LevelChooser([LowerLevel("bad", None, bad), LowerLevel("good", None, good)], forward_s=0.01)
    level, depth = chooser.choose(room=8)
    assert level.name == "good" and depth >= 4
    # The same agreement, but guessing costs a hundred draft forwards: the draft model alone is faster.
    chooser.levels[1].guess_s = 1.0
    rounds = [chooser.choose(room=8) for _ in range(2 * PROBE_EVERY)]
    assert [r for r in rounds if r[0] is not None] == [(chooser.levels[0], 1)] * 2  # only probes, least-tried first


def test_auto_levels_follow_the_text_with_every_level(tiny_target, tiny_draft):
    drafter = create_drafter("hsd", tiny_target, draft_model=tiny_draft, levels="auto")
    session = drafter.session(DraftRequest(prompt_ids=tuple(PROMPT)))
    assert [level.name for level in session.chooser.levels] == ["pld", "suffix", "recycling", "cacheback", "stand"]
    context = list(PROMPT)
    for _ in range(4):
        context += session.propose(context, 6).tokens[:2]
    assert sum(level.guesses for level in session.chooser.levels) > 0
    session.finish(context)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({}, "needs --draft-model"),
        ({"draft_model": "x", "levels": "draft-model,pld"}, "must be 'LOWER,draft-model'"),
        ({"draft_model": "x", "levels": "layer-skip,draft-model"}, "LOWER one of pld"),
        ({"draft_model": "x", "lower_depth": 0}, "positive integer"),
    ],
)
def test_bad_options_are_one_line_errors(tiny_target, options, message):
    with pytest.raises(SpecDecodeError, match=message) as info:
        create_drafter("hsd", tiny_target, **options)
    assert "\n" not in str(info.value)


class _BigramHierarchy(Drafter):
    """``hsd`` over toy models: prompt lookup guessing for a bigram draft model."""

    def __init__(self, draft: BigramLM) -> None:
        super().__init__(target=None)
        self.draft = draft

    def session(self, request: DraftRequest) -> DraftSession:
        lower = PromptLookupDrafter(None, max_ngram=1).session(request)
        return HierarchicalSession(self.draft, LevelChooser([LowerLevel("pld", lower, GuessDepth(4))]), request)


def _hierarchy_pvalues(coupled: bool) -> list[float]:
    g = torch.Generator().manual_seed(7)
    target_table = 2.0 * torch.randn(V, V, generator=g)
    draft = BigramLM(target_table + 1.5 * torch.randn(V, V, generator=g))
    target, drafter = BigramLM(target_table), _BigramHierarchy(draft)
    sampling = SamplingParams(temperature=1.0)
    counts = np.zeros((1, V, V))
    produced, seed = 0, 0
    while produced < DRAWS // 4:
        config = GenerationConfig(
            max_new_tokens=500,
            num_draft_tokens=3,
            sampling=SamplingParams(1.0, seed=seed, coupled=coupled),
        )
        previous = 0
        for chunk in speculative_decode(target, drafter, [0], config):
            for token in chunk:
                counts[0, previous, token] += 1
                previous = token
            produced += len(chunk)
        seed += 1
    return chain_pvalues(counts, sampling_probs(target_table, sampling).numpy())


@pytest.mark.parametrize("coupled", [False, True])
def test_sampling_reproduces_the_target_distribution(coupled):
    pvalues = _hierarchy_pvalues(coupled)
    assert len(pvalues) >= 4
    assert min(pvalues) > PASS_P / len(pvalues), pvalues


def test_misreporting_the_draft_distribution_fails_the_same_test(monkeypatch):
    """Control: a draft reported with another row's distribution than the one it was drawn from (an
    off-by-one in the rows) is corrected against the wrong q — the test must see the bias.  (Dropping q
    altogether would not be one: a drawn token passed on as a point mass is still verified exactly.)"""
    choose = HierarchicalSession._choose

    def misreported(self, logits, position):
        token, probs, p = choose(self, logits, position)
        return token, torch.roll(probs, 1), p

    monkeypatch.setattr(HierarchicalSession, "_choose", misreported)
    assert min(_hierarchy_pvalues(coupled=False)) < FAIL_P
