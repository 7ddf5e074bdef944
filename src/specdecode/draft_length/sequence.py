"""One sequence under ``--num-draft-tokens auto`` (:class:`CostModelLength`): its own acceptance, gain, probes,
loss budget and reading of the prompt, priced by the :class:`~specdecode.draft_length.cost_model.CostModel` its
drafter's sequences share."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specdecode.draft_length.base import DepthOffer, DraftLengthPolicy
from specdecode.draft_length.tuning import (
    ANSWER_HORIZON,
    DRAFT_MARGIN,
    INHERITED_PROBE_BACKOFF,
    LOSING_GAIN,
    LOSS_ALLOWANCE_STEPS,
    MIN_GAIN_EVIDENCE,
    PROBE_GAIN_WEIGHT,
    SEQUENCE_PRIOR_WEIGHT,
    UNTIMED_DEPTH,
    UNTIMED_STEPS,
)
from specdecode.estimators import ConfidenceBins, LinearFit, RunningMean
from specdecode.types import StepObservation

if TYPE_CHECKING:
    from specdecode.draft_length.cost_model import AcceptanceTable, CostModel


@dataclass
class CostModelLength(DraftLengthPolicy):
    """Choose the depth k that maximises E[tokens per step] / E[seconds per step] (:class:`CostModel`), with this
    sequence's own acceptance: learned only from positions the drafter offered, and *separately after a draft
    accepted in full and after one that was not*: copied text comes in runs (draft deep), while after a miss the
    next draft is a fresh guess (draft shallow).  It starts from what earlier requests taught, worth only
    ``SEQUENCE_PRIOR_WEIGHT`` steps: a chat answer and a copied edit in one batch accept very differently.

    Drafters that report a per-token confidence (``Draft.confidence``, e.g. the draft model's
    probability of its own token) get a SpecDec++-style stop rule: confidences are calibrated online
    into acceptance probabilities, their running product predicts the chance that the whole prefix is
    accepted, and drafting stops once that chance no longer pays for the extra width — i.e. below
    ``rate * (marginal verification + draft seconds)``, with ``rate`` the tokens per second achieved so far.
    A drafter that reads the context (a draft model) must first read the prompt, at a cost that can exceed all
    its drafts save on a short answer.  So before its first draft of a sequence, its reading (``context_cost``
    times the target's prefill of this prompt, :meth:`begin`) is priced against the expected saving over the
    tokens to come (at most ``ANSWER_HORIZON``); where drafting would not gain ``DRAFT_MARGIN``, reading included,
    the sequence is decoded plainly (after one plain step, which times the target).  The reading's price is
    learnt from first drafts' ``setup_s``.

    Whether to draft at all is the cost model's call for every drafter: when no depth pays by
    ``DRAFT_MARGIN`` (a self-drafter whose tokens the target rejects costs a partial forward per step for
    nothing), the policy drafts nothing and only probes depth 1, after ``probe_every`` steps, twice as long
    after each probe that did not pay (at most ``max_probe_every``), back to ``probe_every`` once one pays and
    drafting, with its evidence, is expected to pay (later sequences start from the interval, see
    ``INHERITED_PROBE_BACKOFF``).  The model can be wrong where its inputs are estimates (a tree verifies more
    nodes than it is deep; a drafter's cost varies with the text), so it is also checked against what drafting
    actually achieved: each step that drafted is scored by its tokens per second over what a plain step would
    have given (the same overhead, one input instead of the draft), and a sequence whose recent score falls
    below ``LOSING_GAIN`` drafts nothing but probes until a probe pays.
    """

    model: CostModel = field(repr=False)
    probe_interval: int = field(init=False)  # steps until the next probe while not drafting
    #: Per-position acceptance, keyed by whether the previous draft was accepted in full.
    acceptance_after: dict[bool, AcceptanceTable] = field(init=False)
    #: Tokens per second of recent drafting steps over what plain steps would have given (1: break-even).
    gain: RunningMean = field(init=False)
    reads_context: bool = field(init=False)  # the drafter runs a model over the context: declared, or seen catching up
    probing: bool = False  # the step asked for is a probe
    in_run: bool = False  # the last step that drafted had its whole draft accepted
    uses_confidence: bool = False  # the drafter reports a confidence per token
    steps_without_drafting: int = 0
    others_width: int = 0  # inputs the rest of the batch added to the last verification forward
    batch: int = 1  # sequences in the last verification forward
    #: This sequence's seconds so far and what its drafting saved against plain steps, net, for ``LOSS_BUDGET``.
    elapsed_s: float = 0.0
    net_saved_s: float = 0.0
    prefill_s: float = 0.0  # the target's prefill of this sequence's prompt (begin)
    context_tokens: int = 0  # tokens in the target's cache before the next step: what verification runs after
    context_read: bool = False  # this sequence's drafter has read its prompt (a step drafted)
    declined: bool = False  # reading the prompt would not have paid back: this sequence drafts nothing

    plans_with_batch = True

    def __post_init__(self) -> None:
        model = self.model
        self.probe_interval = min(model.probe_interval, INHERITED_PROBE_BACKOFF * model.probe_every)
        self.acceptance_after = {
            run: [RunningMean(m.value, min(m.weight, SEQUENCE_PRIOR_WEIGHT), m.decay) for m in means]
            for run, means in model.acceptance_after.items()
        }
        self.gain = RunningMean(model.gain.value, min(model.gain.weight, SEQUENCE_PRIOR_WEIGHT / 2), model.gain.decay)
        self.reads_context = model.reads_context

    def fork(self) -> CostModelLength:
        return self.model.fork()

    # -- the shared costs this sequence is priced with ----------------------------------------------
    @property
    def draft_cost(self) -> LinearFit:
        return self.model.draft_cost

    @property
    def calibration(self) -> ConfidenceBins:
        return self.model.calibration

    @property
    def context_cost(self) -> RunningMean | None:
        return self.model.context_cost

    def relative_cost(self, width: int) -> float:
        return self.model.relative_cost(width, self.context_tokens)

    def verify_seconds(self, width: int) -> float:
        return self.model.verify_seconds(width, self.context_tokens)

    def step_seconds(self, k: int) -> float:
        return self.model.step_seconds(k, self.context_tokens)

    # -- this sequence's expectations ---------------------------------------------------------------
    @property
    def acceptance(self) -> AcceptanceTable:
        """The per-position acceptance that applies to the next step."""
        return self.acceptance_after[self.in_run]

    def expected_tokens(self, k: int) -> float:
        """Tokens a step yields when drafting k deep (the target's own token included)."""
        return self.model.expected_tokens(self.acceptance, k)

    def expected_rate(self, k: int) -> float:
        """Expected tokens per second (in the cost model's units) when drafting k deep."""
        return self.model.expected_rate(self.acceptance, k, self.context_tokens)

    def best_depth(self, cap: int) -> int:
        """The depth up to ``cap`` with the best expected tokens per second, 0 unless it pays (``DRAFT_MARGIN``)."""
        return self.model.best_depth(self.acceptance, cap, self.context_tokens)

    def achieved_rate(self) -> float:
        """Tokens per second over recent steps, or the model's best guess before any step."""
        achieved = self.model.achieved_seconds.value
        if achieved > 0:
            return self.model.achieved_tokens.value / achieved
        return max(self.expected_rate(k) for k in range(self.model.maximum + 1))

    def plain_step_seconds(self, overhead_s: float | None = None) -> float:
        """This sequence's share of a step without a draft: its one input beside the rest of the batch (alone:
        the timed one-input forward, once there is one)."""
        model = self.model
        overhead = model.overhead.value if overhead_s is None else overhead_s
        if self.others_width == 0 and model.plain_forward.weight > 0:
            return overhead + model.plain_forward.value
        return overhead + self.verify_seconds(self.others_width + 1) / self.batch

    # -- decisions ----------------------------------------------------------------------------------
    @property
    def losing(self) -> bool:
        """Drafting has recently yielded measurably less than plain decoding would have."""
        return self.gain.weight >= MIN_GAIN_EVIDENCE and self.gain.value < LOSING_GAIN

    @property
    def over_budget(self) -> bool:
        """This sequence's drafting has lost more than ``loss_budget`` allows (see ``LOSS_BUDGET``)."""
        if self.model.loss_budget is None:
            return False
        allowed = self.model.loss_budget * self.elapsed_s + LOSS_ALLOWANCE_STEPS * self.plain_step_seconds()
        return -self.net_saved_s > allowed

    @property
    def deepest(self) -> int:
        """The policy's maximum, or ``UNTIMED_DEPTH`` while a context-reading drafter's cost is not timed yet."""
        untimed = self.reads_context and self.model.draft_cost.count < UNTIMED_STEPS
        return min(self.model.maximum, UNTIMED_DEPTH) if untimed else self.model.maximum

    def next_length(self, limit: int) -> int:
        cap = min(self.deepest, limit) if self.reading_pays(limit) and not self.over_budget else 0
        return self.settle(0 if self.losing else self.best_depth(cap), cap)

    def begin(self, prefill_s: float, context_tokens: int = 0) -> None:
        self.prefill_s = prefill_s
        self.elapsed_s += prefill_s
        self.reach(context_tokens)

    def reach(self, context_tokens: int) -> None:
        """The target's cache now holds ``context_tokens``: price the next step's verification after that many
        (measuring that context's cost curve if this is the first sequence to get there)."""
        self.context_tokens = context_tokens
        self.model.curve.prepare(context_tokens)

    def reading_pays(self, limit: int) -> bool:
        """Whether this sequence may draft, as far as its drafter's reading of the prompt goes: true once read,
        or for a drafter that reads nothing; else whether drafting over the tokens still to come (``limit`` + 1,
        at most ``ANSWER_HORIZON``) is expected to save more than the reading costs (see the class doc)."""
        model = self.model
        if model.context_cost is None or self.context_read or self.prefill_s <= 0.0 or limit <= 0:
            return True
        if self.declined or model.scale.weight == 0.0:
            return False  # before any step is timed, a plain one prices the target's forward
        best_rate = max(self.expected_rate(k) for k in range(1, min(model.maximum, limit) + 1))
        horizon = min(limit + 1, ANSWER_HORIZON)
        drafted_s = horizon / best_rate + model.context_cost.value * self.prefill_s  # the reading included
        self.declined = DRAFT_MARGIN * drafted_s >= horizon / self.expected_rate(0)
        return not self.declined

    def settle(self, best: int, cap: int, proposed: bool = False) -> int:
        """The depth to ask for once the cost model chose ``best``: a confidence drafter gets ``cap`` (its stop
        rule decides token by token) unless its draft was ``proposed`` already and ``best`` was chosen from its
        confidences; a choice of 0 may become a probe of depth 1 now and then, unless the sequence declined to
        have its prompt read (:meth:`reading_pays`)."""
        if self.declined:
            return 0
        if best > 0 or cap == 0:
            self.steps_without_drafting = 0
            # A drafter that reports confidences: the stop rule decides how deep, token by token.
            return cap if self.uses_confidence and not proposed else best
        self.steps_without_drafting += 1
        if self.steps_without_drafting < self.probe_interval:
            return 0
        self.steps_without_drafting, self.probing = 0, True
        return 1

    def draft_cap(self, limit: int, confidences: Sequence[float] | None = None) -> int:
        """The deepest draft worth weighing: none while losing, past the loss budget or where reading the prompt
        would not pay (:meth:`reading_pays`); never past ``limit``, the maximum or a draft already proposed (its
        ``confidences``); ``UNTIMED_DEPTH`` for a draft still to be made before the drafter's cost is timed."""
        if self.losing or self.over_budget or not self.reading_pays(limit):
            return 0
        return min(limit, len(confidences) if confidences is not None else self.deepest, self.model.maximum)

    def depth_for_draft(self, confidences: Sequence[float], limit: int) -> int:
        """How much of a chain already proposed (its cost spent) to verify: the depth with the best expected
        tokens per second, from the chances that its prefixes survive (:meth:`survival`)."""
        cap = self.draft_cap(limit, confidences)
        tokens = self.expected_tokens_of(confidences, cap)
        overhead = self.model.overhead.value
        best = max(range(cap + 1), key=lambda k: tokens[k] / (overhead + self.verify_seconds(k + 1)))
        return self.settle(best, cap, proposed=True)

    def expected_tokens_of(self, confidences: Sequence[float], cap: int) -> list[float]:
        """Tokens a step yields when verifying 0..cap tokens of a chain with these confidences."""
        tokens = [1.0]
        for chance in self.survival(confidences)[:cap]:
            tokens.append(tokens[-1] + chance)
        return tokens

    def survival(self, confidences: Sequence[float]) -> list[float]:
        """The chance that each prefix of a chain with these confidences is accepted in full (calibrated)."""
        survival, chance = [], 1.0
        for confidence in confidences:
            chance *= self.model.calibration(confidence)  # calibrated online
            survival.append(chance)
        return survival

    def should_stop(self, confidences: Sequence[float]) -> bool:
        n, base = len(confidences), self.others_width
        if n == 0:
            return False
        model = self.model
        draft = model.draft_cost(n + 1) - model.draft_cost(n)
        extra = draft + self.verify_seconds(base + n + 2) - self.verify_seconds(base + n + 1)
        return self.survival(confidences)[-1] < self.achieved_rate() * extra

    def keep_length(self, confidences: Sequence[float]) -> int:
        rate, base = self.achieved_rate(), self.others_width
        for depth, survival in enumerate(self.survival(confidences), start=1):
            if survival < rate * (self.verify_seconds(base + depth + 1) - self.verify_seconds(base + depth)):
                return depth - 1
        return len(confidences)

    # -- a batched step's plan (specdecode.batch_plan) ----------------------------------------------
    def depth_alone(self, limit: int, proposed: Sequence[float] | None) -> int:
        return self.next_length(limit) if proposed is None else self.depth_for_draft(proposed, limit)

    def depth_offer(self, limit: int, proposed: Sequence[float] | None) -> DepthOffer:
        cap = self.draft_cap(limit, proposed)
        if proposed is None:
            tokens = [self.expected_tokens(k) for k in range(cap + 1)]
            draft_s = [self.model.draft_cost(k) if k else 0.0 for k in range(cap + 1)]
        else:
            tokens, draft_s = self.expected_tokens_of(proposed, cap), [0.0] * (cap + 1)
        return DepthOffer(tokens, draft_s, self.model.overhead.value, self.model.verify_seconds, self.context_tokens)

    def take_depth(self, offer: DepthOffer, depth: int, limit: int, proposed: Sequence[float] | None) -> int:
        if proposed is None:
            return self.settle(depth, min(self.deepest, limit))
        return self.settle(depth, offer.cap, proposed=True)

    # -- learning -----------------------------------------------------------------------------------
    def observe(self, step: StepObservation) -> None:
        model = self.model
        width = step.forward_width
        self.others_width, self.batch = width - step.nodes - 1, step.batch
        model.scale.add(step.verify_s / model.relative_cost(width, step.context_tokens))
        if width == 1:
            model.plain_forward.add(step.verify_s)
        model.overhead.add(step.overhead_s)
        score = None
        if step.depth:  # a drafter catching up with the context (its prompt prefill...) is no cost per token
            model.draft_cost.add(step.depth, step.draft_s - step.setup_s)
            self.reads_context = self.reads_context or step.setup_s > 0
            reads_prompt, self.context_read = not self.context_read, True
            if reads_prompt and model.context_cost is not None and self.prefill_s > 0.0 and step.setup_s > 0.0:
                model.context_cost.add(step.setup_s / self.prefill_s)  # what reading the prompt cost, learnt
            score = self._score_drafting(step, reads_prompt)
        # The rate of the whole batch: each sequence adds its tokens and its share of the shared forward.
        model.achieved_tokens.add(step.accepted + 1.0)
        seconds = step.overhead_s + step.draft_s + step.verify_s / step.batch
        model.achieved_seconds.add(seconds)
        self.elapsed_s += seconds
        model.learn_acceptance(self.acceptance_after[self.in_run], step)
        model.learn_acceptance(model.acceptance_after[self.in_run], step)
        if step.depth:
            self.in_run = step.accepted == step.depth
        if self.probing:
            # Back to probing often only after a probe that paid and makes drafting pay: one accepted but dearer
            # than the token it won, or a lucky one among rejections, says drafting still loses.
            self.probing = False
            paid = step.accepted > 0 and score is not None and score >= 1.0 and self.best_depth(model.maximum) > 0
            self.probe_interval = model.next_probe_interval(self.probe_interval, paid)
            # Every probe moves the shared interval: concurrent sequences all count.
            model.probe_interval = model.next_probe_interval(model.probe_interval, paid)
        if step.confidence is not None:
            self.uses_confidence = True
            for position, confidence in enumerate(step.confidence[: step.accepted + 1]):
                model.calibration.add(confidence, position < step.accepted)
        if step.context_tokens:
            self.reach(step.context_tokens + step.accepted + 1)

    def _score_drafting(self, step: StepObservation, reads_prompt: bool) -> float | None:
        """Score a step that drafted against the plain step it replaced (its one input instead of its draft, the
        same overhead); the score, tokens per second over plain decoding's (None: nothing was timed).  Catching
        up with the context counts (skipped tokens, context re-tokenised across vocabularies), except the
        prompt's reading (``reads_prompt``), decided ex ante by :meth:`reading_pays`."""
        spent = step.overhead_s + step.draft_s - (step.setup_s if reads_prompt else 0.0) + step.verify_s / step.batch
        plain = self.plain_step_seconds(step.overhead_s)
        if spent <= 0.0:
            return None
        self.net_saved_s += (step.accepted + 1.0) * plain - spent
        score = (step.accepted + 1.0) * plain / spent
        if self.probing and score >= 1.0:  # a probe that paid: the text changed, judge drafting afresh
            self.gain = RunningMean(score, weight=PROBE_GAIN_WEIGHT, decay=self.gain.decay)
        else:
            self.gain.add(score)
        self.model.gain.add(score)
        return score
