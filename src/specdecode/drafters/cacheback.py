"""Cacheback (Ma, Gim and Zhong, EMNLP 2025): draft from LRU cache tables of token n-grams.

Language is bursty: an n-gram used recently is likely to be used again soon, and with the same
continuation.  A cache-language-model table mapping each recently seen leader (the last n tokens) to
the tokens that recently followed it captures that locality with nothing but a few dictionary
look-ups per draft node, needs no second model, keeps learning as tokens are generated, and — unlike
copying one earlier span — can chain look-ups into continuations that never occurred verbatim.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from specdecode.drafters import register_drafter
from specdecode.drafters._ngram_tree import PayingTrees, Transcript, check_fraction, check_int, grow_tree
from specdecode.drafters.base import Drafter, DraftRequest, DraftSession
from specdecode.types import Draft, StepFeedback

if TYPE_CHECKING:
    from specdecode.models.loading import LoadedModel

#: Estimated probability of the r-th most recent follower, relative to the (r-1)-th.
RECENCY_DECAY = 0.5


class NgramCache:
    """LRU table: leader (``n`` tokens) → up to ``width`` distinct followers, most recent first.

    Holds at most ``capacity`` leaders; recording a leader makes it the most recently used, and the
    least recently used leader is evicted when the table is full.
    """

    def __init__(self, n: int, width: int, capacity: int) -> None:
        self.n, self.width, self.capacity = n, width, capacity
        self.table: OrderedDict[tuple[int, ...], tuple[int, ...]] = OrderedDict()

    def record(self, leader: tuple[int, ...], token: int) -> None:
        followers = self.table.get(leader)
        if followers is None:
            self.table[leader] = (token,)
            if len(self.table) > self.capacity:
                self.table.popitem(last=False)
            return
        self.table.move_to_end(leader)
        if followers[0] != token:  # tuples, not lists: immutable values the garbage collector ignores
            self.table[leader] = (token, *(f for f in followers if f != token))[: self.width]

    def followers(self, leader: tuple[int, ...]) -> tuple[int, ...]:
        return self.table.get(leader, ())


def _recency_weights(width: int) -> list[list[float]]:
    """``weights[k][r]``: estimated probability of the r-th most recent of k followers."""
    weights: list[list[float]] = [[]]
    for k in range(1, width + 1):
        raw = [RECENCY_DECAY**r for r in range(k)]
        weights.append([w / sum(raw) for w in raw])
    return weights


@register_drafter("cacheback")
class CachebackDrafter(Drafter):
    """LRU tables of token n-grams (leader → recent next tokens), updated online; drafts a tree by chaining.

    Two tables, kept in this object across requests (the generator keeps one drafter) and emptied by
    ``reset()``: one keyed by the last ``leader`` tokens, and one keyed by the last token alone that
    answers while a longer leader has not been seen yet (the cold start).  Every token of the prompt
    and of the output is recorded as it arrives.  A draft tree is grown best-first from the context:
    each node's children are the followers of its own last tokens, the most recent follower estimated
    the most likely.  Memory is bounded by ``max_entries`` leaders per table, least recently used
    evicted; a step costs a few dictionary look-ups per draft node.

    Options: ``leader`` (2) tokens in the primary table's key; ``followers`` (3) distinct next tokens kept
    per leader; ``max_entries`` (32768) leaders per table; ``max_nodes`` (8) draft nodes per step — small,
    since on a CPU verification cost grows with the width of the forward; ``min_prob`` (0.1) least
    estimated path probability of a node.
    """

    def __init__(
        self,
        target: LoadedModel,
        leader: int = 2,
        followers: int = 3,
        max_entries: int = 32768,
        max_nodes: int = 8,
        min_prob: float = 0.1,
    ) -> None:
        super().__init__(target)
        self.leader = check_int("cacheback", "leader", leader, 1)
        self.width = check_int("cacheback", "followers", followers, 1)
        self.max_entries = check_int("cacheback", "max_entries", max_entries, 1)
        self.max_nodes = check_int("cacheback", "max_nodes", max_nodes, 1)
        self.min_prob = check_fraction("cacheback", "min_prob", min_prob)
        self._weights = _recency_weights(self.width)
        self.reset()

    def reset(self) -> None:
        self.trees = PayingTrees(self.target)
        self.tables = [NgramCache(n, self.width, self.max_entries) for n in sorted({self.leader, 1}, reverse=True)]

    def session(self, request: DraftRequest) -> DraftSession:
        return CachebackSession(self, list(request.prompt_ids))

    def record(self, transcript: Transcript, context: Sequence[int]) -> Transcript:
        """Record every token of ``context`` not in ``transcript`` yet under each table's leader; the
        transcript of ``context`` (a new one if ``context`` does not continue it)."""
        new = transcript.advance(context)
        if new is None:  # not a continuation of this request: start over from this context
            transcript = Transcript()
            new = transcript.advance(context)
        tokens = transcript.tokens
        for i in range(len(tokens) - len(new), len(tokens)):
            for table in self.tables:
                if i >= table.n:
                    table.record(tuple(tokens[i - table.n : i]), tokens[i])
        return transcript

    def _next_tokens(self, state: tuple[int, ...], floor: float) -> list[tuple[int, float, tuple[int, ...]]]:
        """Followers of the last tokens of ``state`` from the longest leader known, most recent first."""
        for table in self.tables:
            followers = table.followers(state[-table.n :]) if len(state) >= table.n else ()
            if followers:
                weights = self._weights[len(followers)]
                return [
                    (token, weight, (*state, token)[-self.leader :])
                    for token, weight in zip(followers, weights)
                    if weight >= floor
                ]
        return []


class CachebackSession(DraftSession):
    """One request: how far its tokens are recorded in the drafter's shared tables."""

    def __init__(self, drafter: CachebackDrafter, prompt_ids: list[int]) -> None:
        self.drafter = drafter
        self.transcript = drafter.record(Transcript(), prompt_ids)

    def observe(self, context: list[int], feedback: StepFeedback) -> None:
        self.transcript = self.drafter.record(self.transcript, context)
        self.drafter.trees.learn(feedback)

    def propose(self, context: list[int], max_tokens: int) -> Draft:
        drafter = self.drafter
        self.transcript = drafter.record(self.transcript, context)
        root = tuple(context[-drafter.leader :])
        tree = grow_tree(root, drafter._next_tokens, drafter.max_nodes, max_tokens, drafter.min_prob)
        return drafter.trees.choose(tree.draft, len(context))
