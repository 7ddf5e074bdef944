"""Draft-length policies: pure-function behaviour of the schedule, the cost model and its stop rule."""

from __future__ import annotations

import pytest

from specdecode.batch_plan import plan_batch
from specdecode.config import AUTO, HEURISTIC, MAX_FIXED_DRAFT_LENGTH, Fixed, GenerationConfig, parse_draft_length
from specdecode.draft_length.base import DepthOffer, DraftLengthPolicy, FixedLength, HeuristicLength
from specdecode.draft_length.cost_model import CostModel
from specdecode.draft_length.factory import DrafterCosts, make_policy
from specdecode.draft_length.sequence import CostModelLength
from specdecode.draft_length.tuning import LOSS_ALLOWANCE_STEPS, LOSS_BUDGET
from specdecode.errors import SpecDecodeError
from specdecode.estimators import LinearFit, ShareWithPrior
from specdecode.generator import SpeculativeGenerator
from specdecode.models.cost import VerificationCosts, linear_curve
from specdecode.types import StepObservation


def curve(per_input: float, widths: int = 16) -> tuple[float, ...]:
    """Relative cost t(w) / t(1) of a forward that grows by ``per_input`` of t(1) per extra input."""
    return tuple(1.0 + per_input * (w - 1) for w in range(1, widths + 1))


def linear_costs(per_input: float) -> VerificationCosts:
    """:func:`curve` as the verification costs of every context."""
    return VerificationCosts.of(curve(per_input))


def feed(
    policy,
    steps: int,
    *,
    accept_rate: float,
    depth: int = 8,
    draft_s: float = 0.0,
    one_input_s: float = 0.1,
    overhead_s: float = 0.0,
) -> None:
    """Deterministic observations: verification costs ``one_input_s`` times the policy's curve, and each
    draft position is accepted in about ``accept_rate`` of steps."""
    for step in range(steps):
        accepted = 0
        while accepted < depth and ((step * 7 + accepted * 13) % 100) / 100 < accept_rate:
            accepted += 1
        policy.observe(
            StepObservation(
                depth=depth,
                nodes=depth,
                accepted=accepted,
                draft_s=draft_s,
                verify_s=one_input_s * policy.relative_cost(depth + 1),
                overhead_s=overhead_s,
            )
        )


def test_fixed_and_limit():
    assert FixedLength(5).next_length(3) == 3
    assert FixedLength(5).next_length(10) == 5


def test_heuristic_schedule_like_transformers():
    policy = HeuristicLength(k=5)
    policy.observe(StepObservation(depth=5, nodes=5, accepted=5, draft_s=0, verify_s=0))
    assert policy.k == 7
    policy.observe(StepObservation(depth=7, nodes=7, accepted=2, draft_s=0, verify_s=0))
    assert policy.k == 6
    policy.observe(StepObservation(depth=0, nodes=0, accepted=0, draft_s=0, verify_s=0))
    assert policy.k == 6


def test_cost_model_drafts_deep_when_verification_is_cheap_and_acceptance_high():
    policy = CostModel(curve=linear_costs(0.01)).fork()
    feed(policy, 60, accept_rate=0.9)
    assert policy.next_length(12) >= 8


def test_cost_model_drafts_shallow_when_wide_forwards_are_expensive():
    cheap, steep = CostModel(curve=linear_costs(0.02)).fork(), CostModel(curve=linear_costs(0.5)).fork()
    feed(cheap, 60, accept_rate=0.7)
    feed(steep, 60, accept_rate=0.7)
    assert steep.next_length(12) < cheap.next_length(12)


def test_expected_rate_is_tokens_over_seconds():
    policy = CostModel(curve=VerificationCosts.of((1.0, 1.5, 2.0)), prior_acceptance=0.5).fork()
    # Before any timing, seconds are in units of a one-input forward: (1 + 0.5 + 0.25) / 2.0.
    assert policy.expected_rate(2) == pytest.approx(1.75 / 2.0)
    assert policy.relative_cost(5) == pytest.approx(3.0)  # extrapolated along the curve's slope


def test_contention_rescales_the_measured_curve_instead_of_distorting_its_shape():
    policy = CostModel(curve=linear_costs(0.05)).fork()
    for _ in range(30):  # only width 1 is ever seen, at twice the quiet speed
        policy.observe(StepObservation(depth=0, nodes=0, accepted=0, draft_s=0, verify_s=0.2))
    assert policy.verify_seconds(1) == pytest.approx(0.2)
    assert policy.verify_seconds(9) == pytest.approx(0.2 * 1.4)


def test_cost_model_stops_drafting_useless_drafts_but_keeps_probing():
    # The probe schedule alone: the loss budget, which would stop even probes here, is tested on its own below.
    policy = CostModel(curve=linear_costs(0.3), probe_every=4, loss_budget=None).fork()
    feed(policy, 80, accept_rate=0.0, depth=2)
    lengths = [policy.next_length(12) for _ in range(8)]
    assert lengths.count(0) == 6 and lengths.count(1) == 2


