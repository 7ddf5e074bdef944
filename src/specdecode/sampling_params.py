"""How the next token is chosen: the sampling settings every layer reads (drafters, verifiers, the engine).

Pure Python, below everything that samples: :mod:`specdecode.sampling` turns these settings into distributions.
"""

from __future__ import annotations

from dataclasses import dataclass

from specdecode.errors import SpecDecodeError


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen.  ``temperature == 0`` means greedy decoding.

    The same parameters shape both the target's and the drafter's distributions, so that the draft
    proposes from (an approximation of) the very distribution the verifier accepts against.

    coupled: with a ``seed``, sample by Gumbel-max coupling (noise keyed by seed and position, see
        :mod:`specdecode.verify.coupled`): the text is then a function of the seed and the target alone —
        the same with any drafter and draft length, plain decoding included.  False keeps rejection
        sampling for seeded runs too (a little more acceptance with sampling drafters, but the text then
        depends on what was drafted).  Unseeded runs always use rejection sampling.
    """

    temperature: float = 0.0
    top_k: int = 0  # 0 disables top-k
    top_p: float = 1.0
    seed: int | None = None
    coupled: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise SpecDecodeError(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise SpecDecodeError(f"top-k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            raise SpecDecodeError(f"top-p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.coupled, bool):
            raise SpecDecodeError(f"coupled must be true or false, got {self.coupled!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def is_coupled(self) -> bool:
        """Tokens are Gumbel-max samples keyed by (``seed``, position): sampling, seeded, not opted out."""
        return not self.greedy and self.seed is not None and self.coupled
