"""Online estimators the drafters and the draft-length cost model learn with: a decayed running mean, a
decayed least-squares line, a share of successes with a prior and acceptance by stated confidence, each
cheap enough to update after every step."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RunningMean:
    """Exponentially weighted mean; ``weight`` is how many observations the starting value is worth."""

    value: float
    weight: float = 1.0
    decay: float = 0.98

    def add(self, x: float) -> None:
        self.weight = self.weight * self.decay + 1.0
        self.value += (x - self.value) / self.weight


@dataclass
class ShareWithPrior:
    """How often something succeeds (a draft token is accepted), from the successes and trials seen, blended
    with a prior share worth ``weight`` trials, so that little evidence moves the estimate little.

    ``add`` may discount the evidence so far first (``discount`` < 1: recent steps count more)."""

    successes: float = 0.0
    trials: float = 0.0

    def add(self, successes: float, trials: float, discount: float = 1.0) -> None:
        self.successes = discount * self.successes + successes
        self.trials = discount * self.trials + trials

    def estimate(self, prior: float, weight: float) -> float:
        return (self.successes + weight * prior) / (self.trials + weight)


@dataclass
class ConfidenceBins:
    """Online acceptance rate of draft tokens by the confidence their drafter gave them, in ``bins`` equal
    bins.  A confidence c is blended with its bin's evidence as a prior worth ``prior_weight`` tokens, so
    that a drafter not observed yet is taken at its word; ``discount`` < 1 lets recent tokens count more."""

    bins: int = 10
    prior_weight: float = 2.0
    discount: float = 0.98
    shares: list[ShareWithPrior] = field(init=False)

    def __post_init__(self) -> None:
        self.shares = [ShareWithPrior() for _ in range(self.bins)]

    def __call__(self, confidence: float) -> float:
        return self.shares[self._bin(confidence)].estimate(confidence, self.prior_weight)

    def add(self, confidence: float, accepted: bool) -> None:
        self.shares[self._bin(confidence)].add(1.0 if accepted else 0.0, 1.0, self.discount)

    def _bin(self, confidence: float) -> int:
        return min(max(int(confidence * self.bins), 0), self.bins - 1)


@dataclass
class LinearFit:
    """Decayed least squares of y = fixed + per_unit * x with both coefficients >= 0.

    A drafter's cost per step is partly fixed (prompt lookup scans the context once whatever the depth)
    and partly per token (a draft model runs once per token); this separates the two.  While x has
    not varied yet, everything is attributed to the per-unit slope (the cautious reading)."""

    decay: float = 0.98
    count: int = 0  # observations, undecayed
    n: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0

    def add(self, x: float, y: float) -> None:
        self.count += 1
        d = self.decay
        self.n, self.sx, self.sy = self.n * d + 1.0, self.sx * d + x, self.sy * d + y
        self.sxx, self.sxy = self.sxx * d + x * x, self.sxy * d + x * y

    def coefficients(self) -> tuple[float, float]:
        if self.n == 0.0:
            return 0.0, 0.0
        det = self.n * self.sxx - self.sx * self.sx
        if det <= 1e-9 * max(self.n * self.sxx, 1e-12):
            return 0.0, self.sy / self.sx if self.sx > 0 else 0.0
        slope = (self.n * self.sxy - self.sx * self.sy) / det
        fixed = (self.sy - slope * self.sx) / self.n
        if slope < 0.0:
            return max(self.sy / self.n, 0.0), 0.0
        if fixed < 0.0:
            return 0.0, self.sxy / self.sxx
        return fixed, slope

    def __call__(self, x: float) -> float:
        fixed, slope = self.coefficients()
        return fixed + slope * x
