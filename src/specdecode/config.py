"""Configuration dataclasses, validated once at the edge so the engine can trust them."""

from __future__ import annotations

from dataclasses import dataclass, field

from specdecode.errors import SpecDecodeError
from specdecode.verify.registry import DEFAULT_VERIFIER, check_verifier

#: VocabTrim's default: the draft heads of the self-speculative drafters and trained heads keep
#: this many token ids (most frequent first) instead of the target's whole vocabulary.
DEFAULT_DRAFT_VOCAB = 8192

#: The deepest fixed draft a request may ask for.  A draft never runs past the tokens a request has left, so
#: nothing breaks beyond it; but no drafter is accepted that far in a row (the adaptive policies never draft
#: deeper than 16), so a larger K is a typo that would verify forwards of rejected tokens.
MAX_FIXED_DRAFT_LENGTH = 64


class _DraftLengthValue:
    """What every draft length is written as: its JSON value, the same text as ``--num-draft-tokens`` takes."""

    def to_json(self) -> int | str:
        raise NotImplementedError

    def __str__(self) -> str:
        return str(self.to_json())


@dataclass(frozen=True)
class Fixed(_DraftLengthValue):
    """Draft ``k`` tokens every step (0: plain decoding)."""

    k: int

    def __post_init__(self) -> None:
        if isinstance(self.k, bool) or not isinstance(self.k, int) or not 0 <= self.k <= MAX_FIXED_DRAFT_LENGTH:
            raise _not_a_draft_length(self.k)

    def to_json(self) -> int:
        return self.k


@dataclass(frozen=True)
class Auto(_DraftLengthValue):
    """The depth the cost model expects to give the most tokens per second (``auto``)."""

    def to_json(self) -> str:
        return "auto"


@dataclass(frozen=True)
class Heuristic(_DraftLengthValue):
    """transformers' assisted-generation schedule (``heuristic``)."""

    def to_json(self) -> str:
        return "heuristic"


#: The draft length a request asks for (``--num-draft-tokens``, the server's ``speculative.num_draft_tokens``,
#: ``specdecode.load``, ``generate(...)``): every edge turns what it was given into one with
#: :func:`parse_draft_length`, under one rule and with one error message; :mod:`specdecode.draft_length` makes
#: the policy that decides each step's depth from it.
DraftLength = Fixed | Auto | Heuristic
AUTO = Auto()
HEURISTIC = Heuristic()
_NAMED_DRAFT_LENGTHS: dict[str, DraftLength] = {str(length): length for length in (AUTO, HEURISTIC)}


def parse_draft_length(value: int | str | DraftLength) -> DraftLength:
    """An integer from 0 to :data:`MAX_FIXED_DRAFT_LENGTH`, ``"auto"`` or ``"heuristic"`` (or a draft length
    already parsed) → its :data:`DraftLength`; anything else is a :class:`SpecDecodeError` saying what is
    allowed.  Text of an integer is not an integer here: the CLI reads its flag as a number first."""
    if isinstance(value, (Fixed, Auto, Heuristic)):
        return value
    if isinstance(value, str):
        if value in _NAMED_DRAFT_LENGTHS:
            return _NAMED_DRAFT_LENGTHS[value]
        raise _not_a_draft_length(value)
    return Fixed(value)


def _not_a_draft_length(value: object) -> SpecDecodeError:
    return SpecDecodeError(
        f"num-draft-tokens must be an integer from 0 to {MAX_FIXED_DRAFT_LENGTH}, 'auto' or 'heuristic', got {value!r}"
    )


#: ``--num-draft-tokens`` when none is given: ``auto``, the cost model, because the best fixed K differs by
#: drafter, task and machine (``tools/replay_draft_length.py`` compares them on recorded outputs).  The one place
#: the default lives (the CLI, ``specdecode.load`` and the benchmark's default K read it).
DEFAULT_NUM_DRAFT_TOKENS: DraftLength = AUTO


def option_value(raw: str) -> int | float | str:
    """A ``KEY=VALUE`` option's value as typed (``--drafter-option``, ``pld:k=6``, ``fly:window=2``): an integer,
    else a number, else the text; the option's owner checks it."""
    for convert in (int, float):
        try:
            return convert(raw)
        except ValueError:
            continue
    return raw


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


@dataclass(frozen=True)
class RelaxedParams:
    """The knobs of the relaxed (lossy) verifiers, :mod:`specdecode.verify.fly`, :mod:`specdecode.verify.typical`
    and :mod:`specdecode.verify.judge`; ``exact`` reads none of them.

    FLy, at a row where the draft token differs from the target's choice: the mismatch is kept provisionally
    when the target's distribution there is flat (entropy over log(vocabulary) >= ``entropy``) and the draft
    token is among the target's ``top_k`` most likely with probability >= ``min_prob``; it stands only if the
    next ``window`` draft tokens then match the target exactly, else the step rolls back to the mismatch.
    Typical (Medusa): a draft token x is kept when p(x) > min(``epsilon``, ``delta`` * exp(-H(p))).
    Judge: a mismatch passing the ``top_k`` / ``min_prob`` gate is kept when the trained judge (``judge``: its
    directory, default next to the model) rates it harmless with probability >= ``judge_threshold`` (default:
    the threshold chosen at training).
    """

    entropy: float = 0.1
    top_k: int = 5
    min_prob: float = 0.05
    window: int = 3
    epsilon: float = 0.09
    delta: float = 0.3
    judge: str | None = None
    judge_threshold: float | None = None

    def __post_init__(self) -> None:
        for name in ("entropy", "min_prob", "epsilon", "delta", "judge_threshold"):
            value = getattr(self, name)
            if name == "judge_threshold" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
                raise SpecDecodeError(f"verifier option {name} must be a number in [0, 1], got {value!r}")
        if self.judge is not None and (not isinstance(self.judge, str) or not self.judge):
            raise SpecDecodeError(f"verifier option judge must be a directory, got {self.judge!r}")
        for name, low in (("top_k", 1), ("window", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise SpecDecodeError(f"verifier option {name} must be an integer >= {low}, got {value!r}")

    @classmethod
    def from_options(cls, options: dict[str, object]) -> RelaxedParams:
        """``{"window": 4, ...}`` (the CLI's ``--verifier-option KEY=VALUE``) → params; an unknown key is an error."""
        unknown = sorted(set(options) - set(cls.__dataclass_fields__))
        if unknown:
            known = ", ".join(cls.__dataclass_fields__)
            raise SpecDecodeError(f"unknown verifier option(s) {', '.join(unknown)}; known: {known}")
        return cls(**options)  # type: ignore[arg-type]


@dataclass(frozen=True)
class GenerationConfig:
    """One request: how many tokens, when to stop, how to sample, how far to draft, how to verify.

    verifier: ``exact`` (lossless, the default) or a relaxed, lossy one (``specdecode verifiers``), whose
        knobs are ``relaxed``."""

    max_new_tokens: int = 128
    num_draft_tokens: DraftLength = DEFAULT_NUM_DRAFT_TOKENS  # given as an int, "auto" or "heuristic": parsed
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    verifier: str = DEFAULT_VERIFIER
    relaxed: RelaxedParams = field(default_factory=RelaxedParams)

    def __post_init__(self) -> None:
        check_verifier(self.verifier)
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens <= 0:
            raise SpecDecodeError(f"max-new-tokens must be a positive integer, got {self.max_new_tokens!r}")
        object.__setattr__(self, "num_draft_tokens", parse_draft_length(self.num_draft_tokens))
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise SpecDecodeError("stop strings must be non-empty strings")
