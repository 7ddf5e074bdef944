"""STAND-style stochastic n-gram drafting: lossless greedy output, exact sampling through the real engine
(chi-square, with a broken variant that must fail), bounded state, learning across requests."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import specdecode.drafters.stand
from helpers import (
    DRAWS,
    FAIL_P,
    PASS_P,
    PROMPTS,
    ParityBigramLM,
    V,
    chain_pvalues,
    hf_greedy,
    parity_counts,
    run,
    session_for,
)
from specdecode.drafters import create_drafter
from specdecode.sampling import sampling_probs
from specdecode.sampling_params import SamplingParams
from specdecode.types import Draft, StepFeedback


@pytest.mark.parametrize("options", [{}, {"template": "1,1,1,1,1", "min_ngram": 2}, {"topk": 2, "max_entries": 40}])
def test_greedy_output_equals_plain_decoding(tiny_target, options):
    drafter = create_drafter("stand", tiny_target, **options)
    for prompt in [*PROMPTS, PROMPTS[0]]:  # the last request runs on state learned from the others
        tokens, _ = run(tiny_target, drafter, prompt, max_new_tokens=48, num_draft_tokens=4)
        assert tokens == hf_greedy(tiny_target, prompt, 48), options
    assert drafter.num_entries <= options.get("max_entries", 32768)


def test_sampled_siblings_are_distinct_and_rows_drop_earlier_siblings(tiny_target):
    drafter = create_drafter("stand", tiny_target, template="4,2,1", topk=6)
    tokens, _ = run(tiny_target, drafter, PROMPTS[1], max_new_tokens=40, num_draft_tokens=3)
    session = session_for(drafter, PROMPTS[1], SamplingParams(temperature=1.0, seed=0), seed=0)

    # A context verified with a draft stores the target's distribution (the last step, with no room left to draft,
    # stores only the token it chose): the latest such context.
    def stored_ids(context: list[int]) -> int:
        found = drafter.lookup(tuple(context))
        return 0 if found is None else len(found[0])

    contexts = ([*PROMPTS[1], *tokens[:cut]] for cut in range(len(tokens) - 1, 0, -1))
    draft = session.propose(next(c for c in contexts if stored_ids(c) >= 4), max_tokens=3)
    assert draft.probs is not None and draft.parent_list[:4] == [-1] * 4  # four sampled root alternatives
    torch.testing.assert_close(draft.probs.sum(-1), torch.ones(len(draft.tokens)))
    for parent in set(draft.parent_list):
        siblings = [i for i, p in enumerate(draft.parent_list) if p == parent]
        assert len({draft.tokens[i] for i in siblings}) == len(siblings)
        for j, node in enumerate(siblings):
            earlier = [draft.tokens[i] for i in siblings[:j]]
            assert draft.probs[node, earlier].sum() == 0 and draft.probs[node, draft.tokens[node]] > 0
            if j:  # the same distribution, renormalised after removing the earlier draws
                rest = draft.probs[siblings[0]].clone()
                rest[earlier] = 0
                torch.testing.assert_close(draft.probs[node], rest / rest.sum())


def parity_transition_counts(sampling: SamplingParams, tokens_wanted: int) -> tuple[np.ndarray, np.ndarray, float]:
    """Counts [parity of the previous token's position, position in step, previous token, next token]
    from one stand drafter kept across many seeded requests; the exact rows; mean accepted tokens."""
    table = 2.0 * torch.randn(2, V, V, generator=torch.Generator().manual_seed(3))
    model = ParityBigramLM(table)
    drafter = create_drafter("stand", None, template="3,2,1", topk=3, max_ngram=2)
    counts, produced, steps = parity_counts(model, drafter, sampling, tokens_wanted)
    return counts, sampling_probs(table, sampling).numpy(), produced / steps


def parity_pvalues(sampling: SamplingParams, tokens_wanted: int) -> list[float]:
    counts, expected, mean_accepted = parity_transition_counts(sampling, tokens_wanted)
    assert 1.5 < mean_accepted < 3.5  # drafts are often rejected: wrong rows would show
    return [p for parity in range(2) for p in chain_pvalues(counts[parity], expected[parity])]


SAMPLING = SamplingParams(temperature=0.9, top_k=4)


def test_sampling_through_the_engine_is_lossless():
    pvalues = parity_pvalues(SAMPLING, DRAWS)
    assert len(pvalues) >= 16
    assert min(pvalues) > PASS_P / len(pvalues), pvalues  # Bonferroni over the strata


def test_rows_that_keep_earlier_siblings_fail_the_same_test(monkeypatch):
    """The classic tree bug: every sibling reports the parent's full distribution, although it was
    drawn without replacement."""
    monkeypatch.setattr(
        specdecode.drafters.stand, "without_earlier", lambda q, order: np.repeat(q[None] / q.sum(), len(order), 0)
    )
    assert min(parity_pvalues(SAMPLING, DRAWS // 4)) < FAIL_P


def test_table_is_bounded_and_evicts_the_stalest_entries():
    drafter = create_drafter("stand", None, topk=4, max_ngram=2, max_entries=100)
    session = session_for(drafter, [1, 2])
    generator = torch.Generator().manual_seed(0)
    vocab = 1000
    logits = torch.randn(9, vocab, generator=generator)
    for _ in range(50):
        heads = torch.randint(vocab, (8,), generator=generator).tolist()
        session.observe([*heads[-2:]], StepFeedback(Draft(heads), (), logits))
    assert drafter.num_entries == 100
    assert drafter.array_bytes <= 100 * 4 * (4 + 4)
    # The newest entries survive: the last step's chain gave its (2-gram and 1-gram) keys.
    assert drafter.lookup(tuple(heads[-2:])) is not None
    drafter.reset()
    assert drafter.num_entries == 0 and drafter.lookup(tuple(heads[-2:])) is None


def test_a_step_given_no_draft_records_only_the_chosen_token():
    """Where the policy asks for no draft, the table gets the target's token as a point mass (no softmax or top-k
    over the vocabulary); where it asked and the table had nothing, the target's distribution is stored in full."""
    drafter = create_drafter("stand", None, topk=4, max_ngram=2)
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))
    session = session_for(drafter, [1, 2])
    session.observe([1, 2, 7], StepFeedback(Draft(tokens=[]), (), logits, asked=False))  # plain chosen
    ids, probs = drafter.lookup((1, 2))
    assert ids.tolist() == [7] and probs.tolist() == [0.5]  # a point mass merged at the newest weight
    assert session.propose([1, 2, 7], max_tokens=2).tokens == []  # nothing known after (2, 7): asked, found none
    session.observe([1, 2, 7, 9], StepFeedback(Draft(tokens=[]), (), logits))
    assert drafter.lookup((2, 7))[0].tolist() == torch.topk(logits[0], 4).indices.tolist()
