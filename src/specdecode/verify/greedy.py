"""Greedy verification: follow the target's argmax down the draft tree while a child matches it."""

from __future__ import annotations

from specdecode.types import Draft, Verdict, children_by_row


def verify_greedy(choices: list[int], draft: Draft) -> Verdict:
    """choices: the target's greedy choice at each of the nodes + 1 rows; row 0 predicts what follows the context,
    row i + 1 what follows node i.  The result equals plain greedy decoding by construction."""
    children = children_by_row(draft)
    path: list[int] = []
    row = 0
    while True:
        chosen = choices[row]
        match = next((c for c in children[row] if draft.tokens[c] == chosen), None)
        if match is None:
            return Verdict(path=tuple(path), next_token=chosen)
        path.append(match)
        row = match + 1
