"""STAND-style stochastic n-gram drafting (2025): n-gram tables that remember distributions, not tokens.

After ``n`` context tokens the table stores the target's next-token distribution observed there at
verification (softmax of the raw logits, compressed to its top ``topk`` entries, averaged over
occurrences with weight 1/2 on the newest).  Every verified row is recorded — rejected branches are
real target distributions too.  A step the policy gave no draft (``auto`` judged drafting a loss here) records only
the token the target chose, as a point mass: the distribution's softmax and top-k over the vocabulary are a third of
STAND's time a step on a 152k-token target, paid whether or not drafting pays
(``docs/results/w4a8-epyc-stand-pointmass-r8``).

The draft tree follows a static template (see ``recycling``): a node's children come from the longest n-gram of
its context that is in the table.  Greedy decoding
proposes the most likely stored tokens (point masses).  Sampling turns the stored distribution into
q with the request's temperature / top-k / top-p and draws siblings without replacement by
Gumbel-top-k; sibling j then reports q with siblings 0..j-1 removed and renormalised — exactly the
distribution it was drawn from, which keeps speculative sampling lossless.

State across requests: at most ``max_entries`` n-gram entries, least recently updated evicted first;
each costs 8 * ``topk`` bytes of arrays plus roughly 200 bytes of dictionary and key (about 8 MiB at
the defaults).  ``reset()`` forgets everything.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from specdecode.drafters import register_drafter
from specdecode.drafters._ngram_tree import PayingTrees
from specdecode.drafters.base import Drafter, DraftRequest, DraftSession
from specdecode.drafters.recycling import DEFAULT_TEMPLATE, grow_tree, parse_template, positive_int
from specdecode.errors import SpecDecodeError
from specdecode.models.loading import LoadedModel
from specdecode.sampling import sampling_probs
from specdecode.types import Draft, StepFeedback

NEWEST_WEIGHT = 0.5  # share of the latest observation in a stored distribution


def without_earlier(q: np.ndarray, order: np.ndarray) -> np.ndarray:
    """Row j: ``q`` with ``order[:j]`` removed and renormalised — the law of the j-th draw without
    replacement (float64 in, float64 out)."""
    rows = np.repeat(q[None, :], len(order), axis=0)
    for j in range(1, len(order)):
        rows[j:, order[j - 1]] = 0.0
    return rows / rows.sum(axis=1, keepdims=True)


@register_drafter("stand")
class StandDrafter(Drafter):
    """STAND: n-gram tables of target distributions; Gumbel-top-k sampled trees with exact draft probs.

    Options: ``template`` (level widths of the draft tree, default "4,3,3,2,2,1,1,1"), ``max_nodes``
    (default 16), ``topk`` (entries kept per stored distribution, default 8), ``min_ngram`` /
    ``max_ngram`` (context lengths used as keys, default 1 and 3; longer matches are tried first),
    ``max_entries`` (table bound, default 32768)."""

    provides_probs = True

    def __init__(
        self,
        target: LoadedModel,
        template: str | int = DEFAULT_TEMPLATE,
        max_nodes: int = 16,
        topk: int = 8,
        min_ngram: int = 1,
        max_ngram: int = 3,
        max_entries: int = 32768,
    ) -> None:
        super().__init__(target)
        self.shape = parse_template(template, "stand")
        self.max_nodes = positive_int(max_nodes, "stand max_nodes")
        self.topk = positive_int(topk, "stand topk")
        self.max_entries = positive_int(max_entries, "stand max_entries")
        if not (positive_int(min_ngram, "stand min_ngram") <= positive_int(max_ngram, "stand max_ngram")):
            raise SpecDecodeError(f"stand n-gram sizes must satisfy min <= max, got min={min_ngram}, max={max_ngram}")
        self.ngram_sizes = range(max_ngram, min_ngram - 1, -1)
        self._vocab = 0  # known from the first verification
        self.reset()

    def reset(self) -> None:
        self.trees = PayingTrees(self.target)
        self._clear_tables()

    def _clear_tables(self) -> None:
        self._slots: OrderedDict[tuple[int, ...], int] = OrderedDict()  # n-gram → row, oldest update first
        width = min(self.topk, self._vocab) if self._vocab else self.topk
        self._ids = np.zeros((0, width), dtype=np.int32)  # [entries, width] token ids, most likely first
        self._probs = np.zeros((0, width), dtype=np.float32)  # their (unnormalised) probabilities

    @property
    def num_entries(self) -> int:
        return len(self._slots)

    @property
    def array_bytes(self) -> int:
        return self._ids.nbytes + self._probs.nbytes

    def session(self, request: DraftRequest) -> StandSession:
        return StandSession(self, request)

    def lookup(self, context: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray] | None:
        """Stored (ids, probabilities) for the longest known n-gram ending ``context`` (a point mass recorded by
        :meth:`learn_chosen` keeps only its one id)."""
        for n in self.ngram_sizes:
            if len(context) >= n and (slot := self._slots.get(context[-n:])) is not None:
                ids, probs = self._ids[slot], self._probs[slot]
                stored = ids >= 0
                return ids[stored], probs[stored]
        return None

    def _fit_vocab(self, vocab: int) -> None:
        if self._vocab != vocab:
            self._vocab = vocab
            self._clear_tables()  # sizes rows for this vocabulary (a drafter serves one target)

    def learn_chosen(self, tail: tuple[int, ...], token: int, vocab: int) -> None:
        """Merge a point mass on ``token``, the target's choice after ``tail``, under every n-gram ending ``tail``."""
        self._fit_vocab(vocab)
        keys = [tail[-n:] for n in self.ngram_sizes if len(tail) >= n]
        if not keys:
            return
        ids = np.full((len(keys), self._ids.shape[1]), -1, dtype=np.int32)
        probs = np.zeros(ids.shape, dtype=np.float32)
        ids[:, 0], probs[:, 0] = token, 1.0
        self._merge(np.array([self._slot_for(key) for key in keys], dtype=np.int64), ids, probs)

    def learn(self, tail: tuple[int, ...], draft: Draft, logits: torch.Tensor) -> None:
        """Merge the target's top-k distributions after each verified row into the table under every n-gram
        ending at that row (``tail``: the context's last tokens before the draft)."""
        self._fit_vocab(logits.shape[-1])
        top = torch.topk(torch.softmax(logits.float().cpu(), dim=-1), self._ids.shape[1], dim=-1)
        ids, probs = top.indices.numpy().astype(np.int32), top.values.numpy()
        keep = self.ngram_sizes.start
        row_context = [tail]
        for token, parent in zip(draft.tokens, draft.parent_list, strict=True):
            row_context.append((*row_context[parent + 1], token)[-keep:])
        row_of_key = {ctx[-n:]: row for row, ctx in enumerate(row_context) for n in self.ngram_sizes if len(ctx) >= n}
        slots = np.array([self._slot_for(key) for key in row_of_key], dtype=np.int64)
        rows = np.fromiter(row_of_key.values(), dtype=np.int64, count=len(row_of_key))
        # A slot evicted and reused within this step appears twice: its last key owns it.
        last = len(slots) - 1 - np.unique(slots[::-1], return_index=True)[1]
        self._merge(slots[last], ids[rows[last]], probs[rows[last]])

    def _slot_for(self, key: tuple[int, ...]) -> int:
        slot = self._slots.get(key)
        if slot is None:
            self._slots[key] = slot = self._free_slot()
            self._ids[slot], self._probs[slot] = -1, 0.0  # an empty distribution to merge into
        else:
            self._slots.move_to_end(key)
        return slot

    def _merge(self, slots: np.ndarray, ids: np.ndarray, probs: np.ndarray) -> None:
        """Stored rows ← (1 - w) · stored + w · observed, over the union of their ids, cut to the most
        likely ones; all [entries, width] at once."""
        old_ids, old_probs = self._ids[slots], self._probs[slots] * (1.0 - NEWEST_WEIGHT)
        same = old_ids[:, :, None] == ids[:, None, :]
        merged = probs * NEWEST_WEIGHT + (same * old_probs[:, :, None]).sum(axis=1)
        only_old = ~same.any(axis=2)
        all_ids = np.concatenate([ids, np.where(only_old, old_ids, -1)], axis=1)
        all_probs = np.concatenate([merged, np.where(only_old, old_probs, 0.0)], axis=1)
        best = np.argsort(-all_probs, axis=1, kind="stable")[:, : ids.shape[1]]  # observed ids win ties
        self._ids[slots] = np.take_along_axis(all_ids, best, axis=1)
        self._probs[slots] = np.take_along_axis(all_probs, best, axis=1)

    def _free_slot(self) -> int:
        """A row for a new entry: a fresh one while under ``max_entries``, else the stalest entry's."""
        if len(self._slots) >= self.max_entries:
            return self._slots.popitem(last=False)[1]
        used = len(self._slots)
        if used >= len(self._ids):
            capacity = min(max(2 * len(self._ids), 256), self.max_entries)
            self._ids = np.resize(self._ids, (capacity, self._ids.shape[1]))  # new rows are written before use
            self._probs = np.resize(self._probs, (capacity, self._probs.shape[1]))
        return used


