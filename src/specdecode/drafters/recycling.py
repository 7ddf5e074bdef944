"""Token Recycling (Luo et al. 2024): reuse the candidate tokens every verification computes anyway.

Each verification forward yields logits for every drafted node, most of them for rejected branches;
their top-k next tokens are still the target's own guesses of what follows that token.  An adjacency
matrix keeps, for every token t, the top-k tokens the target last predicted right after t (rows are
overwritten each step, from every verified row, not only the accepted ones).  A draft tree is read
off the matrix breadth first along a static tree template.  The matrix lives in the drafter, so it
keeps improving across requests; ``reset()`` forgets it.

The matrix only knows what the model tends to say after one token, so it cannot copy: on a cold
request it is empty, and on text that repeats the prompt its top-k rarely holds the exact next token.
Each node's candidates therefore also include what followed the same two tokens (then the same token)
most recently in this request's prompt and output — the prompt-lookup guess, one token at a time, so it
can continue a copy down the tree — ahead of the matrix's top-1 when the two tokens match.

Memory: an int32 slot per vocabulary entry plus one int32 row of width ``k`` (the widest level of the
template) per token seen so far — at most ``4 * vocab * (k + 1)`` bytes (5 MiB for Gemma-3's 262,144
tokens at the default k = 4; 1.1 MiB for the paper's 32,000-token vocabulary at k = 8), and far less
in practice because only tokens that occurred get a row.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from specdecode.drafters import register_drafter
from specdecode.drafters._ngram_tree import PayingTrees, Transcript
from specdecode.drafters.base import Drafter, DraftRequest, DraftSession
from specdecode.errors import SpecDecodeError
from specdecode.models.loading import LoadedModel
from specdecode.types import Draft, StepFeedback

DEFAULT_TEMPLATE = "4,3,3,2,2,1,1,1"

#: The chance a candidate of each rank is taken at before verification has said otherwise: recycled top-k
#: lists carry no probabilities, so the rank stands in for one, each rank its own calibration bin (the
#: calibration, per depth, then learns what each rank is really accepted at).
RANK_CHANCES = (0.9, 0.7, 0.5, 0.3, 0.1)

#: A tree shape: nodes in breadth-first order as (parent index or -1, rank among the parent's candidates).
Shape = list[tuple[int, int]]


def parse_template(template: str | int | Sequence[int], name: str) -> Shape:
    """Level widths "w1,w2,..." → a tree shape with w_d nodes at depth d.

    Nodes of a level are handed out best first: candidate (parent, rank) is scored by the parent's
    score plus its rank (a lower total rank is likelier right), ties going to the earlier parent.  So
    "3,3,2" gives the root's top 3; then the best child's top 2 and the second child's top 1; then the
    top 2 under the best grandchild.  Every parent's children have ranks 0, 1, ... without gaps, which
    keeps sampled siblings a proper without-replacement sequence.
    """
    try:
        widths = (
            [int(w) for w in template.split(",")]
            if isinstance(template, str)
            else ([template] if isinstance(template, int) else [int(w) for w in template])
        )
    except (TypeError, ValueError):
        widths = []
    if not widths or any(w < 1 for w in widths):
        raise SpecDecodeError(f"{name} template must be level widths like {DEFAULT_TEMPLATE!r}, got {template!r}")
    shape: Shape = [(-1, rank) for rank in range(widths[0])]
    level = list(range(widths[0]))
    score = {node: rank for node, rank in enumerate(level)}
    for width in widths[1:]:
        offers = sorted(
            (score[parent] + rank, order, rank, parent) for order, parent in enumerate(level) for rank in range(width)
        )[:width]
        level = []
        for total, _, rank, parent in offers:
            score[len(shape)] = total
            level.append(len(shape))
            shape.append((parent, rank))
    return shape


def positive_int(value: object, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise SpecDecodeError(f"{what} must be a positive integer, got {value!r}")
    return value


def grow_tree(
    shape: Shape, max_depth: int, max_nodes: int, candidates: Callable[[tuple[int, ...]], Sequence[int]]
) -> tuple[list[int], list[int], list[tuple[int, ...]]]:
    """Fill ``shape`` breadth first: a node of rank r takes its parent's r-th candidate.

    ``candidates(path)`` lists the distinct tokens proposed after the context followed by ``path``
    (the tokens from the root down to the parent), best first; it is called once per parent.  A
    node without a candidate is left out together with its subtree.  Returns tokens, parents and
    each node's parent path.
    """
    tokens: list[int] = []
    parents: list[int] = []
    parent_paths: list[tuple[int, ...]] = []
    placed: dict[int, int] = {}  # shape index → draft index
    paths: dict[int, tuple[int, ...]] = {-1: ()}  # draft index → path of tokens ending at that node
    offered: dict[int, Sequence[int]] = {}
    for index, (parent, rank) in enumerate(shape):
        if len(tokens) >= max_nodes:
            break
        if parent >= 0 and parent not in placed:
            continue
        node_parent = placed[parent] if parent >= 0 else -1
        path = paths[node_parent]
        if len(path) >= max_depth:
            continue
        if node_parent not in offered:
            offered[node_parent] = candidates(path)
        if rank >= len(offered[node_parent]):
            continue
        token = int(offered[node_parent][rank])
        placed[index] = len(tokens)
        paths[len(tokens)] = (*path, token)
        tokens.append(token)
        parents.append(node_parent)
        parent_paths.append(path)
    return tokens, parents, parent_paths


@register_drafter("recycling")
class TokenRecyclingDrafter(Drafter):
    """Token Recycling: a static tree read off the target's recycled top-k successors of each token.

    Options: ``template`` (level widths of the static draft tree, default "4,3,3,2,2,1,1,1"; its
    widest level sets how many candidates are kept per token) and ``max_nodes`` (cap on tree size,
    default 16).  Proposals are deterministic (point masses), so sampling stays lossless too."""

    def __init__(self, target: LoadedModel, template: str | int = DEFAULT_TEMPLATE, max_nodes: int = 16) -> None:
        super().__init__(target)
        self.shape = parse_template(template, "recycling")
        self.max_nodes = positive_int(max_nodes, "recycling max_nodes")
        self.k = max(rank for _, rank in self.shape) + 1
        self.reset()

    def reset(self) -> None:
        self.trees = PayingTrees(self.target)
        self._slot: np.ndarray | None = None  # [vocab] int32: row of each token in _rows, -1 if unseen
        self._rows = np.empty((0, self.k), dtype=np.int32)  # [capacity, k] top-k successors
        self._used = 0

    @property
    def state_bytes(self) -> int:
        slot_bytes = self._slot.nbytes if self._slot is not None else 0
        return slot_bytes + self._rows.nbytes

    def successors(self, token: int) -> np.ndarray:
        """The target's top-k tokens last seen after ``token`` (empty if never seen)."""
        if self._slot is None or not 0 <= token < len(self._slot) or self._slot[token] < 0:
            return self._rows[:0, 0]
        row = self._rows[self._slot[token]]
        return row[row >= 0]  # a vocabulary smaller than k leaves trailing gaps

    def session(self, request: DraftRequest) -> RecyclingSession:
        return RecyclingSession(self, list(request.prompt_ids))

    def recycle(self, heads: list[int], logits: torch.Tensor) -> None:
        """Store the target's top-k after each verified row's token (``heads[r]`` is row r's token)."""
        heads_array = np.array(heads, dtype=np.int64)
        top = torch.topk(logits, min(self.k, logits.shape[-1]), dim=-1).indices.cpu().numpy().astype(np.int32)
        known = heads_array >= 0
        self._store(heads_array[known], top[known], logits.shape[-1])

    def _store(self, heads: np.ndarray, top: np.ndarray, vocab: int) -> None:
        """Overwrite the rows of ``heads`` with ``top``; a token verified twice keeps its last row."""
        if self._slot is None:
            self._slot = np.full(vocab, -1, dtype=np.int32)
        last_of_head = len(heads) - 1 - np.unique(heads[::-1], return_index=True)[1]
        heads, top = heads[last_of_head], top[last_of_head]
        new = heads[self._slot[heads] < 0]
        if len(new):
            if self._used + len(new) > len(self._rows):
                capacity = min(max(2 * len(self._rows), self._used + len(new), 64), vocab)
                grown = np.full((capacity, self.k), -1, dtype=np.int32)
                grown[: self._used] = self._rows[: self._used]
                self._rows = grown
            self._slot[new] = np.arange(self._used, self._used + len(new), dtype=np.int32)
            self._used += len(new)
        self._rows[self._slot[heads], : top.shape[1]] = top


