"""Hydra: sequentially dependent draft heads — each head also sees the tokens drafted before it.

After Ankner et al., "Hydra: Sequentially-Dependent Draft Heads for Medusa Decoding" (2024).  Like
Medusa (:mod:`specdecode.drafters.medusa`, whose session bookkeeping this shares) the heads read the
target's final hidden state of the last position whose feature is known; head k also reads the
embeddings of the last context token and of the k-1 draft tokens on its path, so its guess depends on
what was drafted (:mod:`specdecode.heads.medusa`).  Medusa's depth-2+ guesses cannot follow a depth-1
alternative; Hydra's can, which is where its higher acceptance comes from.

Greedy requests grow a tree by expanding the best nodes, as EAGLE-2 does: at each depth the ``top_k``
nodes with the highest path probability are expanded in one batched head call (each on its own path)
into their ``top_k`` likeliest tokens, and the best nodes overall are verified (a parent scores at least
as high as its children, so they form a tree) — scored, calibrated and counted as Medusa's are.  Sampled
requests draft a chain, each token sampled from its head's distribution given the path drawn so far,
returned with the draft so rejection sampling stays exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from specdecode.drafters import register_drafter
from specdecode.drafters._lookup_graft import Copy, NodeSources
from specdecode.drafters._tree_size import subtree
from specdecode.drafters.base import DraftRequest
from specdecode.drafters.medusa import HeadsSession, MedusaDrafter
from specdecode.types import Draft


@register_drafter("hydra")
class HydraDrafter(MedusaDrafter):
    """Hydra heads (each also reads the path drafted so far); EAGLE-2-style trees (needs training)."""

    kind = "hydra"

    def session(self, request: DraftRequest) -> HydraSession:
        return HydraSession(self, request)


@dataclass
class _Node:
    token: int  # target id
    parent: int  # index in the tree's node list, -1 for children of the context
    score: float  # calibrated probability that verification accepts the whole path to this node
    confidence: float | None  # the heads' probability of it given the parent (None: only the lookup drafted it)
    path: list[int]  # draft tokens from the root to this node, itself included


def _lookup_node(nodes: list[_Node], token: int, parent: int, score: float) -> _Node:
    """A node only the lookup drafted (its path extends its parent's)."""
    return _Node(token, parent, score, None, [*(nodes[parent].path if parent >= 0 else []), token])


class HydraSession(HeadsSession):
    def _start(self, context: list[int], depth: int) -> None:
        self.root = context[-1]

    def _head_logits(self, k: int, paths: list[list[int]]) -> torch.Tensor:
        device = self.backend.device
        tokens = torch.tensor([[self.root, *path] for path in paths], dtype=torch.long, device=device)
        embeds = self.backend.embed(tokens.flatten()).unflatten(0, tokens.shape)  # [n, k + 1, H]
        hidden = self.last.expand(len(paths), -1)
        return self.heads.logits(self.heads.head(k, hidden, embeds))

    def _tree(self, depth: int, copy: Copy, context_tokens: int) -> Draft:
        top_k = self.drafter.top_k
        nodes: list[_Node] = []
        frontier = self._children([-1], [[]], [1.0], 0, nodes)
        # Grafted before the heads grow the tree, so that the budget weighs their nodes against the lookup's.
        grafted = self.drafter.lookup.graft_nodes(copy, nodes, partial(_lookup_node, nodes))
        budget = self.drafter.budget
        for k in range(1, depth):
            expand = budget.worth_expanding([node.score for node in nodes], frontier, top_k, context_tokens)
            if not expand:
                break  # no node the budget would verify: its children would not be verified either
            paths = [nodes[i].path for i in expand]
            frontier = self._children(expand, paths, [nodes[i].score for i in expand], k, nodes)
        order = budget.best_nodes([n.parent for n in nodes], [n.score for n in nodes], context_tokens)
        self.sources, confidence = NodeSources.of_tree(order, [n.confidence for n in nodes], grafted)
        return subtree(order, [n.token for n in nodes], [n.parent for n in nodes], confidence)

    def _children(
        self, parents: list[int], paths: list[list[int]], scores: list[float], k: int, nodes: list[_Node]
    ) -> list[int]:
        """Head ``k`` after each path (one batched call): each parent's ``top_k`` likeliest continuations."""
        logprobs, ids = torch.log_softmax(self._head_logits(k, paths), dim=-1).topk(self.drafter.top_k, dim=-1)
        known = {(node.parent, node.token): index for index, node in enumerate(nodes)}
        calibrated = self.drafter.calibration
        added = []
        for parent, path, score, row, row_ids in zip(
            parents, paths, scores, logprobs.exp().tolist(), self.drafter.target_ids[ids].tolist()
        ):
            for prob, token in zip(row, row_ids):
                index = known.get((parent, token))
                if index is None:  # new
                    added.append(len(nodes))
                    nodes.append(_Node(token, parent, score * calibrated(prob, k + 1), prob, [*path, token]))
                else:  # the lookup drafted it already: now the heads have too
                    node = nodes[index]
                    node.score, node.confidence = max(node.score, score * calibrated(prob, k + 1)), prob
                    added.append(index)
        return added
