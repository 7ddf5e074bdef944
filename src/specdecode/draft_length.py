"""How far to draft each step.

A fixed K is wrong whenever costs or acceptance vary: on a CPU a verification forward over 8 tokens
costs 2-3x one token, so drafting deep only pays while the drafter is being accepted.  Policies:

* ``FixedLength(k)`` — always k (the classic setting);
* ``HeuristicLength`` — transformers' assisted-generation schedule: +2 after a fully accepted draft,
  -1 otherwise;
* ``CostModelLength`` (``--num-draft-tokens auto``) — picks the depth that maximises expected tokens
  per second, from online estimates of per-position acceptance, of the verification forward's cost as a
  function of its width, and of the drafter's own cost per token.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from specdecode.errors import SpecDecodeError


@dataclass(frozen=True)
class StepObservation:
    """What one step cost and achieved."""

    depth: int  # how deep the draft actually went (0: nothing drafted)
    nodes: int  # draft tokens verified (a tree has more nodes than depth)
    accepted: int
    draft_s: float
    verify_s: float


class DraftLengthPolicy(ABC):
    @abstractmethod
    def next_length(self, limit: int) -> int:
        """Depth to request from the drafter this step, at most ``limit``."""

    def observe(self, step: StepObservation) -> None:  # noqa: B027
        """Learn from the step just verified.  Default: nothing to learn."""


@dataclass
class FixedLength(DraftLengthPolicy):
    k: int

    def next_length(self, limit: int) -> int:
        return min(self.k, limit)


@dataclass
class HeuristicLength(DraftLengthPolicy):
    """transformers' ``num_assistant_tokens_schedule="heuristic"`` as a baseline."""

    k: int = 5
    maximum: int = 16

    def next_length(self, limit: int) -> int:
        return min(self.k, limit)

    def observe(self, step: StepObservation) -> None:
        if step.depth == 0:
            return
        self.k = min(self.k + 2, self.maximum) if step.accepted == step.depth else max(1, self.k - 1)


@dataclass
class _RunningMean:
    """Exponentially weighted mean; ``weight`` is how many observations the starting value is worth."""

    value: float
    weight: float = 1.0
    decay: float = 0.98

    def add(self, x: float) -> None:
        self.weight = self.weight * self.decay + 1.0
        self.value += (x - self.value) / self.weight


@dataclass
class CostModelLength(DraftLengthPolicy):
    """Maximise E[tokens per step] / E[seconds per step] over the depth k.

    E[tokens](k) = 1 + sum_{i<=k} prod_{j<=i} a_j with a_j the acceptance rate of position j given that
    j-1 was accepted; seconds(k) = verify(k + 1 inputs) + k * draft cost per token.  Verification cost
    is learned per input width and interpolated linearly between widths seen so far (a prior ratio of
    ``prior_ratio_8_1`` between 8 and 1 inputs stands in for widths not yet measured).  When drafting
    looks useless the policy still probes depth 1 every ``probe_every`` steps, so it notices when the
    text turns repetitive again.
    """

    maximum: int = 12
    prior_acceptance: float = 0.6
    prior_ratio_8_1: float = 2.5
    probe_every: int = 8
    acceptance: list[_RunningMean] = field(default_factory=list)
    verify_cost: dict[int, _RunningMean] = field(default_factory=dict)
    draft_cost_per_token: _RunningMean = field(default_factory=lambda: _RunningMean(0.0, weight=0.0))
    steps_without_drafting: int = 0

    def _acceptance(self, position: int) -> float:
        if position < len(self.acceptance):
            return self.acceptance[position].value
        return self.acceptance[-1].value if self.acceptance else self.prior_acceptance

    def _prior_shape(self, width: int) -> float:
        """Cost of a forward over ``width`` inputs relative to one input, before any measurement."""
        return 1.0 + (width - 1) * (self.prior_ratio_8_1 - 1.0) / 7.0

    def _verify_seconds(self, width: int) -> float:
        cost = self.verify_cost
        if width in cost:
            return cost[width].value
        if not cost:
            return self._prior_shape(width)
        seen = sorted(cost)
        below = max((w for w in seen if w < width), default=None)
        above = min((w for w in seen if w > width), default=None)
        if below is not None and above is not None:
            lo, hi = cost[below].value, cost[above].value
            return lo + (hi - lo) * (width - below) / (above - below)
        anchor = below if below is not None else above
        if len(seen) >= 2:  # extrapolate the measured slope
            slope = (cost[seen[-1]].value - cost[seen[0]].value) / (seen[-1] - seen[0])
            return max(cost[anchor].value + slope * (width - anchor), 1e-9)
        return cost[anchor].value * self._prior_shape(width) / self._prior_shape(anchor)

    def expected_rate(self, k: int) -> float:
        """Expected tokens per second (in the cost model's units) when drafting k deep."""
        tokens, survive = 1.0, 1.0
        for position in range(k):
            survive *= self._acceptance(position)
            tokens += survive
        seconds = self._verify_seconds(k + 1) + k * self.draft_cost_per_token.value
        return tokens / seconds

    def next_length(self, limit: int) -> int:
        best = max(range(min(self.maximum, limit) + 1), key=self.expected_rate)
        if best == 0 and limit > 0:
            self.steps_without_drafting += 1
            if self.steps_without_drafting % self.probe_every == 0:
                return 1
        else:
            self.steps_without_drafting = 0
        return best

    def observe(self, step: StepObservation) -> None:
        width = step.nodes + 1
        self.verify_cost.setdefault(width, _RunningMean(step.verify_s, weight=0.0)).add(step.verify_s)
        if step.depth:
            self.draft_cost_per_token.add(step.draft_s / step.depth)
        # Position j was tried iff the draft reached depth j and every earlier position was accepted.
        for position in range(min(step.depth, step.accepted + 1)):
            while len(self.acceptance) <= position:
                self.acceptance.append(_RunningMean(self._acceptance(len(self.acceptance)), weight=2.0))
            self.acceptance[position].add(1.0 if position < step.accepted else 0.0)


def make_policy(spec: int | str) -> DraftLengthPolicy:
    """``--num-draft-tokens``: an integer K, ``auto`` (cost model) or ``heuristic`` (transformers')."""
    if isinstance(spec, int) and not isinstance(spec, bool):
        if spec < 0:
            raise SpecDecodeError(f"num-draft-tokens must be an integer >= 0, 'auto' or 'heuristic', got {spec!r}")
        return FixedLength(spec)
    if spec == "auto":
        return CostModelLength()
    if spec == "heuristic":
        return HeuristicLength()
    raise SpecDecodeError(f"num-draft-tokens must be an integer >= 0, 'auto' or 'heuristic', got {spec!r}")
