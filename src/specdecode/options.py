"""``KEY=VALUE`` options as typed on the command line (``--drafter-option``, method specs, verifier specs)."""

from __future__ import annotations


def option_value(raw: str) -> int | float | str:
    """A ``KEY=VALUE`` option's value as typed (``--drafter-option``, ``pld:k=6``, ``fly:window=2``): an integer,
    else a number, else the text; the option's owner checks it."""
    for convert in (int, float):
        try:
            return convert(raw)
        except ValueError:
            continue
    return raw
