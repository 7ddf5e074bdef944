"""Prompt lookup grafted onto a head's tree: merged where it agrees, a new branch where it does not, scored and
learned by a calibration of its own; and through the EAGLE, Medusa and Hydra drafters, output unchanged, a sure
copy drafted alone and an unsure one as a branch."""

from __future__ import annotations

import pytest
import torch

from helpers import PROMPTS, hf_greedy, random_eagle_head, random_heads, run
from specdecode.drafters import create_drafter
from specdecode.drafters._lookup_graft import NodeSources, graft_lookup
from specdecode.drafters._tree_size import Calibration
from specdecode.drafters.base import DraftRequest
from specdecode.drafters.eagle import _Node
from specdecode.drafters.pld import prompt_lookup
from specdecode.errors import SpecDecodeError
from specdecode.types import Draft, StepFeedback

KINDS = ("eagle", "medusa", "hydra")


def test_the_lookup_joins_the_nodes_it_agrees_with_and_branches_where_it_does_not():
    # Context ... 7 8 9 ... 7 8: lookup continues 9 1 2 (a 2-gram match).
    context = [7, 8, 9, 1, 2, 5, 7, 8]
    continuation, confidence = prompt_lookup(context, 3)
    assert continuation == [9, 1, 2]
    # The head's tree: 9 (0.5) and 4 (0.2) at the root, 3 (0.2) under 9.
    tokens, parents, scores = [9, 4, 3], [-1, -1, 0], [0.5, 0.2, 0.2]
    calibration = Calibration()
    grafted = graft_lookup(continuation, confidence, tokens, parents, scores, calibration)
    assert tokens == [9, 4, 3, 1, 2] and parents == [-1, -1, 0, 0, 3]
    assert grafted == {0: confidence, 3: confidence, 4: confidence}
    assert scores[0] == 0.5  # the head's estimate was the better one
    assert scores[3] == pytest.approx(0.5 * confidence) and scores[4] == pytest.approx(0.5 * confidence**2)


def test_a_confident_lookup_raises_the_node_it_shares_and_no_match_adds_nothing():
    context = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3, 4, 5, 6, 7, 8]  # an 8-token match: confidence 0.95
    tokens, parents, scores = [9], [-1], [0.1]
    grafted = graft_lookup(*prompt_lookup(context, 1), tokens, parents, scores, Calibration())
    assert tokens == [9] and scores == [pytest.approx(0.95)] and grafted == {0: 0.95}
    assert prompt_lookup([1, 2, 3], 4) == ([], 0.0)
    assert graft_lookup([], 0.0, tokens, parents, scores, Calibration()) == {} and tokens == [9]


def test_each_source_learns_from_its_own_nodes_only():
    # Nodes: 0 the head's alone, 1 both sources', 2 the lookup's alone (a child of 1). Verification accepted 1 and 2.
    sources, confidence = NodeSources.of_tree([0, 1, 2], [0.6, 0.3, None], {1: 0.55, 2: 0.55})
    assert confidence == [0.6, 0.3, 0.55]
    draft = Draft(tokens=[4, 5, 6], parents=[-1, -1, 1], confidence=confidence)
    head, lookup = Calibration(), Calibration()
    for _ in range(40):
        sources.learn(StepFeedback(draft, (1, 2), torch.empty(0)), head, lookup)
    assert head(0.6, 1) < 0.1 and head(0.3, 1) > 0.9  # node 0 always rejected, node 1 accepted
    assert head(0.55, 2) == pytest.approx(0.55)  # node 2 was not the head's: nothing learned at depth 2
    assert lookup(0.55, 1) > 0.9 and lookup(0.55, 2) > 0.9  # the lookup's nodes 1 and 2, both accepted


def untrained(kind: str, target):
    """The options of a ``kind`` drafter with untrained head(s)."""
    if kind == "eagle":
        return {"head": random_eagle_head(target.backend, 40)}
    return {"heads": random_heads(target.backend, kind, 40)}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("lookup", [True, False])
