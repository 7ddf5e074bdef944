"""The draft length a request asks for: ``Fixed(k)``, ``Auto`` or ``Heuristic`` (``--num-draft-tokens``).

Every edge (the CLI's flag, the server's ``speculative.num_draft_tokens``, ``specdecode.load``,
``GenerationConfig`` and ``generate(...)``) turns what it was given into one of these with
:func:`parse_draft_length`, under one rule and with one error message.  Imports nothing heavy: the CLI's
``--help`` reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

from specdecode.errors import SpecDecodeError

#: The deepest fixed draft a request may ask for.  A draft never runs past the tokens a request has left, so
#: nothing breaks beyond it; but no drafter is accepted that far in a row (the adaptive policies never draft
#: deeper than 16), so a larger K is a typo that would verify forwards of rejected tokens.
MAX_FIXED_DRAFT_LENGTH = 64


@dataclass(frozen=True)
class Fixed:
    """Draft ``k`` tokens every step (0: plain decoding)."""

    k: int

    def __post_init__(self) -> None:
        if isinstance(self.k, bool) or not isinstance(self.k, int) or not 0 <= self.k <= MAX_FIXED_DRAFT_LENGTH:
            raise _refused(self.k)

    def to_json(self) -> int:
        return self.k

    def __str__(self) -> str:
        return str(self.k)


@dataclass(frozen=True)
class Auto:
    """The depth the cost model expects to give the most tokens per second (``auto``)."""

    def to_json(self) -> str:
        return "auto"

    def __str__(self) -> str:
        return "auto"


@dataclass(frozen=True)
class Heuristic:
    """transformers' assisted-generation schedule (``heuristic``)."""

    def to_json(self) -> str:
        return "heuristic"

    def __str__(self) -> str:
        return "heuristic"


DraftLength = Fixed | Auto | Heuristic
AUTO = Auto()
HEURISTIC = Heuristic()
_NAMED: dict[str, DraftLength] = {"auto": AUTO, "heuristic": HEURISTIC}


def parse_draft_length(value: int | str | DraftLength) -> DraftLength:
    """An integer from 0 to :data:`MAX_FIXED_DRAFT_LENGTH`, ``"auto"`` or ``"heuristic"`` (or a draft length
    already parsed) → its :data:`DraftLength`; anything else is a :class:`SpecDecodeError` saying what is
    allowed.  Text of an integer is not an integer here: the CLI reads its flag as a typed option value first."""
    if isinstance(value, (Fixed, Auto, Heuristic)):
        return value
    if isinstance(value, str):
        if value in _NAMED:
            return _NAMED[value]
        raise _refused(value)
    return Fixed(value)


def _refused(value: object) -> SpecDecodeError:
    return SpecDecodeError(
        f"num-draft-tokens must be an integer from 0 to {MAX_FIXED_DRAFT_LENGTH}, 'auto' or 'heuristic', got {value!r}"
    )
