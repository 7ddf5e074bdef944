"""Configuration dataclasses, validated once at the edge so the engine can trust them."""

from __future__ import annotations

from dataclasses import dataclass, field

from specdecode.constraints import Constraint, parse_constraint
from specdecode.errors import SpecDecodeError
from specdecode.sampling_params import SamplingParams
from specdecode.verify.registry import VerifierChoice, parse_verifier

#: VocabTrim's default: the draft heads of the self-speculative drafters and trained heads keep
#: this many token ids (most frequent first) instead of the target's whole vocabulary.
DEFAULT_DRAFT_VOCAB = 8192

#: The most alternatives a request's log-probabilities may list per token (OpenAI's ``top_logprobs`` limit).
MAX_TOP_LOGPROBS = 20

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


@dataclass(frozen=True)
class GenerationConfig:
    """One request: how many tokens, when to stop, how to sample, how far to draft, how to verify.

    verifier: ``exact`` (lossless, the default), the lossless multi-draft ``spectr`` or ``optimal-md``, or a relaxed,
        lossy one (``specdecode verifiers``), with its options; given as text (``"fly"``, ``"fly:window=2"``) it is
        parsed here, once.
    ignore_eos: the model's end-of-sequence tokens do not end the request (``stop_token_ids`` still do).
    stop_token_ids: more tokens that end the request, kept in the output as an end-of-sequence token is.
    min_tokens: the request cannot end (end-of-sequence or ``stop_token_ids``) before this many tokens: those tokens
        are given probability 0 until then, at each verified position by its own prefix; stop strings are looked for
        only after them (as vLLM).
    skip_special_tokens: the text leaves out special tokens (vLLM's default).
    include_stop_str_in_output: the text keeps the stop string, or the stop token's text, that ended it (vLLM's).
    logprobs: None, or record each emitted token's log-probability and this many most likely alternatives'
        (:class:`~specdecode.types.TokenLogprob`), from the target's logits after the bias and penalties, before the
        temperature, min-p, top-k and top-p."""

    max_new_tokens: int = 128
    num_draft_tokens: DraftLength = DEFAULT_NUM_DRAFT_TOKENS  # given as an int, "auto" or "heuristic": parsed
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    verifier: VerifierChoice = field(default_factory=VerifierChoice)
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    constraint: Constraint | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "constraint", parse_constraint(self.constraint))
        if not isinstance(self.verifier, VerifierChoice):
            object.__setattr__(self, "verifier", parse_verifier(self.verifier))
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens <= 0:
            raise SpecDecodeError(f"max-new-tokens must be a positive integer, got {self.max_new_tokens!r}")
        object.__setattr__(self, "num_draft_tokens", parse_draft_length(self.num_draft_tokens))
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise SpecDecodeError("stop strings must be non-empty strings")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise SpecDecodeError(f"stop token ids must be integers >= 0, got {list(self.stop_token_ids)!r}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise SpecDecodeError(f"min-tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.min_tokens > self.max_new_tokens:
            raise SpecDecodeError(
                f"min-tokens ({self.min_tokens}) must be at most max-new-tokens ({self.max_new_tokens})"
            )

        if self.logprobs is not None and (
            isinstance(self.logprobs, bool)
            or not isinstance(self.logprobs, int)
            or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS
        ):
            raise SpecDecodeError(f"logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}, got {self.logprobs!r}")

    def stop_ids(self, eos_ids: frozenset[int]) -> frozenset[int]:
        """The tokens that end this request, given the model's end-of-sequence tokens."""
        return (frozenset() if self.ignore_eos else eos_ids) | frozenset(self.stop_token_ids)

    def ends_at(self, token: int, count: int, stop_ids: frozenset[int]) -> bool:
        """Whether ``token``, the request's ``count``-th generated one, ends it: one of ``stop_ids`` (see
        :meth:`stop_ids`), once ``min_tokens`` are out."""
        return token in stop_ids and count > self.min_tokens
