"""What every verifier returns, and the tree bookkeeping verifiers share."""

from __future__ import annotations

from dataclasses import dataclass

from specdecode.drafters.base import Draft


@dataclass(frozen=True)
class Verdict:
    """Outcome of verifying one draft (chain or tree).

    path: indices (into ``Draft.tokens``) of the accepted nodes, root to leaf.  For a chain these are
        the first ``num_accepted`` tokens.
    next_token: the token the target contributes after them — the correction at the first rejected
        position, or the bonus token when the path ends at a leaf.  Each step therefore produces
        ``len(path) + 1`` tokens.
    """

    path: tuple[int, ...]
    next_token: int

    @property
    def num_accepted(self) -> int:
        return len(self.path)


def children_by_row(draft: Draft) -> list[list[int]]:
    """``children[r]``: child nodes of logits row r, where row 0 is the last context token and row
    ``i + 1`` is draft node i (the row layout of the verification forward)."""
    children: list[list[int]] = [[] for _ in range(len(draft.tokens) + 1)]
    for node, parent in enumerate(draft.parent_list):
        children[parent + 1].append(node)
    return children
