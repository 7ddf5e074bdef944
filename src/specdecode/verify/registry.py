"""The verifiers a request may choose (``--verifier``, ``verifier=``, ``"verifier"``), and whether each is lossless.

``exact`` is the default and the only lossless one: greedy matching, coupled verification or rejection sampling
as the engine picks them from the sampling settings (see :mod:`specdecode.engine`).  The others are *relaxed*:
they keep some draft tokens the target would not have produced, trading the guarantee of the target's exact
output for fewer verification forwards.  That trade is never silent — every relaxed verifier is marked
``lossless: false`` here, in ``--json`` stats, in the server's metrics and in ``specdecode verifiers``.

Pure Python on purpose: the CLI's listing and the configuration check read it without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from specdecode.errors import SpecDecodeError


@dataclass(frozen=True)
class VerifierInfo:
    name: str
    lossless: bool
    description: str  # one line, for ``specdecode verifiers``


VERIFIERS: dict[str, VerifierInfo] = {
    info.name: info
    for info in (
        VerifierInfo(
            "exact",
            True,
            "the target's own output: greedy matching, coupled (seeded) or rejection sampling (default)",
        ),
        VerifierInfo(
            "fly",
            False,
            "FLy: a mismatch where the target is unsure is kept if the next draft tokens then match (LOSSY)",
        ),
        VerifierInfo(
            "typical",
            False,
            "Medusa's typical acceptance: keep a token whose target probability beats an entropy-scaled bar (LOSSY)",
        ),
        VerifierInfo(
            "judge",
            False,
            "a trained judge keeps a mismatch it predicts the target would carry on from (`train judge`) (LOSSY)",
        ),
    )
}

DEFAULT_VERIFIER = "exact"


def check_verifier(name: object) -> str:
    """``name`` if it is a registered verifier, else the one-line error a user sees (CLI exit 2, HTTP 400)."""
    if not isinstance(name, str) or name not in VERIFIERS:
        raise SpecDecodeError(f"unknown verifier {name!r}; choose from {', '.join(VERIFIERS)}")
    return name


def is_lossless(name: str) -> bool:
    return VERIFIERS[check_verifier(name)].lossless


def format_verifiers() -> str:
    """``specdecode verifiers``: one line per verifier, its name, lossless or lossy, and what it does."""
    return "\n".join(
        f"{info.name:<9} {'lossless' if info.lossless else 'lossy':<9} {info.description}"
        for info in VERIFIERS.values()
    )
