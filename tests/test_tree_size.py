"""Tree sizing for trained heads: calibration learned from verified trees, and a budget that verifies
only the nodes that pay for their share of the forward (none when no node does)."""

from __future__ import annotations

import pytest

from specdecode.drafters._tree_size import Calibration, TreeBudget, check_tree_nodes, subtree
from specdecode.errors import SpecDecodeError
from specdecode.models.cost import VerificationCosts
from specdecode.types import Draft

CURVE = (1.0, 1.05, 1.1, 1.15, 1.2, 1.25, 1.3, 1.35)


def test_an_unobserved_calibration_takes_the_confidence_at_its_word():
    calibration = Calibration()
    assert calibration(0.37, 1) == pytest.approx(0.37)
    assert calibration(0.99, 5) == pytest.approx(0.99)


def test_calibration_learns_per_depth_from_the_tried_nodes_only():
    calibration = Calibration()
    # Root children 0 and 1 (confidence 0.9 each), node 2 a child of 1, node 3 a child of 0.  The target
    # accepted node 0 and then rejected node 3; nodes 1 and 2: node 1 was tried (rejected), 2 never was.
    draft = Draft(tokens=[5, 6, 7, 8], parents=[-1, -1, 1, 0], confidence=[0.9, 0.9, 0.9, 0.9])
    for _ in range(50):
        calibration.learn(draft, (0,))
    assert calibration(0.9, 1) == pytest.approx((50 + 4 * 0.9) / (100 + 4))  # one of two depth-1 nodes accepted
    assert calibration(0.9, 2) < 0.1  # node 3 was always rejected; node 2 (untried) taught nothing


def test_auto_budget_verifies_what_pays_and_nothing_when_nothing_does():
    budget = TreeBudget(None, "auto", draft_share=0.05, costs=VerificationCosts.of(CURVE))
    assert budget.size([0.9, 0.8, 0.6, 0.3, 0.01, 0.01]) == 4
    assert budget.size([0.02, 0.01]) == 0
    assert budget.size([]) == 0
    assert TreeBudget(None, 3, 0.05, VerificationCosts.of(CURVE)).size([0.02, 0.01, 0.01, 0.01]) == 3


@pytest.mark.parametrize("bad", [-1, "many", 2.5, True])
def test_tree_nodes_must_be_auto_or_a_count(bad):
    with pytest.raises(SpecDecodeError, match="tree-nodes"):
        check_tree_nodes("medusa", bad)


INT4_STAIRCASE = (1.0, 1.05, 1.19, 1.3, 2.2, 2.2, 2.2, 2.3, 3.3, 3.4, 3.4, 3.6, 4.5, 4.4, 4.5, 4.6, 4.6)


def _wide_tree() -> Draft:
    """A suffix-style tree: eight alternatives after the context, each with one child, counts-based
    chances of 0.4 for the first and 0.1 or so for the rest."""
    parents = [-1] * 8 + list(range(8))
    chances = [0.4, *[0.1] * 7, *[1.0] * 8]
    return Draft(tokens=list(range(100, 116)), parents=parents, confidence=chances)


def test_model_free_trees_are_cut_where_the_targets_cost_steps_up():
    from specdecode.drafters._ngram_tree import PayingTrees

    trees = PayingTrees(None)
    trees.budget = TreeBudget(None, "auto", draft_share=0.0, costs=VerificationCosts.of(INT4_STAIRCASE))
    kept = trees.choose(_wide_tree())
    assert 1 <= len(kept.tokens) <= 3  # widths past 4 cost twice as much
    flat = PayingTrees(None)  # no target: every width costs one forward, the whole tree pays
    assert len(flat.choose(_wide_tree()).tokens) == 16


def test_model_free_chains_pass_whole_and_without_chances():
    from specdecode.drafters._ngram_tree import PayingTrees

    trees = PayingTrees(None)
    trees.budget = TreeBudget(None, "auto", draft_share=0.0, costs=VerificationCosts.of(INT4_STAIRCASE))
    chain = Draft(tokens=[1, 2, 3, 4, 5, 6], parents=[-1, 0, 1, 2, 3, 4], confidence=[0.1] * 6)
    assert trees.choose(chain) == Draft(tokens=[1, 2, 3, 4, 5, 6])  # its depth is the policy's call
    unrated = Draft(tokens=[1, 2], parents=[-1, -1])  # a tree without chances is left as it is
    assert trees.choose(unrated) is unrated


def test_model_free_trees_shrink_once_verification_rejects_their_confident_nodes():
    from specdecode.drafters._ngram_tree import PayingTrees
    from specdecode.types import StepFeedback

    trees = PayingTrees(None)
    trees.budget = TreeBudget(None, "auto", draft_share=0.0, costs=VerificationCosts.of(INT4_STAIRCASE))
    siblings = Draft(tokens=[7, 8, 9], parents=[-1, -1, -1], confidence=[0.9, 0.9, 0.9])
    assert len(trees.choose(siblings).tokens) == 3
    for _ in range(20):  # the target took none of them
        trees.learn(StepFeedback(draft=siblings, path=(), target_logits=None))
    assert len(trees.choose(siblings).tokens) < 3


def test_only_nodes_the_budget_would_verify_are_grown():
    """Children are never likelier than their parent: growing a node the budget leaves out is wasted."""
    budget = TreeBudget(None, "auto", draft_share=0.05, costs=VerificationCosts.of(CURVE))
    scores = [0.9, 0.8, 0.6, 0.3, 0.01, 0.01]  # the budget verifies the first four
    assert budget.worth_expanding(scores, [1, 2, 3, 4, 5], top_k=2) == [1, 2]
    assert budget.worth_expanding(scores, [4, 5], top_k=2) == []
    assert budget.worth_expanding([0.02, 0.01], [0, 1], top_k=4) == []  # nothing pays


def test_the_best_subtree_keeps_parents_before_children_and_drops_what_does_not_pay():
    budget = TreeBudget(None, 3, draft_share=0.05, costs=VerificationCosts.of(CURVE))
    # Node 2 (child of 0) outscores node 1 (a sibling of 0); node 3 (child of 2) misses the three best.
    parents = [-1, -1, 0, 2]
    order = budget.best_nodes(parents, scores=[0.9, 0.3, 0.5, 0.2])
    assert order == [0, 1, 2]
    draft = subtree(order, tokens=[10, 11, 12, 13], parents=parents, confidence=[0.9, 0.3, 0.55, 0.4])
    assert draft.tokens == [10, 11, 12] and draft.parent_list == [-1, -1, 0]
    assert draft.confidence == [0.9, 0.3, 0.55]


def test_a_tree_after_a_long_context_is_sized_with_that_contexts_curve():
    """Attention makes each extra node dearer after a long context: the same probabilities verify fewer nodes there
    (and as many as a short context's where the budget has one curve for every context, the control)."""
    costs = VerificationCosts(
        {128: tuple(1.0 + 0.01 * w for w in range(16)), 8192: tuple(1.0 + 0.2 * w for w in range(16))}
    )
    budget = TreeBudget(None, "auto", draft_share=0.05, costs=costs)
    probabilities = [0.6, 0.4, 0.3, 0.2, 0.15, 0.1, 0.05]
    assert budget.size(probabilities, 8192) < budget.size(probabilities, 128)
    flat = TreeBudget(None, "auto", draft_share=0.05, costs=VerificationCosts.of(costs.base))
    assert flat.size(probabilities, 8192) == budget.size(probabilities, 128)