def probe_once(
    policy: CostModelLength, *, accepted: int, draft_s: float = 0.0, verify_s: float = 0.13, plain_s: float = 0.1
) -> int:
    """Plain steps (``plain_s`` each) until the policy probes, then the probe's outcome; returns the steps it waited."""
    steps = 1
    while policy.next_length(12) == 0:
        policy.observe(StepObservation(depth=0, nodes=0, accepted=0, draft_s=0.0, verify_s=plain_s))
        steps += 1
    policy.observe(StepObservation(depth=1, nodes=1, accepted=accepted, draft_s=draft_s, verify_s=verify_s))
    return steps


def test_probes_back_off_while_they_fail_and_recover_when_one_is_accepted():
    policy = CostModel(curve=linear_costs(0.3), probe_every=4, max_probe_every=16, loss_budget=None).fork()
    feed(policy, 80, accept_rate=0.0, depth=2)

    def steps_to_next_probe(accepted: int) -> int:
        return probe_once(policy, accepted=accepted, verify_s=1.1, plain_s=1.0)

    assert [steps_to_next_probe(0) for _ in range(4)] == [4, 8, 16, 16]
    assert steps_to_next_probe(1) == 16 and policy.probe_interval == 4  # an accepted probe that paid: back to 4


def test_a_probe_accepted_but_dearer_than_the_token_it_won_backs_off_as_a_rejected_one():
    """A self-drafter's token can cost most of a target forward: its accepted probe yields two tokens for more
    than two plain steps' time, which says drafting still loses."""
    policy = CostModel(curve=linear_costs(0.3), probe_every=4, max_probe_every=16, loss_budget=None).fork()
    feed(policy, 80, accept_rate=0.0, depth=2)
    probe_once(policy, accepted=1, draft_s=0.9, verify_s=1.3, plain_s=1.0)
    assert policy.probe_interval == 8


def test_an_accepted_probe_that_leaves_drafting_a_loss_backs_off_as_a_rejected_one():
    """Half of a self-drafter's tokens accepted at half a target forward each: a probe that is accepted pays on
    its own (2 tokens for 1.8 plain steps), but drafting at that acceptance still loses, so probing slows down."""
    policy = CostModel(curve=linear_costs(0.3), probe_every=4, max_probe_every=16, loss_budget=None).fork()
    feed(policy, 80, accept_rate=0.5, depth=1, draft_s=0.05)
    probe_once(policy, accepted=1, draft_s=0.05)
    assert policy.probe_interval == 8 and policy.next_length(12) == 0


def test_a_new_sequence_starts_probing_at_the_interval_its_predecessors_left():
    parent = CostModel(curve=linear_costs(0.3), probe_every=4, max_probe_every=64, loss_budget=None)
    first = parent.fork()
    feed(first, 40, accept_rate=0.0, depth=2)
    assert [probe_once(first, accepted=0) for _ in range(4)] == [4, 8, 16, 32]
    assert parent.probe_interval == 64 and parent.fork().probe_interval == 16  # at most 4 x probe_every
    second = parent.fork()
    probe_once(second, accepted=1)  # an accepted probe of a free drafter: drafting pays again
    assert second.probe_interval == parent.probe_interval == parent.fork().probe_interval == 4


def test_concurrent_sequences_each_move_their_origins_probe_interval():
    """Two requests decoding at once both probe and fail: each failure backs the origin off (two doublings), rather
    than the last fork to probe setting the origin's interval to its own (one doubling)."""
    parent = CostModel(curve=linear_costs(0.3), probe_every=4, max_probe_every=64, loss_budget=None)
    first, second = parent.fork(), parent.fork()
    for fork in (first, second):
        feed(fork, 40, accept_rate=0.0, depth=2)
        probe_once(fork, accepted=0)
    assert first.probe_interval == second.probe_interval == 8 and parent.probe_interval == 16


def test_a_drafter_that_reads_the_context_drafts_shallow_until_its_cost_is_timed():
    policy = make_policy(AUTO, DrafterCosts(curve=[1.0, 1.02, 1.04, 1.06, 1.08, 1.1, 1.12, 1.14, 1.16])).fork()
    cheap = policy.next_length(16)
    assert cheap > 2  # a drafter not known to read the context: its drafts are taken as free
    policy.observe(StepObservation(depth=1, nodes=1, accepted=1, draft_s=0.5, setup_s=0.49, verify_s=0.1))
    assert policy.next_length(16) == 2 and policy.draft_cap(16) == 2  # its prompt prefill timed, no token yet
    assert policy.draft_cap(16, [0.9] * 6) == 6  # a draft already made: all of it may be weighed
    feed(policy, 1, accept_rate=0.95, depth=2, draft_s=0.002)
    assert policy.next_length(16) > 2


