"""``--num-draft-tokens auto``: the depth that maximises expected tokens per second, from measured costs
and online acceptance (:class:`CostModelLength`)."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field

from specdecode.draft_length.base import DraftLengthPolicy
from specdecode.estimators import ConfidenceBins, LinearFit, RunningMean
from specdecode.models.cost import cost_at, linear_curve
from specdecode.types import StepObservation

#: How many steps of evidence a new sequence's acceptance estimate inherits from earlier requests.
SEQUENCE_PRIOR_WEIGHT = 4.0

#: A sequence stops drafting (and only probes) once its drafting steps have measurably yielded less than
#: this share of the tokens per second that plain steps would have, over at least ``MIN_GAIN_EVIDENCE``
#: steps' worth of (decayed) evidence.
LOSING_GAIN = 0.97
MIN_GAIN_EVIDENCE = 6.0
#: A probe that paid replaces that evidence with itself, worth this many steps.
PROBE_GAIN_WEIGHT = 2.0
#: A new sequence starts at the probe interval its predecessors' probes left, at most this many ``probe_every``:
#: probes that keep losing cost a request one probe, not three; other text is still tried within 32 steps.  A
#: policy whose prior acceptance (a self-drafter's, measured) makes no depth pay starts there too.
INHERITED_PROBE_BACKOFF = 4
#: A depth is drafted only when expected to yield this many times plain decoding's tokens/s: the inputs are
#: estimates, and drafting costs what they omit, so break-even drafts lose (`kangaroo` at 33% acceptance, 4.6%).
DRAFT_MARGIN = 1.03
#: What one sequence's drafting may lose against plain decoding, net of what it gained: this share of the
#: sequence's time so far (its prefill included) plus ``LOSS_ALLOWANCE_STEPS`` plain steps.  Past it the
#: sequence drafts nothing, probes included, until its time has grown enough to pay for more trying.  This
#: caps what a drafter that finds nothing costs a cold request — its first guesses and its probes: a
#: layer-skip probe costs about 0.6 of a target forward, an early exit's 0.3, a lookup's almost nothing
#: (measured on qwen2.5-coder-1.5b w4a8, where three or four such probes and early drafts in 64 tokens
#: had cost 3-6%; at 2%, `suffix` read 0.939x on one).  Drafting that pays banks its gains: never limited.
LOSS_BUDGET = 0.01
LOSS_ALLOWANCE_STEPS = 0.5
#: A drafter that reads the context (its first forward also reads the prompt: ``StepObservation.setup_s``)
#: drafts at most ``UNTIMED_DEPTH`` deep until its cost has been timed over this many drafting steps.  A
#: prompt's forward tells little of a token's cost: a 0.5B fp32 draft model for an int4 1.5B target, taken
#: at its prompt's share (12 ms a token), drafted 10 tokens next at 89 ms each, all rejected — a second
#: lost on a 64-token answer.  Depth 2 times a one-token forward at the price of one.
UNTIMED_STEPS = 2
UNTIMED_DEPTH = 2
#: The most tokens a sequence is counted on to still generate (at most what its ``max_new_tokens`` leaves)
#: when ``auto`` weighs a drafter's reading of the prompt against what its drafts would save: a long chat
#: answer.  Beyond it, an answer may well have ended at EOS.
ANSWER_HORIZON = 256


@dataclass
class CostModelLength(DraftLengthPolicy):
    """Choose the depth k that maximises E[tokens per step] / E[seconds per step].

    E[tokens](k) = 1 + sum_{i<=k} prod_{j<=i} a_j, a_j the online acceptance of position j given j-1 accepted,
    learned only from positions the drafter offered (a lookup without a match says nothing of deeper drafts), and
    *separately after a draft accepted in full and after one that was not*: copied text comes in runs (draft deep),
    while after a miss the next draft is a fresh guess (draft shallow).  seconds(k) = overhead + draft(k) +
    scale * curve[k + 1]: ``curve``, the verification cost relative to one input, is *measured once per loaded
    model* (:func:`specdecode.models.cost.relative_cost_curve`); only ``scale`` (seconds of a one-input forward)
    is learned online, so a noisy step under contention cannot make one width look dear.  Draft cost is a fixed
    part plus a part per token, fitted online; ``overhead`` is the rest of a step, the same for every k.

    Drafters that report a per-token confidence (``Draft.confidence``, e.g. the draft model's
    probability of its own token) get a SpecDec++-style stop rule: confidences are calibrated online
    into acceptance probabilities, their running product predicts the chance that the whole prefix is
    accepted, and drafting stops once that chance no longer pays for the extra width — i.e. below
    ``rate * (marginal verification + draft seconds)``, with ``rate`` the tokens per second achieved so far.
    A drafter that reads the context (a draft model) must first read the prompt, at a cost that can exceed all
    its drafts save (a 0.5B draft's reading took 2.0 s, the 64 tokens after it 5.4 s).  So before its first draft
    of a sequence, its reading (``context_cost`` times the target's prefill of this prompt, :meth:`begin`) is
    priced against the expected saving over the tokens to come (at most ``ANSWER_HORIZON``); where drafting
    would not gain ``DRAFT_MARGIN``, reading included, the sequence is decoded plainly (after one plain step,
    which times the target).  The reading's price is learnt from first drafts' ``setup_s``.

    Whether to draft at all is the cost model's call for every drafter: when no depth pays by
    ``DRAFT_MARGIN`` (a self-drafter whose tokens the target rejects costs a partial forward per step for
    nothing), the policy drafts nothing and only probes depth 1, after ``probe_every`` steps, twice as long
    after each probe that did not pay (at most ``max_probe_every``), back to ``probe_every`` once one pays and
    drafting, with its evidence, is expected to pay (later sequences start from the interval, see the constant).
    The model can be wrong where its inputs are estimates (a tree verifies more nodes than it is deep; a
    drafter's cost varies with the text), so it is also checked against what drafting actually achieved:
    each step that drafted is scored by its tokens per second over what a plain step would have given (the
    same overhead, one input instead of the draft), and a sequence whose recent score falls below
    ``LOSING_GAIN`` drafts nothing but probes until a probe pays.
    """

    maximum: int = 16
    prior_acceptance: float = 0.5
    curve: tuple[float, ...] = field(default_factory=lambda: linear_curve(1.3))
    probe_every: int = 8
    max_probe_every: int = 64
    loss_budget: float | None = LOSS_BUDGET  # None: drafting may lose without limit (LOSS_BUDGET)
    probe_interval: int = field(init=False)  # steps until the next probe while not drafting
    probing: bool = False  # the step asked for is a probe
    #: Per-position acceptance, keyed by whether the previous draft was accepted in full.
    acceptance_after: dict[bool, list[RunningMean]] = field(default_factory=lambda: {True: [], False: []})
    in_run: bool = False  # the last step that drafted had its whole draft accepted
    scale: RunningMean = field(default_factory=lambda: RunningMean(1.0, weight=0.0, decay=0.9))
    #: Seconds of forwards over exactly one input (a step without a draft, alone in its batch), timed: what drafting
    #: is judged against (``plain_step_seconds``).  ``scale`` times the curve is pulled up by wide steps wherever the
    #: curve underrates them (trees, long contexts): with it, a tree drafter losing 7% was scored as gaining.
    plain_forward: RunningMean = field(default_factory=lambda: RunningMean(0.0, weight=0.0, decay=0.9))
    draft_cost: LinearFit = field(default_factory=LinearFit)
    overhead: RunningMean = field(default_factory=lambda: RunningMean(0.0, weight=0.0))
    calibration: ConfidenceBins = field(default_factory=ConfidenceBins)
    uses_confidence: bool = False
    reads_context: bool = False  # the drafter runs a model over the context: declared, or seen catching up
    achieved_tokens: RunningMean = field(default_factory=lambda: RunningMean(0.0, weight=0.0))
    achieved_seconds: RunningMean = field(default_factory=lambda: RunningMean(0.0, weight=0.0))
    steps_without_drafting: int = 0
    others_width: int = 0  # inputs the rest of the batch added to the last verification forward
    batch: int = 1  # sequences in the last verification forward
    #: This sequence's seconds so far and what its drafting saved against plain steps, net, for ``LOSS_BUDGET``.
    elapsed_s: float = 0.0
    net_saved_s: float = 0.0
    #: Tokens per second of recent drafting steps over what plain steps would have given (1: break-even).
    gain: RunningMean = field(default_factory=lambda: RunningMean(1.0, weight=0.0, decay=0.9))
    #: A context reader's reading of a prompt in seconds per second of the target's prefill of it: declared
    #: (``Drafter.reading_cost``), then learnt from first drafts.  None: not known, never weighed.
    context_cost: RunningMean | None = None
    #: A draft token's price until this policy times one (:meth:`untimed_token_seconds`): its seconds as the drafter
    #: timed them (``Drafter.draft_token_seconds``), or its cost in target forwards (``Drafter.draft_token_share``).
    draft_token_s: float | None = None
    draft_token_share: float | None = None
    prefill_s: float = 0.0  # the target's prefill of this sequence's prompt (begin)
    context_read: bool = False  # this sequence's drafter has read its prompt (a step drafted)
    declined: bool = False  # reading the prompt would not have paid back: this sequence drafts nothing
    parent: CostModelLength | None = field(default=None, repr=False)  # a fork's origin, which learns too

    def __post_init__(self) -> None:
        if not self.curve or self.curve[0] <= 0:
            raise ValueError("a cost curve needs a positive cost for one input")
        self.curve = tuple(c / self.curve[0] for c in self.curve)
        backed_off = INHERITED_PROBE_BACKOFF * self.probe_every
        self.probe_interval = self.probe_every if self.best_depth(self.maximum) else backed_off

    # -- the cost model --------------------------------------------------------------------------
    @property
    def acceptance(self) -> list[RunningMean]:
        """The per-position acceptance that applies to the next step."""
        return self.acceptance_after[self.in_run]

    def _acceptance(self, position: int) -> float:
        if position < len(self.acceptance):
            return self.acceptance[position].value
        return self.acceptance[-1].value if self.acceptance else self.prior_acceptance

    def relative_cost(self, width: int) -> float:
        """Verification cost of ``width`` inputs relative to one; linear extrapolation past the curve."""
        return cost_at(self.curve, width)

    def verify_seconds(self, width: int) -> float:
        """Expected seconds of a verification forward over ``width`` inputs (units of one input until timed)."""
        return self.scale.value * self.relative_cost(width)

    def step_seconds(self, k: int) -> float:
        """Expected seconds of a step drafting k deep; until a draft is timed, at :meth:`untimed_token_seconds`."""
        draft = 0.0 if k == 0 else self.draft_cost(k) if self.draft_cost.count else k * self.untimed_token_seconds()
        return self.overhead.value + draft + self.verify_seconds(k + 1)

    def untimed_token_seconds(self) -> float:
        """A draft token's price before this policy has timed one: what the drafter timed (``draft_token_s``), or
        its share of a target forward, declared (``draft_token_share``: a self-drafter's layers) or else its
        reading's (``context_cost``: a token and a reading cost alike only roughly — a quantized draft model's
        token is dearer, relative to the target's, than its prefill); nothing for a drafter that declares none."""
        if self.draft_token_s is not None:
            return self.draft_token_s
        if self.draft_token_share is not None:
            return self.draft_token_share * self.scale.value
        return 0.0 if self.context_cost is None else self.context_cost.value * self.scale.value

    def expected_rate(self, k: int) -> float:
        """Expected tokens per second (in the cost model's units) when drafting k deep."""
        return self.expected_tokens(k) / self.step_seconds(k)

    def achieved_rate(self) -> float:
        """Tokens per second over recent steps, or the model's best guess before any step."""
        if self.achieved_seconds.value > 0:
            return self.achieved_tokens.value / self.achieved_seconds.value
        return max(self.expected_rate(k) for k in range(self.maximum + 1))

    # -- decisions -------------------------------------------------------------------------------
    def fork(self) -> CostModelLength:
        """Shares what is learned about costs (the same objects); acceptance starts from what earlier requests
        taught, worth only ``SEQUENCE_PRIOR_WEIGHT`` steps, and is then learned for this sequence (and for
        the requests after it) — a chat answer and a copied edit in one batch accept very differently."""
        twin = copy.copy(self)
        twin.in_run, twin.probing, twin.steps_without_drafting, twin.others_width = False, False, 0, 0
        twin.prefill_s, twin.context_read, twin.declined = 0.0, False, False
        twin.elapsed_s, twin.net_saved_s = 0.0, 0.0
        twin.probe_interval = min(self.probe_interval, INHERITED_PROBE_BACKOFF * self.probe_every)
        twin.parent = self
        twin.acceptance_after = {
            run: [RunningMean(m.value, min(m.weight, SEQUENCE_PRIOR_WEIGHT), m.decay) for m in means]
            for run, means in self.acceptance_after.items()
        }
        twin.gain = RunningMean(self.gain.value, min(self.gain.weight, SEQUENCE_PRIOR_WEIGHT / 2), self.gain.decay)
        return twin

    @property
    def losing(self) -> bool:
        """Drafting has recently yielded measurably less than plain decoding would have."""
        return self.gain.weight >= MIN_GAIN_EVIDENCE and self.gain.value < LOSING_GAIN

    def plain_step_seconds(self, overhead_s: float | None = None) -> float:
        """This sequence's share of a step without a draft: its one input beside the rest of the batch (alone:
        the timed one-input forward, once there is one)."""
        overhead = self.overhead.value if overhead_s is None else overhead_s
        if self.others_width == 0 and self.plain_forward.weight > 0:
            return overhead + self.plain_forward.value
        return overhead + self.verify_seconds(self.others_width + 1) / self.batch

    @property
    def over_budget(self) -> bool:
        """This sequence's drafting has lost more than ``loss_budget`` allows (see ``LOSS_BUDGET``)."""
        if self.loss_budget is None:
            return False
        allowed = self.loss_budget * self.elapsed_s + LOSS_ALLOWANCE_STEPS * self.plain_step_seconds()
        return -self.net_saved_s > allowed

    def expected_tokens(self, k: int) -> float:
        """Tokens a step yields when drafting k deep (the target's own token included)."""
        tokens, survive = 1.0, 1.0
        for position in range(k):
            survive *= self._acceptance(position)
            tokens += survive
        return tokens

    @property
    def deepest(self) -> int:
        """The policy's maximum, or ``UNTIMED_DEPTH`` while a context-reading drafter's cost is not timed yet."""
        untimed = self.reads_context and self.draft_cost.count < UNTIMED_STEPS
        return min(self.maximum, UNTIMED_DEPTH) if untimed else self.maximum

    def next_length(self, limit: int) -> int:
        cap = min(self.deepest, limit) if self.reading_pays(limit) and not self.over_budget else 0
        return self.settle(0 if self.losing else self.best_depth(cap), cap)

    def best_depth(self, cap: int) -> int:
        """The depth up to ``cap`` with the best expected tokens per second; 0 unless it beats plain decoding by
        ``DRAFT_MARGIN`` (a gain within the estimates' error: plain decoding's is certain)."""
        best = max(range(cap + 1), key=self.expected_rate)
        return best if best and self.expected_rate(best) >= DRAFT_MARGIN * self.expected_rate(0) else 0

    def begin(self, prefill_s: float) -> None:
        self.prefill_s = prefill_s
        self.elapsed_s += prefill_s

    def reading_pays(self, limit: int) -> bool:
        """Whether this sequence may draft, as far as its drafter's reading of the prompt goes: true once read,
        or for a drafter that reads nothing; else whether drafting over the tokens still to come (``limit`` + 1,
        at most ``ANSWER_HORIZON``) is expected to save more than the reading costs (see the class doc)."""
        if self.context_cost is None or self.context_read or self.prefill_s <= 0.0 or limit <= 0:
            return True
        if self.declined or self.scale.weight == 0.0:
            return False  # before any step is timed, a plain one prices the target's forward
        best_rate = max(self.expected_rate(k) for k in range(1, min(self.maximum, limit) + 1))
        horizon = min(limit + 1, ANSWER_HORIZON)
        drafted_s = horizon / best_rate + self.context_cost.value * self.prefill_s  # the reading included
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

    def _after_probe(self, paid: bool) -> None:
        """Probe often again after a probe that paid, half as often (to ``max_probe_every``) after one that did not."""
        self.probe_interval = self.probe_every if paid else min(2 * self.probe_interval, self.max_probe_every)

    def _learn_acceptance(self, step: StepObservation, in_run: bool) -> None:
        # Position j was tried iff the draft reached depth j and every earlier position was accepted.
        table = self.acceptance_after[in_run]
        for position in range(min(step.depth, step.accepted + 1)):
            while len(table) <= position:
                prior = table[-1].value if table else self.prior_acceptance
                table.append(RunningMean(prior, weight=2.0))
            table[position].add(1.0 if position < step.accepted else 0.0)

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
        if self.parent is not None:
            self.parent.gain.add(score)
        return score

    def draft_cap(self, limit: int, confidences: Sequence[float] | None = None) -> int:
        """The deepest draft worth weighing: none while losing, past the loss budget or where reading the prompt
        would not pay (:meth:`reading_pays`); never past ``limit``, the maximum or a draft already proposed (its
        ``confidences``); ``UNTIMED_DEPTH`` for a draft still to be made before the drafter's cost is timed."""
        if self.losing or self.over_budget or not self.reading_pays(limit):
            return 0
        return min(limit, len(confidences) if confidences is not None else self.deepest, self.maximum)

    def depth_for_draft(self, confidences: Sequence[float], limit: int) -> int:
        """How much of a chain already proposed (its cost spent) to verify: the depth with the best expected
        tokens per second, from the chances that its prefixes survive (:meth:`survival`)."""
        cap = self.draft_cap(limit, confidences)
        tokens = self.expected_tokens_of(confidences, cap)
        best = max(range(cap + 1), key=lambda k: tokens[k] / (self.overhead.value + self.verify_seconds(k + 1)))
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
            chance *= self.calibration(confidence)  # calibrated online
            survival.append(chance)
        return survival

    def should_stop(self, confidences: Sequence[float]) -> bool:
        n, base = len(confidences), self.others_width
        if n == 0:
            return False
        draft = self.draft_cost(n + 1) - self.draft_cost(n)
        extra = draft + self.verify_seconds(base + n + 2) - self.verify_seconds(base + n + 1)
        return self.survival(confidences)[-1] < self.achieved_rate() * extra

    def keep_length(self, confidences: Sequence[float]) -> int:
        rate, base = self.achieved_rate(), self.others_width
        for depth, survival in enumerate(self.survival(confidences), start=1):
            if survival < rate * (self.verify_seconds(base + depth + 1) - self.verify_seconds(base + depth)):
                return depth - 1
        return len(confidences)

    # -- learning --------------------------------------------------------------------------------
    def observe(self, step: StepObservation) -> None:
        width = step.forward_width
        self.others_width, self.batch = width - step.nodes - 1, step.batch
        self.scale.add(step.verify_s / self.relative_cost(width))
        if width == 1:
            self.plain_forward.add(step.verify_s)
        self.overhead.add(step.overhead_s)
        score = None
        if step.depth:  # a drafter catching up with the context (its prompt prefill...) is no cost per token
            self.draft_cost.add(step.depth, step.draft_s - step.setup_s)
            self.reads_context = self.reads_context or step.setup_s > 0
            reads_prompt, self.context_read = not self.context_read, True
            if reads_prompt and self.context_cost is not None and self.prefill_s > 0.0 and step.setup_s > 0.0:
                self.context_cost.add(step.setup_s / self.prefill_s)  # what reading the prompt cost, learnt
            score = self._score_drafting(step, reads_prompt)
        # The rate of the whole batch: each sequence adds its tokens and its share of the shared forward.
        self.achieved_tokens.add(step.accepted + 1.0)
        seconds = step.overhead_s + step.draft_s + step.verify_s / step.batch
        self.achieved_seconds.add(seconds)
        self.elapsed_s += seconds
        self._learn_acceptance(step, self.in_run)
        if self.parent is not None:
            self.parent._learn_acceptance(step, self.in_run)
        if step.depth:
            self.in_run = step.accepted == step.depth
        if self.probing:
            # Back to probing often only after a probe that paid and makes drafting pay: one accepted but dearer
            # than the token it won, or a lucky one among rejections, says drafting still loses.
            self.probing = False
            paid = step.accepted > 0 and score is not None and score >= 1.0 and self.best_depth(self.maximum) > 0
            self._after_probe(paid)
            if self.parent is not None:  # every probe moves the origin's interval: concurrent forks all count
                self.parent._after_probe(paid)
        if step.confidence is not None:
            self.uses_confidence = True
            for position, confidence in enumerate(step.confidence[: step.accepted + 1]):
                self.calibration.add(confidence, position < step.accepted)