class RecyclingSession(DraftSession):
    """One request: what followed which tokens in its own prompt and output, and its last token."""

    reads_target_logits = True

    def __init__(self, drafter: TokenRecyclingDrafter, prompt: list[int]) -> None:
        self.drafter = drafter
        self._last = prompt[-1] if prompt else -1  # the context's last token when the current step began
        self._begin(prompt)

    def _begin(self, tokens: Sequence[int]) -> None:
        self._transcript = Transcript()
        self._after_one: dict[int, int] = {}  # token → the token that followed it most recently
        self._after_two: dict[int, int] = {}  # (a << 32 | b) → the token that followed a, b most recently
        self._index(tokens)

    def _index(self, context: Sequence[int]) -> None:
        """Record the successors of the tokens appended since the last call (all of them if the context is
        not a continuation of what was indexed)."""
        start = len(self._transcript.tokens)
        if self._transcript.advance(context) is None:
            self._begin(context)
            return
        seen = self._transcript.tokens
        for i in range(max(1, start), len(seen)):
            self._after_one[seen[i - 1]] = seen[i]
            if i >= 2:
                self._after_two[seen[i - 2] << 32 | seen[i - 1]] = seen[i]

    def candidates(self, before: int, last: int) -> list[int]:
        """Distinct next tokens after ``before, last``, best first: the context's successor of the pair,
        the matrix's top-1, the context's successor of ``last``, the rest of the matrix's top-k."""
        recycled = self.drafter.successors(last).tolist()
        ordered = [self._after_two.get(before << 32 | last), *recycled[:1], self._after_one.get(last), *recycled[1:]]
        return list(dict.fromkeys(t for t in ordered if t is not None))[: self.drafter.k]

    def propose(self, context: list[int], max_tokens: int) -> Draft:
        self._index(context)
        tail = tuple(context[-2:]) if len(context) >= 2 else (-1, *context)

        offered: dict[tuple[int, ...], list[int]] = {}

        def candidates(path: tuple[int, ...]) -> list[int]:
            before, last = (*tail, *path)[-2:]
            offered[path] = self.candidates(before, last)
            return offered[path]

        tokens, parents, paths = grow_tree(self.drafter.shape, max_tokens, self.drafter.max_nodes, candidates)
        # The template's nodes that pay on this target, each taken at its rank's chance until calibrated.
        ranks = [offered[path].index(token) for token, path in zip(tokens, paths)]
        chances = [RANK_CHANCES[min(rank, len(RANK_CHANCES) - 1)] for rank in ranks]
        return self.drafter.trees.choose(Draft(tokens=tokens, parents=parents, confidence=chances), len(context))

    def observe(self, context: list[int], feedback: StepFeedback) -> None:
        if feedback.target_logits.numel():
            self.drafter.recycle([self._last, *feedback.draft.tokens], feedback.target_logits)
        self.drafter.trees.learn(feedback)
        self._last = context[-1]