def _stored_chance(ids: np.ndarray, probs: np.ndarray, token: int) -> float:
    """The stored probability of ``token`` among a table row's ids, capped at 1 (rows are averages)."""
    return min(float(probs[np.flatnonzero(ids == token)[0]]), 1.0)


class StandSession(DraftSession):
    """One request: its sampling, its own random stream, and the context tail at the step's start."""

    reads_target_logits = True

    def __init__(self, drafter: StandDrafter, request: DraftRequest) -> None:
        self.drafter = drafter
        self.sampling = request.sampling
        self.rng = request.numpy_rng()
        self._tail = tuple(request.prompt_ids[-drafter.ngram_sizes.start :])

    def propose(self, context: list[int], max_tokens: int) -> Draft:
        drafter = self.drafter
        tail = tuple(context[-drafter.ngram_sizes.start :])
        drawn: dict[tuple[int, ...], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}  # path → ids, q, order
        stored: dict[tuple[int, ...], tuple[np.ndarray, np.ndarray]] = {}  # greedy: path → ids, probabilities

        def candidates(path: tuple[int, ...]) -> np.ndarray:
            found = drafter.lookup(tail + path)
            if found is None:
                return np.zeros(0, dtype=np.int32)
            ids, probs = found
            if self.sampling.greedy:
                stored[path] = found
                return ids
            q = sampling_probs(torch.from_numpy(np.log(probs)), self.sampling).double().numpy()
            live = np.flatnonzero(q > 0)
            gumbel = np.log(q[live]) - np.log(-np.log(self.rng.random(len(live))))
            order = live[np.argsort(-gumbel)]  # Gumbel-top-k: the order of a without-replacement draw
            drawn[path] = (ids, q, order)
            return ids[order]

        tokens, parents, parent_paths = grow_tree(drafter.shape, max_tokens, drafter.max_nodes, candidates)
        if not tokens:
            return Draft(tokens=[])
        if self.sampling.greedy:  # the template's nodes that pay on this target, by their stored chances
            chances = [_stored_chance(*stored[path], token) for token, path in zip(tokens, parent_paths)]
            return drafter.trees.choose(Draft(tokens=tokens, parents=parents, confidence=chances), len(context))
        probs = torch.zeros(len(tokens), drafter._vocab, dtype=torch.float32)
        for path, (ids, q, order) in drawn.items():
            siblings = [node for node, parent_path in enumerate(parent_paths) if parent_path == path]
            if siblings:  # in rank order: sibling j is the j-th draw
                rows = torch.from_numpy(without_earlier(q, order[: len(siblings)])).float()
                probs[siblings] = probs[siblings].index_copy_(1, torch.from_numpy(ids.astype(np.int64)), rows)
        return Draft(tokens=tokens, probs=probs, parents=parents)

    def observe(self, context: list[int], feedback: StepFeedback) -> None:
        logits = feedback.target_logits
        if logits.numel() and feedback.asked:
            self.drafter.learn(self._tail, feedback.draft, logits)
        elif logits.numel():  # no draft asked for: the target's token alone (see the module doc)
            self.drafter.learn_chosen(self._tail, context[-1], logits.shape[-1])
        self.drafter.trees.learn(feedback)
        self._tail = tuple(context[-self.drafter.ngram_sizes.start :])