def test_a_drafter_declared_to_read_the_context_drafts_shallow_from_its_first_step(tiny_target, tiny_draft):
    """The prompt's prefill and the first draft tokens come in one propose: before anything is timed, a
    draft model would be taken as free and asked for a deep first draft, most of which the target rejects."""
    shape = [1.0, 1.02, 1.04, 1.06, 1.08, 1.1, 1.12, 1.14, 1.16]
    assert make_policy(AUTO, DrafterCosts(curve=shape, reads_context=True)).fork().next_length(16) == 2
    assert make_policy(AUTO, DrafterCosts(curve=shape)).fork().next_length(16) > 2
    generator = SpeculativeGenerator.build(tiny_target, "draft-model", draft_model=tiny_draft)
    assert generator.draft_length_policy("auto").fork().deepest == 2
    assert SpeculativeGenerator.build(tiny_target, "pld").draft_length_policy("auto").fork().deepest == 16


def test_a_self_drafters_declared_token_cost_prices_its_drafts_until_they_are_timed():
    """Until its drafts are timed, a self-drafter's declared token cost prices them: taken as free, a layer-skip draft
    (0.6 of a target forward a token) would be made at step 0 of every cold request where a two-input verification
    costs 1.21 of one."""
    shape = curve(0.21)
    assert make_policy(AUTO, DrafterCosts(curve=shape)).fork().next_length(16) > 0  # free: 1.5 tokens for 1.21
    dear = make_policy(AUTO, DrafterCosts(curve=shape, draft_token_share=0.6)).fork()
    assert dear.step_seconds(2) == pytest.approx(1.42 + 2 * 0.6)
    assert dear.next_length(16) == 0  # 1.5 tokens for 1.81 forwards
    cheap = make_policy(AUTO, DrafterCosts(curve=shape, draft_token_share=0.02)).fork()
    assert cheap.next_length(16) > 0  # a cheap one still drafts
    dear.observe(StepObservation(depth=1, nodes=1, accepted=1, draft_s=0.001, verify_s=0.121))
    assert dear.step_seconds(1) == pytest.approx(dear.draft_cost(1) + dear.verify_seconds(2))  # timed: the fit


def test_cost_model_counts_a_slow_drafter():
    free, slow = CostModel(curve=linear_costs(0.1)).fork(), CostModel(curve=linear_costs(0.1)).fork()
    feed(free, 60, accept_rate=0.7, draft_s=0.0)
    feed(slow, 60, accept_rate=0.7, draft_s=8 * 0.08)
    assert slow.next_length(12) < free.next_length(12)


def test_overhead_per_step_favours_deeper_drafts():
    """A fixed cost per step (observe, bookkeeping) is paid whatever k, so it makes each step's tokens worth more."""
    lean, heavy = CostModel(curve=linear_costs(0.3)).fork(), CostModel(curve=linear_costs(0.3)).fork()
    feed(lean, 60, accept_rate=0.6, overhead_s=0.0)
    feed(heavy, 60, accept_rate=0.6, overhead_s=0.5)
    assert heavy.next_length(12) > lean.next_length(12)


def test_draft_cost_separates_a_fixed_part_from_a_part_per_token():
    fit = LinearFit()
    for depth in (1, 4, 8, 2, 6) * 4:
        fit.add(depth, 0.002 + 0.01 * depth)
    fixed, per_token = fit.coefficients()
    assert fixed == pytest.approx(0.002) and per_token == pytest.approx(0.01)
    constant = LinearFit()
    for _ in range(5):
        constant.add(4, 0.02)  # depth never varied: all of it counts per token (the cautious reading)
    assert constant.coefficients() == pytest.approx((0.0, 0.005))


def test_a_share_with_a_prior_moves_with_the_evidence_and_forgets_with_the_discount():
    share = ShareWithPrior()
    assert share.estimate(0.3, weight=4) == pytest.approx(0.3)  # no evidence: the prior
    share.add(8, 8)
    assert share.estimate(0.3, weight=4) == pytest.approx((8 + 1.2) / 12)
    share.add(0, 10, discount=0.0)  # the old evidence forgotten
    assert (share.successes, share.trials) == (0.0, 10.0)


def test_linear_curve_is_the_guess_before_measuring():
    assert linear_curve(1.7)[7] == pytest.approx(1.7)
    assert make_policy(AUTO).curve.base == pytest.approx(linear_curve(1.3))
    assert make_policy(AUTO, DrafterCosts(curve=[2.0, 3.0])).curve.base == (1.0, 1.5)  # normalised to one input


# -- the SpecDec++-style stop rule ----------------------------------------------------------------


