"""What ``--num-draft-tokens auto`` shares across the requests of one drafter (:class:`CostModel`): its settings,
the target's verification cost curve, the estimates every sequence teaches, and the pricing of a step from
them.  Each sequence decodes with its own :class:`~specdecode.draft_length.sequence.CostModelLength`
(:meth:`CostModel.fork`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from specdecode.draft_length.sequence import CostModelLength
from specdecode.draft_length.tuning import DRAFT_MARGIN, INHERITED_PROBE_BACKOFF, LOSS_BUDGET
from specdecode.estimators import ConfidenceBins, LinearFit, RunningMean
from specdecode.models.cost import VerificationCosts, linear_curve
from specdecode.types import StepObservation

#: Acceptance of draft positions 0, 1, ...: position j's given that every earlier one was accepted.
AcceptanceTable = list[RunningMean]


@dataclass
class CostModel:
    """Prices a step drafting k deep: E[tokens](k) / E[seconds](k).

    E[tokens](k) = 1 + sum_{i<=k} prod_{j<=i} a_j, a_j the acceptance of position j given j-1 accepted, from an
    :data:`AcceptanceTable` (a sequence's own, or the one earlier requests left here).  seconds(k) = overhead +
    draft(k) + scale * curve(k + 1, context): ``curve``, the verification cost relative to one input, is *measured
    once per loaded model* and per context length where a sequence grows long
    (:class:`~specdecode.models.cost.VerificationCosts`: attention makes wide forwards dearer after a long context);
    only ``scale`` (seconds of a one-input forward) is learned online, so a noisy step under contention cannot make
    one width look dear.  Draft cost is a fixed part plus a part per token, fitted online; ``overhead`` is the rest
    of a step, the same for every k.  Each pricing takes the context length of the sequence it prices (0: the
    shortest measured).

    Every sequence of the drafter updates the same estimates, and leaves what it learned of acceptance, of
    drafting's gain and of probing for the sequences after it (``acceptance_after``, ``gain``,
    ``probe_interval``): a new sequence starts from them (:meth:`fork`).
    """

    # -- settings ----------------------------------------------------------------------------------
    maximum: int = 16
    prior_acceptance: float = 0.5
    #: The target's verification cost by width and context (a guess until measured: a linear curve at every context).
    curve: VerificationCosts = field(default_factory=lambda: VerificationCosts.of(linear_curve(1.3)))
    probe_every: int = 8
    max_probe_every: int = 64
    loss_budget: float | None = LOSS_BUDGET  # None: drafting may lose without limit (LOSS_BUDGET)
    reads_context: bool = False  # the drafter runs a model over the context, declared (``Drafter.reads_context``)
    #: A draft token's price until a sequence times one (:meth:`untimed_token_seconds`): its seconds as the drafter
    #: timed them (``Drafter.draft_token_seconds``), or its cost in target forwards (``Drafter.draft_token_share``).
    draft_token_s: float | None = None
    draft_token_share: float | None = None

    # -- estimates every sequence updates ----------------------------------------------------------
    scale: RunningMean = field(default_factory=lambda: RunningMean(1.0, weight=0.0, decay=0.9))
    #: Seconds of forwards over exactly one input (a step without a draft, alone in its batch), timed: what drafting
    #: is judged against.  ``scale`` times the curve is pulled up by wide steps wherever the curve underrates them
    #: (trees, long contexts), which would score a losing drafter as gaining.
    plain_forward: RunningMean = field(default_factory=lambda: RunningMean(0.0, weight=0.0, decay=0.9))
    draft_cost: LinearFit = field(default_factory=LinearFit)
    overhead: RunningMean = field(default_factory=lambda: RunningMean(0.0, weight=0.0))
    calibration: ConfidenceBins = field(default_factory=ConfidenceBins)
    #: Tokens and seconds per step of the whole batch: each sequence adds its tokens and its share of the forward.
    achieved_tokens: RunningMean = field(default_factory=lambda: RunningMean(0.0, weight=0.0))
    achieved_seconds: RunningMean = field(default_factory=lambda: RunningMean(0.0, weight=0.0))
    #: A context reader's reading of a prompt in seconds per second of the target's prefill of it: declared
    #: (``Drafter.reading_cost``), then learnt from first drafts.  None: not known, never weighed.
    context_cost: RunningMean | None = None

    # -- what earlier sequences leave to later ones ------------------------------------------------
    #: Per-position acceptance, keyed by whether the previous draft was accepted in full.
    acceptance_after: dict[bool, AcceptanceTable] = field(default_factory=lambda: {True: [], False: []})
    #: Tokens per second of drafting steps over what plain steps would have given (1: break-even).
    gain: RunningMean = field(default_factory=lambda: RunningMean(1.0, weight=0.0, decay=0.9))
    probe_interval: int = field(init=False)  # steps between probes while not drafting

    def __post_init__(self) -> None:
        backed_off = INHERITED_PROBE_BACKOFF * self.probe_every
        pays = self.best_depth(self.acceptance_after[False], self.maximum)
        self.probe_interval = self.probe_every if pays else backed_off

    def fork(self) -> CostModelLength:
        """The policy of one more sequence, starting from what earlier requests taught."""
        return CostModelLength(self)

    # -- pricing -----------------------------------------------------------------------------------
    def relative_cost(self, width: int, context_tokens: int = 0) -> float:
        """Verification cost of ``width`` inputs after ``context_tokens`` relative to one input there."""
        return self.curve.relative(width, context_tokens)

    def verify_seconds(self, width: int, context_tokens: int = 0) -> float:
        """Expected seconds of a verification forward over ``width`` inputs (units of one input until timed)."""
        return self.scale.value * self.relative_cost(width, context_tokens)

    def untimed_token_seconds(self) -> float:
        """A draft token's price before any sequence has timed one: what the drafter timed (``draft_token_s``), or
        its share of a target forward, declared (``draft_token_share``: a self-drafter's layers) or else its
        reading's (``context_cost``: a token and a reading cost alike only roughly — a quantized draft model's
        token is dearer, relative to the target's, than its prefill); nothing for a drafter that declares none."""
        if self.draft_token_s is not None:
            return self.draft_token_s
        if self.draft_token_share is not None:
            return self.draft_token_share * self.scale.value
        return 0.0 if self.context_cost is None else self.context_cost.value * self.scale.value

    def step_seconds(self, k: int, context_tokens: int = 0) -> float:
        """Expected seconds of a step drafting k deep; until a draft is timed, at :meth:`untimed_token_seconds`."""
        draft = 0.0 if k == 0 else self.draft_cost(k) if self.draft_cost.count else k * self.untimed_token_seconds()
        return self.overhead.value + draft + self.verify_seconds(k + 1, context_tokens)

    def acceptance_at(self, table: AcceptanceTable, position: int) -> float:
        if position < len(table):
            return table[position].value
        return table[-1].value if table else self.prior_acceptance

    def expected_tokens(self, table: AcceptanceTable, k: int) -> float:
        """Tokens a step yields when drafting k deep (the target's own token included)."""
        tokens, survive = 1.0, 1.0
        for position in range(k):
            survive *= self.acceptance_at(table, position)
            tokens += survive
        return tokens

    def expected_rate(self, table: AcceptanceTable, k: int, context_tokens: int = 0) -> float:
        """Expected tokens per second (in the cost model's units) when drafting k deep."""
        return self.expected_tokens(table, k) / self.step_seconds(k, context_tokens)

    def best_depth(self, table: AcceptanceTable, cap: int, context_tokens: int = 0) -> int:
        """The depth up to ``cap`` with the best expected tokens per second; 0 unless it beats plain decoding by
        ``DRAFT_MARGIN`` (a gain within the estimates' error: plain decoding's is certain)."""
        rates = [self.expected_rate(table, k, context_tokens) for k in range(cap + 1)]
        best = max(range(cap + 1), key=rates.__getitem__)
        return best if best and rates[best] >= DRAFT_MARGIN * rates[0] else 0

    # -- learning ----------------------------------------------------------------------------------
    def learn_acceptance(self, table: AcceptanceTable, step: StepObservation) -> None:
        """Add a verified step to ``table``: position j was tried iff the draft reached depth j and every earlier
        position was accepted (a lookup without a match says nothing of deeper drafts)."""
        for position in range(min(step.depth, step.accepted + 1)):
            while len(table) <= position:
                prior = table[-1].value if table else self.prior_acceptance
                table.append(RunningMean(prior, weight=2.0))
            table[position].add(1.0 if position < step.accepted else 0.0)

    def next_probe_interval(self, interval: int, paid: bool) -> int:
        """Probe often again after a probe that paid, half as often (to ``max_probe_every``) after one that did not."""
        return self.probe_every if paid else min(2 * interval, self.max_probe_every)
