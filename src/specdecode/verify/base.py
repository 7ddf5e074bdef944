"""What every verifier returns."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Verdict:
    """Outcome of verifying one draft.

    num_accepted: how many leading draft tokens were kept (0..k).
    next_token: the token the target contributes after them — the correction at the first rejected
        position, or the bonus token when every draft token was accepted.  Each step therefore
        produces ``num_accepted + 1`` tokens.
    """

    num_accepted: int
    next_token: int
