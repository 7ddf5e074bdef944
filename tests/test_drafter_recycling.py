"""Token Recycling: lossless greedy output, an adjacency matrix fed by every verified row, a bounded
state that persists across requests and makes a repeated request faster."""

from __future__ import annotations

import pytest
import torch

from helpers import PROMPTS, hf_greedy, run, session_for
from specdecode.drafters import create_drafter
from specdecode.drafters.recycling import parse_template
from specdecode.errors import SpecDecodeError
from specdecode.types import Draft, StepFeedback


def test_template_levels_are_handed_out_best_first():
    assert parse_template("3,3,2", "t") == [(-1, 0), (-1, 1), (-1, 2), (0, 0), (0, 1), (1, 0), (3, 0), (3, 1)]
    assert parse_template(2, "t") == [(-1, 0), (-1, 1)]
    for bad in ("", "2,0", "a,b", -1):
        with pytest.raises(SpecDecodeError, match="template"):
            parse_template(bad, "t")
    shape = parse_template("4,3,3,2,2,1", "t")
    for node, (parent, rank) in enumerate(shape):
        assert parent < node
        earlier_ranks = [r for p, r in shape[:node] if p == parent]
        assert earlier_ranks == list(range(rank)), "siblings must have ranks 0, 1, ... in list order"


@pytest.mark.parametrize("options", [{}, {"template": "1,1,1,1,1,1"}, {"template": "5,2,2,1", "max_nodes": 6}])
def test_greedy_output_equals_plain_decoding(tiny_target, options):
    drafter = create_drafter("recycling", tiny_target, **options)
    for prompt in [*PROMPTS, PROMPTS[0]]:  # the last request runs on state learned from the others
        tokens, outcome = run(tiny_target, drafter, prompt, max_new_tokens=48, num_draft_tokens=4)
        assert tokens == hf_greedy(tiny_target, prompt, 48), options
        assert outcome.stats.drafted_tokens <= outcome.stats.steps * options.get("max_nodes", 16)


def test_every_verified_row_is_recycled(tiny_target):
    drafter = create_drafter("recycling", tiny_target, template="2,1")
    session = session_for(drafter, [7, 8])
    logits = torch.randn(4, 96, generator=torch.Generator().manual_seed(0))
    draft = Draft(tokens=[10, 11, 12], parents=[-1, -1, 0])
    session.observe([7, 8, 10, 5], StepFeedback(draft=draft, path=(0,), target_logits=logits))
    top2 = torch.topk(logits, 2, dim=-1).indices.tolist()
    # Row 0 follows the context's last token; rows 2 and 3 belong to the rejected node 11 and the
    # unverified-by-path node 12 — recycled all the same.
    assert [drafter.successors(t).tolist() for t in (8, 10, 11, 12)] == top2
    assert drafter.successors(5).tolist() == []  # the target's own token has no row yet
    # The matrix's top-1 after 8 comes first; then what followed 8 earlier in this context (10).
    proposal = session.propose([7, 8, 10, 5, 8], max_tokens=3)
    expected = list(dict.fromkeys([top2[0][0], 10, top2[0][1]]))[:2]
    assert proposal.tokens[:2] == expected and proposal.parents[:2] == [-1, -1]


def test_context_successors_let_a_cold_request_copy(tiny_target):
    """With an empty matrix, a repeated span of the context is drafted as a chain: each node takes what
    followed its last two tokens earlier (copying), so the draft follows the earlier occurrence."""
    drafter = create_drafter("recycling", tiny_target, template="2,1,1,1")
    context = [11, 12, 13, 14, 15, 16, 30, 11, 12]
    session = session_for(drafter, context)
    draft = session.propose(context, max_tokens=4)
    assert draft.tokens == [13, 14, 15, 16] and draft.is_chain
    assert session.candidates(12, 13) == [14]  # the pair's successor; no matrix row yet


@pytest.mark.parametrize(("vocab", "template"), [(262_144, "8,4,2"), (32_000, "8")])
def test_state_stays_within_its_documented_bound(vocab, template):
    drafter = create_drafter("recycling", None, template=template)
    session = session_for(drafter, [1])
    generator = torch.Generator().manual_seed(0)
    logits = torch.rand(17, vocab, generator=generator)  # which rows get written is all that matters
    seen = set()
    for _ in range(60):
        heads = torch.randint(vocab, (16,), generator=generator).tolist()
        seen.update(heads)
        session.observe([heads[-1]], StepFeedback(Draft(heads, parents=[-1] * 16), (), logits))
    k = 8
    assert drafter.state_bytes <= 4 * vocab * (k + 1)  # the documented worst case
    assert drafter.state_bytes <= 4 * vocab + 2 * 4 * k * (len(seen) + 1)  # rows only for tokens seen
    if vocab == 32_000:
        assert drafter.state_bytes < 2 << 20  # the paper's configuration stays under 2 MB


def test_template_trees_are_cut_where_the_targets_cost_steps_up(tiny_target):
    """Recycled top-k lists carry no probabilities: each node starts at its rank's chance and is kept only
    while it pays for its width (here a cost that doubles at 5 inputs, as int4's blocks of 4 rows do)."""
    from specdecode.drafters._tree_size import TreeBudget
    from specdecode.models.cost import VerificationCosts

    drafter = create_drafter("recycling", tiny_target)
    drafter.trees.budget = TreeBudget(
        None, "auto", draft_share=0.0, costs=VerificationCosts.of((1.0, 1.05, 1.19, 1.3, 2.2, 2.2, 2.3, 2.4))
    )
    session = session_for(drafter, [7, 8])
    logits = torch.randn(1, 96, generator=torch.Generator().manual_seed(1))
    session.observe([7, 8], StepFeedback(draft=Draft(tokens=[]), path=(), target_logits=logits))
    whole = drafter.shape  # the target's top 4 after 8 fill the template's first level
    proposal = session.propose([7, 8], max_tokens=8)
    assert 1 <= len(proposal.tokens) <= 3 < len([node for node in whole if node[0] == -1])
    assert proposal.tokens[0] == torch.topk(logits[0], 1).indices.item()  # the best candidate survives