def confident_policy(rate: float = 2.0) -> CostModelLength:
    """Forward of w inputs costs 1 + 0.05 (w - 1) seconds; tokens per second achieved so far = ``rate``."""
    policy = CostModel(curve=linear_costs(0.05)).fork()
    policy.observe(StepObservation(depth=0, nodes=0, accepted=rate - 1.0, draft_s=0.0, verify_s=1.0))
    assert policy.achieved_rate() == pytest.approx(rate)
    return policy


def test_keep_length_stops_where_predicted_survival_no_longer_pays_for_the_width():
    policy = confident_policy(rate=2.0)  # a token is worth verifying while P(prefix accepted) >= 2 * 0.05
    # Bins are taken at their centres before evidence: 0.95 -> 0.95, 0.35 -> 0.35, 0.15 -> 0.15.
    assert policy.keep_length([0.95, 0.95, 0.35, 0.35]) == 4  # survival .95, .90, .32, .11: all >= .1
    assert policy.keep_length([0.95, 0.35, 0.35, 0.35]) == 3  # .95, .33, .12, .04
    assert policy.keep_length([0.05]) == 0
    assert policy.keep_length([]) == 0


def test_should_stop_also_charges_the_draft_cost_of_the_next_token():
    policy = confident_policy(rate=2.0)
    assert not policy.should_stop([0.95, 0.35])  # survival .33 > 2 * (0.05 + 0)
    for depth in (1, 3, 5, 2):  # a drafter costing 0.2 s per token
        policy.draft_cost.add(depth, 0.2 * depth)
    assert policy.should_stop([0.95, 0.35])  # .33 < 2 * (0.05 + 0.2)
    assert not policy.should_stop([])


def test_confidences_are_calibrated_online():
    policy = confident_policy(rate=2.0)
    before = policy.calibration(0.95)
    for _ in range(20):  # the drafter says 0.95, but its first token is always rejected
        policy.observe(
            StepObservation(depth=3, nodes=3, accepted=0, draft_s=0.0, verify_s=1.1, confidence=(0.95, 0.95, 0.95))
        )
    assert policy.calibration(0.95) < 0.2 < before
    assert policy.keep_length([0.95, 0.95]) < 2
    assert policy.uses_confidence and policy.next_length(7) == 0  # and the first token never pays either
    for _ in range(40):  # once its drafts are accepted again, how deep is the stop rule's call
        policy.observe(
            StepObservation(depth=3, nodes=3, accepted=3, draft_s=0.0, verify_s=1.1, confidence=(0.95, 0.95, 0.95))
        )
    assert policy.next_length(7) == 7


def test_fixed_and_heuristic_never_stop_a_drafter():
    for policy in (FixedLength(4), HeuristicLength()):
        assert not policy.should_stop([0.01])
        assert policy.keep_length([0.01, 0.01]) == 2


@pytest.mark.parametrize("bad", [-1, "fast", 2.5, None])
def test_bad_specs_are_refused(bad):
    with pytest.raises(SpecDecodeError, match="num-draft-tokens"):
        parse_draft_length(bad)


@pytest.mark.parametrize(
    ("given", "length"),
    [
        (0, Fixed(0)),
        (MAX_FIXED_DRAFT_LENGTH, Fixed(64)),
        ("auto", AUTO),
        ("heuristic", HEURISTIC),
        (Fixed(3), Fixed(3)),
    ],
)
def test_a_draft_length_is_parsed_once_and_written_back_as_it_was_given(given, length):
    assert parse_draft_length(given) == length
    assert parse_draft_length(length.to_json()) == length and str(length) == str(length.to_json())
    assert GenerationConfig(num_draft_tokens=given).num_draft_tokens == length


@pytest.mark.parametrize("bad", [MAX_FIXED_DRAFT_LENGTH + 1, True, "4", "Auto", 4.0])
def test_one_rule_refuses_what_is_not_a_draft_length(bad):
    """Text of a number is not a number here (the CLI reads its flag as a typed value first), nor is a bool."""
    with pytest.raises(SpecDecodeError, match=r"^num-draft-tokens must be an integer from 0 to 64, 'auto' or 'heu"):
        parse_draft_length(bad)
    with pytest.raises(SpecDecodeError):
        Fixed(bad)


def test_every_edge_refuses_a_draft_length_with_the_same_line(capsys, tiny_dirs):
    from pydantic import ValidationError

    from specdecode.cli import main
    from specdecode.server.protocol import SpeculativeOptions

    message = "num-draft-tokens must be an integer from 0 to 64, 'auto' or 'heuristic', got 65"
    with pytest.raises(SpecDecodeError) as python:
        GenerationConfig(num_draft_tokens=65)
    assert str(python.value) == message
    with pytest.raises(ValidationError) as http:
        SpeculativeOptions.model_validate({"num_draft_tokens": 65})
    assert http.value.errors()[0]["msg"] == message
    assert SpeculativeOptions.model_validate({"num_draft_tokens": "auto"}).num_draft_tokens == AUTO
    assert main(["generate", "w1", "--model", str(tiny_dirs["target"]), "--num-draft-tokens", "65"]) == 2
    assert capsys.readouterr().err.strip() == f"specdecode: error: {message}"


