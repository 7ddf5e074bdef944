"""A self-drafter's acceptance prior, measured by teacher forcing on a built-in text, and what ``auto`` does with it."""

from __future__ import annotations

import pytest
import torch

from helpers import tiny_llama3
from specdecode.draft_length.cost_model import CostModel
from specdecode.draft_length.tuning import INHERITED_PROBE_BACKOFF
from specdecode.drafters import create_drafter
from specdecode.drafters._calibration import calibration_text, self_draft_agreement
from specdecode.drafters.kangaroo import KangarooAdapter
from specdecode.generator import SpeculativeGenerator
from tiny_models import wrap


def test_the_answer_is_measured_and_the_question_is_not(tiny_target):
    tokens, start = calibration_text(tiny_target)
    question = tiny_target.tokenizer.apply_chat_template(
        [{"role": "user", "content": "x"}], tokenize=True, add_generation_prompt=True
    )
    assert len(question) <= start < len(tokens) - 1
    assert int(tokens.max()) < tiny_target.backend.vocab_size


def test_a_draft_through_every_layer_agrees_on_every_token_and_one_through_fewer_does_not(tiny_target):
    drafter = create_drafter("layer-skip", tiny_target, draft_vocab=0)
    every, fewer = (
        self_draft_agreement(tiny_target, tiny_target.backend, drafter.head, skipped)
        for skipped in (frozenset(), frozenset({1, 2}))
    )
    assert every == 1.0
    assert 0.0 <= fewer < 1.0


def test_each_self_drafter_reports_its_measured_agreement_as_its_prior(tiny_target):
    backend = tiny_target.backend
    early = create_drafter("early-exit", tiny_target, exits="1,2", draft_vocab=0)
    assert set(early.exit_agreement) == {1, 2}
    assert early.acceptance_prior() == max(early.exit_agreement.values())
    assert early.exit_prior(1) == early.exit_agreement[1]  # the planner starts each exit from it
    skip = create_drafter("layer-skip", tiny_target, draft_vocab=0)
    kangaroo = create_drafter("kangaroo", tiny_target, adapter=KangarooAdapter.for_backend(backend, 1), draft_vocab=0)
    # An untrained adapter is the plain exit after layer 1: it agrees as that exit does.
    assert kangaroo.acceptance_prior() == pytest.approx(early.exit_agreement[1])
    assert 0.0 <= skip.acceptance_prior() <= 1.0
    policy = SpeculativeGenerator(tiny_target, kangaroo).draft_length_policy("auto")
    assert policy.prior_acceptance == kangaroo.acceptance_prior()


def test_without_a_tokenizer_the_declared_prior_stands():
    torch.manual_seed(0)
    loaded = wrap(tiny_llama3().eval(), tokenizer=None)
    early = create_drafter("early-exit", loaded, exits="1", draft_vocab=0)
    assert early.exit_agreement is None and early.acceptance_prior() is None
    assert early.exit_prior(1) == 1 / loaded.backend.num_layers


def test_a_prior_that_makes_no_depth_pay_starts_probing_where_losing_probes_would_have_left_it():
    hopeless = CostModel(prior_acceptance=0.05, draft_token_share=0.4)
    assert hopeless.fork().next_length(16) == 0
    assert hopeless.probe_interval == INHERITED_PROBE_BACKOFF * hopeless.probe_every
    assert hopeless.fork().probe_interval == hopeless.probe_interval
    hopeful = CostModel(draft_token_share=0.4)
    assert hopeful.probe_interval == hopeful.probe_every
    assert hopeful.fork().next_length(16) > 0


@pytest.mark.real_model
def test_an_exit_smollm2_rejects_makes_no_draft_on_a_cold_request(smollm2):
    generator = SpeculativeGenerator.build(smollm2, "early-exit")
    assert generator.drafter.acceptance_prior() < 0.2  # its exits agree with the full model on 1-7% of tokens
    result = generator.generate("Name three colours.", chat=True, max_new_tokens=24, ignore_eos=True)
    assert result.stats.drafted_tokens == 0


def test_a_draft_model_keeps_the_declared_prior(tiny_target, tiny_draft):
    """Taken as the prior, a draft model's measured agreement makes ``auto`` read prompts that do not pay back (see the
    module doc)."""
    drafter = create_drafter("draft-model", tiny_target, draft_model=tiny_draft)
    assert drafter.acceptance_prior() is None
    assert SpeculativeGenerator(tiny_target, drafter).draft_length_policy("auto").prior_acceptance == 0.5