def test_tree_drafters_with_and_without_lookup_are_plain_greedy(tiny_target, kind, lookup):
    drafter = create_drafter(kind, tiny_target, lookup=lookup, **untrained(kind, tiny_target))
    for prompt in [*PROMPTS, [*PROMPTS[0], *PROMPTS[0]]]:
        tokens, _ = run(tiny_target, drafter, prompt, max_new_tokens=40, num_draft_tokens="auto")
        assert tokens == hf_greedy(tiny_target, prompt, 40)


@pytest.mark.parametrize("kind", KINDS)
def test_the_lookup_option_takes_a_flag(tiny_target, kind):
    with pytest.raises(SpecDecodeError, match=f"{kind}: lookup"):
        create_drafter(kind, tiny_target, lookup="maybe", **untrained(kind, tiny_target))


def test_a_token_both_sources_drafted_becomes_one_node_the_head_can_grow(tiny_target):
    drafter = create_drafter("eagle", tiny_target, head=random_eagle_head(tiny_target.backend, 40), top_k=3)
    session = drafter.session(DraftRequest(prompt_ids=tuple(PROMPTS[0])))
    hidden = torch.randn(1, drafter.head.config.hidden_size, generator=torch.Generator().manual_seed(0))
    head_top = int(drafter.target_ids[session._distribution(hidden).argmax(-1)])
    nodes = [_Node(head_top, -1, 0.9)]  # the lookup's node, drafted before the head's
    added = session._children(hidden, [-1], nodes, depth=1)
    assert len(nodes) == 3 and sorted(added) == [0, 1, 2]
    assert len({node.token for node in nodes}) == 3
    shared = nodes[0]
    assert shared.score == 0.9 and shared.confidence is not None and shared.source is not None


def recorded_drafts(drafter, monkeypatch) -> list:
    """Every draft ``drafter``'s sessions will propose, in order."""
    drafts = []
    session_class = type(drafter.session(DraftRequest(prompt_ids=(1,))))
    propose = session_class.propose

    def recording(self, context, max_tokens):
        drafts.append(propose(self, context, max_tokens))
        return drafts[-1]

    monkeypatch.setattr(session_class, "propose", recording)
    return drafts


@pytest.mark.parametrize("kind", KINDS)
def test_a_confident_lookup_is_drafted_alone_and_the_head_catches_up_later(tiny_target, monkeypatch, kind):
    drafter = create_drafter(kind, tiny_target, tree_nodes=10, **untrained(kind, tiny_target))
    drafts = recorded_drafts(drafter, monkeypatch)
    prompt = [*range(3, 23), *range(3, 13)]  # the last 10 tokens occurred before: a long match
    tokens, _ = run(tiny_target, drafter, prompt, max_new_tokens=30, num_draft_tokens=4)
    assert tokens == hf_greedy(tiny_target, prompt, 30)
    assert drafts[0].is_chain and drafts[0].tokens == [13, 14, 15, 16]  # the copy alone
    assert any(not draft.is_chain for draft in drafts)  # the head drafted again once the copy ran out


@pytest.mark.parametrize("kind", KINDS)
def test_an_unsure_lookup_is_a_branch_of_the_heads_tree(tiny_target, monkeypatch, kind):
    drafter = create_drafter(kind, tiny_target, tree_nodes=10, **untrained(kind, tiny_target))
    drafts = recorded_drafts(drafter, monkeypatch)
    prompt = [5, 6, 7, 8, 9, 5]  # a one-token match: lookup drafts 6 7 8 9, sure of none
    tokens, _ = run(tiny_target, drafter, prompt, max_new_tokens=8, num_draft_tokens=4)
    assert tokens == hf_greedy(tiny_target, prompt, 8)
    first = drafts[0]
    assert not first.is_chain
    paths: list[tuple[int, ...]] = []
    for token, parent in zip(first.tokens, first.parent_list):
        paths.append((paths[parent] if parent >= 0 else ()) + (token,))
    assert (6,) in paths  # the lookup's branch (its deeper nodes score 0.15 ** depth), beside the head's guesses
    assert any(path[0] != 6 for path in paths)
