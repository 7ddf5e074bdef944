"""How the next token is chosen: the sampling settings every layer reads (drafters, verifiers, the engine).

Pure Python, below everything that samples: :mod:`specdecode.sampling` turns these settings into distributions.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from specdecode.errors import SpecDecodeError

#: The bounds OpenAI and vLLM give a logit bias (vLLM clamps to them; a value outside is refused here).
LOGIT_BIAS_LIMIT = 100.0
#: The bounds OpenAI gives presence and frequency penalties.
PENALTY_LIMIT = 2.0
#: The repetition penalties accepted: vLLM takes any positive one, but beyond these a float32 logit divided or
#: multiplied by it overflows, and a distribution of infinities has no sample.
REPETITION_PENALTY_RANGE = (0.01, 100.0)


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

    The target's logits are processed before the temperature as vLLM processes them
    (:mod:`specdecode.logits_processing`), at every verified position with that position's own prefix, draft tokens
    included, so that speculative output stays what plain decoding with the same settings gives:

    logit_bias: ``{token id: bias}`` added to the logits (OpenAI's, in [-100, 100]); given as a mapping or pairs.
    repetition_penalty: a logit of a token seen in the prompt or the output is divided by it when positive,
        multiplied when not (HF and vLLM's definition; 1 disables it; from 0.01 to 100).
    presence_penalty, frequency_penalty: subtracted once from the logit of each token in the output, and once per
        occurrence (OpenAI's definitions; the prompt does not count).
    min_p: after the temperature, tokens less likely than ``min_p`` times the most likely one are cut (0 disables it).
    """

    temperature: float = 0.0
    top_k: int = 0  # 0 disables top-k
    top_p: float = 1.0
    seed: int | None = None
    coupled: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -PENALTY_LIMIT <= value <= PENALTY_LIMIT:
                raise SpecDecodeError(f"{_flag(name)} must be a number in [-2, 2], got {value!r}")
        low, high = REPETITION_PENALTY_RANGE
        if not _is_number(self.repetition_penalty) or not low <= self.repetition_penalty <= high:
            raise SpecDecodeError(f"repetition-penalty must be in [{low}, {high}], got {self.repetition_penalty!r}")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise SpecDecodeError(f"min-p must be in [0, 1], got {self.min_p!r}")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise SpecDecodeError(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise SpecDecodeError(f"top-k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            raise SpecDecodeError(f"top-p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.coupled, bool):
            raise SpecDecodeError(f"coupled must be true or false, got {self.coupled!r}")

    @property
    def reads_history(self) -> bool:
        """The logits are processed with the tokens before each position: bias or a penalty is set."""
        return bool(self.logit_bias) or self.penalizes

    @property
    def penalizes(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def is_coupled(self) -> bool:
        """Tokens are Gumbel-max samples keyed by (``seed``, position): sampling, seeded, not opted out."""
        return not self.greedy and self.seed is not None and self.coupled


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _flag(name: str) -> str:
    return name.replace("_", "-")


def _logit_bias(bias: object) -> tuple[tuple[int, float], ...]:
    """``{token id: bias}`` or (id, bias) pairs → pairs sorted by id; ids as integers (JSON keys are text)."""
    pairs = bias.items() if isinstance(bias, Mapping) else bias
    try:
        parsed = {}
        for token, value in pairs:  # type: ignore[union-attr]
            token_id = int(token) if isinstance(token, str) and token.strip().lstrip("-").isdigit() else token
            if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
                raise SpecDecodeError(f"logit-bias token ids must be integers >= 0, got {token!r}")
            if not _is_number(value) or not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT:
                raise SpecDecodeError(f"logit-bias values must be numbers in [-100, 100], got {value!r}")
            parsed[token_id] = float(value)
    except (TypeError, ValueError):
        raise SpecDecodeError(f"logit-bias must map token ids to numbers, got {bias!r}") from None
    return tuple(sorted(parsed.items()))