def test_acceptance_is_learned_separately_inside_and_outside_runs_of_accepted_drafts():
    """Copied text comes in runs: after a fully accepted draft draft deep, after a miss draft shallow."""
    policy = CostModel(curve=linear_costs(0.3)).fork()
    for step in range(80):
        full = (step // 5) % 2 == 0  # five fully accepted drafts, then five rejected at the first token
        policy.observe(
            StepObservation(
                depth=8, nodes=8, accepted=8 if full else 0, draft_s=0.0, verify_s=0.1 * policy.relative_cost(9)
            )
        )
    policy.in_run = True
    deep = policy.next_length(16)
    policy.in_run = False
    assert policy.next_length(16) <= 1
    assert deep >= 8


def test_an_empty_draft_is_neither_a_rejection_nor_the_end_of_a_run():
    policy = CostModel(curve=linear_costs(0.05)).fork()
    policy.observe(StepObservation(depth=4, nodes=4, accepted=4, draft_s=0.0, verify_s=0.1))
    before = [m.value for m in policy.acceptance]
    policy.observe(StepObservation(depth=0, nodes=0, accepted=0, draft_s=0.0, verify_s=0.1))
    assert policy.in_run and [m.value for m in policy.acceptance] == before


def test_a_drafter_catching_up_with_the_context_is_no_per_token_cost():
    """A draft model's first propose prefills the prompt: that time is reported as ``setup_s`` and kept out
    of the per-token draft cost, which would otherwise make drafting look dear for the requests after it."""
    policy = CostModel(curve=linear_costs(0.05)).fork()
    policy.observe(StepObservation(depth=4, nodes=4, accepted=4, draft_s=1.04, verify_s=0.1, setup_s=1.0))
    for _ in range(5):
        policy.observe(StepObservation(depth=4, nodes=4, accepted=4, draft_s=0.04, verify_s=0.1))
    assert policy.draft_cost(4) == pytest.approx(0.04)


def test_catching_up_after_the_prompt_is_a_cost_of_drafting():
    """The first draft's reading of the prompt is weighed ex ante (``reading_pays``); what the drafter spends
    catching up later (tokens skipped while drafting was off, context re-tokenised across vocabularies) is
    what drafting costs: two tokens a step for 0.22 s against 0.1 s plain steps is a loss."""
    policy = CostModel(curve=linear_costs(0.05), loss_budget=None).fork()
    policy.observe(plain_step(0.1))
    policy.observe(StepObservation(depth=2, nodes=2, accepted=1, draft_s=1.04, setup_s=1.0, verify_s=0.12))
    assert policy.gain.value > 1.0  # the prompt's reading is not held against the first draft
    for _ in range(12):
        policy.observe(plain_step(0.1))
        policy.observe(StepObservation(depth=2, nodes=2, accepted=1, draft_s=0.1, setup_s=0.06, verify_s=0.12))
    assert policy.gain.value == pytest.approx(0.2 / 0.22, rel=0.05) and policy.losing
    assert policy.draft_cost(2) == pytest.approx(0.04, rel=0.05)  # still no per-token cost


def test_draft_model_reports_its_prompt_prefill_as_setup(tiny_target, tiny_draft):
    from specdecode.drafters import create_drafter
    from specdecode.drafters.base import DraftRequest

    prompt = [5, 6, 7, 8] * 20
    drafter = create_drafter("draft-model", tiny_target, draft_model=tiny_draft)
    session = drafter.session(DraftRequest(prompt_ids=tuple(prompt)))
    first = session.propose(prompt, 3)
    assert first.setup_s > 0  # 80 prompt tokens fed before the first draft token
    following = session.propose([*prompt, *first.tokens[:2]], 3)
    assert drafter.clock.one_token_s > 0 and following.setup_s < first.setup_s


def tree_step(policy, accepted: int, nodes: int = 30, one_input_s: float = 0.1) -> StepObservation:
    """A two-deep tree of ``nodes`` nodes: the cost model reasons in depth, the forward pays for every node."""
    return StepObservation(
        depth=2, nodes=nodes, accepted=accepted, draft_s=0.0, verify_s=one_input_s * policy.relative_cost(nodes + 1)
    )


def test_drafting_that_measurably_loses_to_plain_steps_is_turned_off_and_probed():
    policy = CostModel(curve=linear_costs(0.1), probe_every=4, loss_budget=None).fork()
    for _ in range(12):  # 1.5 tokens per step for a forward four times a plain one's
        policy.observe(tree_step(policy, accepted=1 if policy.gain.weight % 2 else 0))
    assert policy.losing
    lengths = [policy.next_length(8) for _ in range(4)]
    assert lengths == [0, 0, 0, 1]  # nothing, then a probe of depth 1
    # A probe that pays (two tokens for a forward over two inputs) brings drafting back.
    policy.observe(StepObservation(depth=1, nodes=1, accepted=1, draft_s=0.0, verify_s=0.1 * policy.relative_cost(2)))
    assert not policy.losing and policy.next_length(8) > 0


def test_drafting_that_pays_is_never_turned_off():
    policy = CostModel(curve=linear_costs(0.05)).fork()
    feed(policy, 60, accept_rate=0.6, depth=4)
    assert not policy.losing and policy.gain.value > 1.2
    assert policy.net_saved_s > 0 and not policy.over_budget


def test_drafting_is_judged_against_timed_plain_steps_not_the_curve():
    """Trees of 8 nodes that the curve prices at 1.35 plain forwards but that take 2.5 (row-by-row attention,
    a long context): two tokens a step is a loss, though scale times the curve, pulled up by those very steps,
    would call it a gain."""
    policy = CostModel(curve=linear_costs(0.05), loss_budget=None).fork()
    for _ in range(12):
        policy.observe(plain_step(0.1))
        policy.observe(StepObservation(depth=2, nodes=8, accepted=1, draft_s=0.0, verify_s=0.25))
    assert policy.verify_seconds(1) > 0.13  # the curve's estimate of a plain forward, inflated
    assert policy.plain_step_seconds() == pytest.approx(0.1)
    assert policy.gain.value == pytest.approx(0.8) and policy.losing


def decode(policy: CostModelLength, steps: int, *, draft_s: float, one_input_s: float = 0.1) -> list[int]:
    """Follow the policy's own choices for ``steps`` steps of a drafter whose tokens are all rejected and cost
    ``draft_s`` each; → the depth of every step."""
    depths = []
    for _ in range(steps):
        depth = policy.next_length(16)
        depths.append(depth)
        policy.observe(
            StepObservation(
                depth=depth,
                nodes=depth,
                accepted=0,
                draft_s=draft_s * depth,
                verify_s=one_input_s * policy.relative_cost(depth + 1),
            )
        )
    return depths


def test_a_sequence_whose_drafts_lose_stops_at_its_loss_budget_and_probes_as_its_time_grows():
    """A self-drafter at 0.6 of a target forward a token, all rejected: the first draft loses 0.09 s against a
    0.1 s plain step.  That spends the budget (half a step plus 1% of the 1 s prefill and the steps), so the
    probe schedule (every 4 steps) waits until the sequence's time pays for another try."""
    policy = CostModel(curve=linear_costs(0.3), probe_every=4, max_probe_every=4).fork()
    policy.begin(prefill_s=1.0)
    depths = decode(policy, 64, draft_s=0.06)
    assert depths[0] > 0
    tries = [i for i, depth in enumerate(depths) if depth]
    lost = -policy.net_saved_s
    assert lost <= LOSS_BUDGET * policy.elapsed_s + LOSS_ALLOWANCE_STEPS * 0.1 + 0.09  # at most one try over
    assert len(tries) < 64 // 4  # fewer than the probe schedule alone would have made
    assert all(b - a > 4 for a, b in zip(tries[1:], tries[2:]))  # spaced by the budget, not by probe_every
    unbudgeted = CostModel(curve=linear_costs(0.3), probe_every=4, max_probe_every=4, loss_budget=None).fork()
    unbudgeted.begin(prefill_s=1.0)
    decode(unbudgeted, 64, draft_s=0.06)
    assert -unbudgeted.net_saved_s > 2 * lost


def test_each_sequence_starts_with_its_own_loss_budget():
    parent = CostModel(curve=linear_costs(0.3), probe_every=4)
    first = parent.fork()
    first.begin(prefill_s=0.5)
    decode(first, 8, draft_s=0.06)
    assert -first.net_saved_s > 0
    second = parent.fork()
    assert second.net_saved_s == 0.0 and second.elapsed_s == 0.0 and not second.over_budget


def plain_step(one_input_s: float = 0.1) -> StepObservation:
    return StepObservation(depth=0, nodes=0, accepted=0, draft_s=0.0, verify_s=one_input_s)


def reader(context_cost: float, draft_token_s: float | None = None) -> CostModel:
    """``auto`` for a drafter that reads the context at ``context_cost`` of the target's forward (and whose draft
    token was timed at ``draft_token_s`` seconds)."""
    costs = DrafterCosts(curve(0.05), reads_context=True, context_cost=context_cost, draft_token_s=draft_token_s)
    return make_policy(AUTO, costs)


def test_a_reading_that_drafts_cannot_pay_back_leaves_the_sequence_plain():
    """A draft model as dear as 0.4 of the target reading a prompt the target took 2 s over: over 64 tokens of
    0.1 s its drafts (0.5 accepted a token before any evidence) save far less than its 0.8 s of reading."""
    policy = reader(0.4).fork()
    policy.begin(prefill_s=2.0)
    assert policy.next_length(63) == 0  # nothing timed yet: a plain step first
    policy.observe(plain_step())
    lengths = []
    for limit in range(62, 0, -1):  # no probes either: the prompt would still have to be read
        lengths.append(policy.next_length(limit))
        policy.observe(plain_step())
    assert set(lengths) == {0} and policy.declined


def test_a_reading_expected_to_gain_less_than_the_margin_is_declined():
    """Reading at 0.3 of the target (0.6 s over a 2 s prompt) and drafting 64 tokens is expected to be 0.6% faster
    than plain decoding: within the estimates' error (``DRAFT_MARGIN``), so declined; at 0.2, 12% faster: read."""
    close, clear = reader(0.3).fork(), reader(0.2).fork()
    for policy in (close, clear):
        policy.begin(prefill_s=2.0)
        policy.observe(plain_step())
    assert close.next_length(63) == 0 and close.declined
    assert clear.next_length(63) > 0 and not clear.declined


def test_a_batch_never_probes_a_sequence_that_declined_its_reading():
    shared = reader(0.4)
    shared.fork().observe(plain_step())  # an earlier request timed the target
    declined, other = shared.fork(), shared.fork()
    declined.begin(prefill_s=2.0)
    plans = [plan_batch([declined, other], [63 - i, 63 - i]) for i in range(40)]
    assert declined.declined and {plan[0] for plan in plans} == {0}
    assert {plan[1] for plan in plans} != {0}  # the other sequence, with no prompt read to pay for, drafts


def test_a_cheap_reader_or_a_long_answer_drafts():
    cheap = reader(0.05).fork()
    cheap.begin(prefill_s=2.0)
    cheap.observe(plain_step())
    assert cheap.next_length(63) > 0
    long_answer = reader(0.35).fork()
    long_answer.begin(prefill_s=0.8)
    long_answer.observe(plain_step())
    assert long_answer.next_length(63) == 0 and long_answer.declined  # 64 tokens: 2.4% faster, under the margin
    again = reader(0.35).fork()
    again.begin(prefill_s=0.8)
    again.observe(plain_step())
    assert again.next_length(1000) > 0  # 256 tokens (ANSWER_HORIZON): 5.9% faster, worth reading the prompt for


def test_what_reading_a_prompt_costs_is_learnt_from_first_drafts():
    shared = reader(0.4)
    first = shared.fork()
    first.begin(prefill_s=2.0)
    first.observe(StepObservation(depth=2, nodes=2, accepted=2, draft_s=0.25, setup_s=0.2, verify_s=0.1))
    assert shared.context_cost.value == pytest.approx(0.4 + (0.1 - 0.4) / 1.98)  # 0.2 s over 2 s, and the prior
    assert first.context_read and first.next_length(60) > 0  # read: the gate is passed
    second = shared.fork()
    assert not second.context_read and second.prefill_s == 0.0


def test_a_drafter_without_a_declared_cost_or_a_prompt_is_never_gated():
    unknown = reader(0.0).fork()  # 0: unknown
    unknown.begin(prefill_s=2.0)
    assert unknown.context_cost is None and unknown.next_length(63) == 2
    no_prompt = reader(0.4).fork()  # a one-token prompt: nothing prefilled, no reading to weigh
    assert no_prompt.next_length(63) == 1 and not no_prompt.declined  # its tokens priced at 0.4: one pays, two not


def test_a_draft_token_timed_cheaper_than_its_weight_count_makes_reading_pay():
    """A draft model 0.4 of the target by weight count but timed at 0.05 of its forward (a quantized draft beside a
    full-precision target): priced by the count, reading a 0.8 s prompt is declined; by the timing, it pays."""
    by_count, by_timing = reader(0.4).fork(), reader(0.4, draft_token_s=0.005).fork()
    for policy in (by_count, by_timing):
        policy.begin(prefill_s=0.8)
        policy.observe(plain_step())
    assert by_count.next_length(63) == 0 and by_count.declined
    assert by_timing.next_length(63) > 0 and not by_timing.declined


def test_the_draft_model_times_its_token_once_and_auto_prices_first_drafts_with_it(tiny_target, tiny_draft):
    generator = SpeculativeGenerator.build(tiny_target, "draft-model", draft_model=tiny_draft)
    drafter = generator.drafter
    seconds = drafter.draft_token_seconds()
    assert 0 < seconds < 1 and drafter.draft_token_seconds() == seconds  # timed once, then the clock's
    assert generator.draft_length_policy("auto").draft_token_s == seconds
    assert SpeculativeGenerator.build(tiny_target, "pld").drafter.draft_token_seconds() is None


def test_the_draft_model_times_its_reading_of_a_prompt_once_and_auto_prices_it_with_that(tiny_target, tiny_draft):
    """Weights multiplied misjudge a reading across kernels (a draft and a target quantized differently): the
    draft model times its prefill against the target's, once."""
    generator = SpeculativeGenerator.build(tiny_target, "draft-model", draft_model=tiny_draft)
    drafter = generator.drafter
    ratio = drafter.reading_cost()
    assert ratio > 0 and drafter.reading_cost() == ratio
    assert generator.draft_length_policy("auto").context_cost.value == pytest.approx(ratio)
    assert SpeculativeGenerator.build(tiny_target, "pld").drafter.reading_cost() is None


def test_a_draft_model_loaded_by_name_takes_the_command_lines_default_precision(tiny_target, monkeypatch):
    from specdecode.drafters import draft_model
    from specdecode.models.quantize import default_draft_quantization

    asked = []
    monkeypatch.setattr(draft_model, "load_model", lambda name, **options: asked.append(options) or tiny_target)
    draft_model.loaded_draft("some-draft", tiny_target)
    draft_model.loaded_draft("some-draft", tiny_target, trains=True)  # online adaptation trains fp32 layers
    assert [options["quantize"] for options in asked] == [default_draft_quantization(), "none"]


class FreeDrafts(DraftLengthPolicy):
    """A policy that plans with the batch: drafts cost nothing and each position is accepted at ``acceptance``."""

    plans_with_batch = True

    def __init__(self, acceptance: float) -> None:
        self.acceptance = acceptance

    def next_length(self, limit: int) -> int:
        return 1

    def depth_offer(self, limit, proposed) -> DepthOffer:
        tokens = [sum(self.acceptance**i for i in range(k + 1)) for k in range(min(limit, 8) + 1)]
        return DepthOffer(tokens, [0.0] * len(tokens), 0.0, lambda width, context: 1.0 + 0.01 * width)

    def take_depth(self, offer, depth, limit, proposed) -> int:
        return depth


def test_the_batch_plan_asks_any_policy_that_plans_with_it():
    sure, doubtful = FreeDrafts(0.95), FreeDrafts(0.05)
    depths = plan_batch([sure, doubtful, FixedLength(2)], [16, 16, 16])
    assert depths[0] > depths[1] and depths[2] == 2
    assert plan_batch([sure, FixedLength(2)], [16, 16]) == [1, 2]  # alone with the batch: it chooses alone


# -- long contexts ----------------------------------------------------------------------------------------


def long_context_costs() -> VerificationCosts:
    """Wide forwards cost little after a short context and much after 4,096 tokens (attention per extra row)."""
    return VerificationCosts({128: curve(0.02), 4096: curve(0.3)})


def test_a_sequence_after_a_long_context_is_priced_with_that_contexts_curve_and_drafts_shallower():
    costs = long_context_costs()
    short, long = CostModel(curve=costs).fork(), CostModel(curve=costs).fork()
    short.reach(128)
    long.reach(6000)
    for policy in (short, long):
        feed(policy, 60, accept_rate=0.7)
    assert long.relative_cost(5) == pytest.approx(2.2) and short.relative_cost(5) < 1.2
    assert 0 < long.next_length(12) < short.next_length(12)
    # The control: one curve for every context prices the long sequence as the short one, and drafts as deep.
    flat = CostModel(curve=linear_costs(0.02)).fork()
    flat.reach(6000)
    feed(flat, 60, accept_rate=0.7)
    assert flat.next_length(12) == short.next_length(12)


def test_a_step_teaches_the_policy_its_context_and_prices_the_scale_at_it():
    policy = CostModel(curve=long_context_costs()).fork()
    policy.observe(StepObservation(depth=3, nodes=3, accepted=2, draft_s=0.0, verify_s=0.19, context_tokens=4096))
    assert policy.context_tokens == 4099  # the step's three new tokens are in the cache now
    assert policy.model.scale.value == pytest.approx(0.1)  # 0.19 s for 4 inputs at 1.9x one: 0.1 s a one-input forward


def test_a_batch_is_priced_at_its_sequences_mean_context():
    costs = long_context_costs()
    model = CostModel(curve=costs, prior_acceptance=0.7)
    model.acceptance_after[False] = []

    def depths(*contexts: int) -> int:
        policies = [model.fork() for _ in contexts]
        for policy, context in zip(policies, contexts):
            policy.reach(context)
        return sum(plan_batch(policies, [12] * len(policies)))

    assert depths(4096, 4096) < depths(128, 128)
    assert depths(128, 4096) == depths(2112, 2112)  # the mean of 128 and 4,096 tokens
