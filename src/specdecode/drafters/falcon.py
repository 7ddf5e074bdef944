"""Falcon: a semi-autoregressive head drafts ``block`` tokens per pass; a tree of blocks.

After Gao et al., "Falcon: Faster and Parallel Inference of Large Language Models through Enhanced
Semi-Autoregressive Drafting and Custom-Designed Decoding Tree" (AAAI 2025).  The head
(:mod:`specdecode.heads.falcon`) reads the target's final features, which the engine hands over from the
verification forward (``hidden_layers``), so nothing runs twice.

Per step the positions verified last step are fed to the head with their true features in one call, and
the last ``block`` of them — each seeing all of the context — give the next ``block`` tokens' distributions
at once: the first pass.  Feeding a block's tokens back with the features the head predicted for them (one
block of rows, seeing the context, the blocks before it on its path and one another) gives the next
``block``: a draft of d tokens costs d / ``block`` head passes.

Greedy requests grow the paper's custom-designed tree, sized as EAGLE-2 sizes its trees: within a pass the
rows' guesses do not depend on one another, so a pass's nodes are the product of its rows' ``top_k``
guesses (grown level by level from the likeliest nodes), and the ``top_k`` likeliest complete blocks are
fed back together, each on its own path, in one head call.  "Likely" is the product of the head's
calibrated probabilities along the path (:mod:`specdecode.drafters._tree_size`); the best nodes of the
whole tree are verified, with prompt lookup's continuation grafted on as one more branch (``lookup``, as for
EAGLE).  Sampled requests (and greedy ones with ``tree_nodes=0``) draft a chain, every token sampled from its
row's distribution — which is the distribution it was drawn from, returned with the draft, so rejection
sampling stays exact.  Tokens outside the head's draft vocabulary are never drafted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from specdecode.drafters import register_drafter
from specdecode.drafters._head_session import HeadSession
from specdecode.drafters._lookup_graft import Copy, LookupBranch, NodeSources
from specdecode.drafters._tree_size import Calibration, TreeBudget, check_tree_nodes, subtree
from specdecode.drafters._vocab import choose_from_subset
from specdecode.drafters.base import Drafter, DraftRequest, flag_option
from specdecode.errors import SpecDecodeError
from specdecode.heads.eagle import HeadCache
from specdecode.heads.falcon import HEAD_DIR, FalconHead, load_falcon
from specdecode.heads.storage import head_for_drafter
from specdecode.models.base import HiddenStates, require_capability
from specdecode.models.loading import LoadedModel
from specdecode.types import Draft

#: A step's drafting and bookkeeping in units of a one-token target forward, for sizing trees: EAGLE's
#: (its head is the same layer), which Falcon's fewer passes can only lower.
DRAFT_SHARE = 0.3


@register_drafter("falcon")
class FalconDrafter(Drafter):
    """Falcon semi-autoregressive head: k tokens per pass over the target's features; block trees (needs training)."""

    provides_probs = True
    needs_training: ClassVar[bool] = True

    def __init__(
        self,
        target: LoadedModel,
        head: str | FalconHead | None = None,
        top_k: int = 4,
        tree_nodes: int | str = "auto",
        lookup: bool | str = True,
        int8_head: bool | str = True,
    ) -> None:
        super().__init__(target)
        self.backend = require_capability(target.backend, HiddenStates, "drafter 'falcon'")
        if not isinstance(top_k, int) or top_k < 1:
            raise SpecDecodeError(f"falcon: top-k must be a positive integer, got {top_k!r}")
        tree_nodes = check_tree_nodes("falcon", tree_nodes)
        int8_head = flag_option("falcon: int8_head", int8_head)
        self.head = head_for_drafter(
            "falcon",
            head,
            FalconHead,
            load_falcon,
            HEAD_DIR,
            self.backend,
            target.backend.vocab_size,
            target.name,
            int8_head,
        )
        self.target_ids = self.head.target_ids.to(self.backend.device)
        self.top_k = min(top_k, self.head.config.draft_vocab_size)
        self.budget = TreeBudget(target.backend, tree_nodes, DRAFT_SHARE)
        self.calibration = Calibration()
        self.lookup = LookupBranch("falcon", lookup)

    def session(self, request: DraftRequest) -> FalconSession:
        return FalconSession(self, request)


@dataclass
class _Pass:
    """One head pass of a tree: its outputs [block, H], row r predicting the token at ``first`` + r."""

    outputs: torch.Tensor
    first: int  # context index (position) of the token its row 0 predicts
    slots: list[int] = field(default_factory=list)  # head cache entries on its path, beyond the committed context


@dataclass
class _Node:
    token: int  # target id
    parent: int  # index in the tree's node list, -1 for children of the context
    score: float  # calibrated probability that verification accepts the whole path to this node
    confidence: float | None = None  # the head's probability of it (None: only the lookup drafted it)
    source: int = -1  # the pass whose row ``row`` predicted it (-1: only the lookup drafted it)
    row: int = -1


class FalconSession(HeadSession):
    """One request: the head's cache of it, the target features not yet fed, and the last committed block's
    features and outputs (fed again when new rows join that block; the outputs start every draft)."""

    def __init__(self, drafter: FalconDrafter, request: DraftRequest) -> None:
        self.drafter = drafter
        self.head = drafter.head
        self.block = self.head.config.block
        self.backend = drafter.backend
        self.hidden_layers = self.head.config.aux_layers
        self.sampling = request.sampling
        self.request = request
        self.generator = request.torch_generator()
        self.vocab_size = self.head.config.target_vocab_size
        self.cache = HeadCache(self.head.config, self.backend.device, self.backend.dtype)
        self.committed = 0  # head cache rows holding true pairs (target feature j, token j + 1)
        self.pending: list[torch.Tensor] = []  # target features of the rows after those
        self.tail: torch.Tensor | None = None  # the target features of the last ``block`` committed rows
        self._root: torch.Tensor | None = None  # the head's outputs at the last committed block
        self.sources = NodeSources()  # of the last greedy draft

    def _catch_up(self, context: list[int]) -> torch.Tensor | None:
        """Feed every row whose target feature is now known (all but the last context token) and return the
        head's outputs at the last ``block`` rows, which predict the next ``block`` tokens (None while fewer
        rows are known).  Those rows must see one another, so the ones fed in an earlier step are fed again."""
        self.cache.crop(self.committed)  # last step's draft entries were built on guesses
        known = len(context) - 1
        features = torch.cat(self.pending) if self.pending else None
        self.pending = []
        if features is None or features.shape[0] == 0:
            return self._root if known == self.committed else None
        if self.committed + features.shape[0] != known:
            raise RuntimeError(f"falcon: {self.committed} + {features.shape[0]} features for {known} rows")
        start = max(0, min(self.committed, known - self.block))  # re-fed from the tail: its rows are committed
        if start < self.committed:
            features = torch.cat([self.tail[start - self.committed :], features])
        self.cache.crop(start)
        device = self.backend.device
        tokens = torch.tensor(context[start + 1 :], dtype=torch.long, device=device)
        positions = torch.arange(start + 1, known + 1, device=device)
        # One layer: a row's keys and values are its inputs' alone, so every new row may see all the others
        # (the mask changes only outputs, and only the last block's are read: they must see the whole context).
        sees_all = torch.ones(features.shape[0], known, dtype=torch.bool, device=device)
        out = self.head.extend(self.head.fuse(features), self.backend.embed(tokens), positions, self.cache, sees_all)
        self.tail = features[-self.block :]
        self.committed = known
        self._root = out[-self.block :] if known >= self.block else None
        return self._root

    def _feed(self, outputs: torch.Tensor, tokens: list[list[int]], first: int, slots: list[list[int]]) -> torch.Tensor:
        """One head call over blocks (each its tokens [block] with the outputs [n, block, H] that predicted
        them, the first at position ``first``): each block sees the committed context, the cache entries
        ``slots`` of its path and itself; returns the new outputs [n, block, H], appended to the cache."""
        device, n, block = self.backend.device, len(tokens), self.block
        past = self.cache.length
        mask = torch.zeros(n * block, past + n * block, dtype=torch.bool, device=device)
        mask[:, : self.committed] = True
        for index, path in enumerate(slots):
            rows = slice(index * block, (index + 1) * block)
            mask[rows, path] = True
            mask[rows, past + index * block : past + (index + 1) * block] = True
        ids = torch.tensor(tokens, dtype=torch.long, device=device).flatten()
        positions = torch.arange(first, first + block, device=device).repeat(n)
        hidden = self.head.fuse(outputs.flatten(0, 1))
        return self.head.extend(hidden, self.backend.embed(ids), positions, self.cache, mask).unflatten(0, (n, block))

    def _chain(self, root: torch.Tensor, length: int, max_tokens: int) -> Draft:
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        confidence: list[float] = []
        outputs = root
        while True:
            logits = self.head.logits(outputs)
            block: list[int] = []
            for row in range(self.block):
                token, conf, probs = choose_from_subset(
                    logits[row], self.drafter.target_ids, self.vocab_size, self.sampling, self.generator
                )
                if probs is not None:
                    rows.append(probs)
                tokens.append(token)
                block.append(token)
                confidence.append(conf)
                if len(tokens) == max_tokens or self.request.stop(confidence):
                    return Draft(tokens, probs=torch.stack(rows) if rows else None, confidence=confidence)
            first = length + len(tokens) - self.block
            outputs = self._feed(outputs[None], [block], first, [list(range(self.committed, self.cache.length))])[0]

    def _tree(self, root: torch.Tensor, length: int, max_depth: int, copy: Copy) -> Draft:
        top_k, budget = self.drafter.top_k, self.drafter.budget
        passes = [_Pass(root, length)]
        nodes: list[_Node] = []
        frontier = self._children([(-1, 0, 0)], passes, nodes, depth=1)
        # Grafted before the head grows its tree, so that the budget weighs the head's nodes against the lookup's.
        # The lookup's own nodes cannot be expanded: the head never predicted them.
        grafted = self.drafter.lookup.graft_nodes(copy, nodes, lambda token, parent, score: _Node(token, parent, score))
        for depth in range(1, max_depth):
            expand = budget.worth_expanding([node.score for node in nodes], frontier, top_k, length)
            if not expand:
                break  # no node the budget would verify: its children would not be verified either
            # The nodes of one depth share their row in their pass.
            if nodes[expand[0]].row + 1 < self.block:  # within a pass: the next row's guesses, no head call
                growing = [(index, nodes[index].source, nodes[index].row + 1) for index in expand]
            else:  # a complete block: fed back, all together
                growing = self._expand(expand, passes, nodes)
            frontier = self._children(growing, passes, nodes, depth=depth + 1)
        order = budget.best_nodes([n.parent for n in nodes], [n.score for n in nodes], length)
        self.sources, confidence = NodeSources.of_tree(order, [n.confidence for n in nodes], grafted)
        return subtree(order, [n.token for n in nodes], [n.parent for n in nodes], confidence)

    def _expand(self, expand: list[int], passes: list[_Pass], nodes: list[_Node]) -> list[tuple[int, int, int]]:
        """Feed the complete blocks ending at nodes ``expand`` (all of one pass depth) in one head call; returns
        (node, new pass, row 0) for each, the row whose guesses are its children."""
        blocks, sources = [], []
        for index in expand:
            path, node = [], index
            for _ in range(self.block):
                path.append(nodes[node].token)
                node = nodes[node].parent
            blocks.append(path[::-1])
            sources.append(passes[nodes[index].source])
        first = sources[0].first
        outputs = torch.stack([source.outputs for source in sources])
        past = self.cache.length
        fed = self._feed(outputs, blocks, first, [source.slots for source in sources])
        growing = []
        for row, (index, source) in enumerate(zip(expand, sources)):
            own = list(range(past + row * self.block, past + (row + 1) * self.block))
            passes.append(_Pass(fed[row], first + self.block, [*source.slots, *own]))
            growing.append((index, len(passes) - 1, 0))
        return growing

    def _children(
        self, growing: list[tuple[int, int, int]], passes: list[_Pass], nodes: list[_Node], depth: int
    ) -> list[int]:
        """Add the ``top_k`` likeliest tokens of row ``row`` of pass ``source`` under each (parent, source, row)
        (parent -1: the context), all through one LM head call."""
        hidden = torch.stack([passes[source].outputs[row] for _, source, row in growing])
        logprobs, ids = torch.log_softmax(self.head.logits(hidden), dim=-1).topk(self.drafter.top_k, dim=-1)
        tokens = self.drafter.target_ids[ids].tolist()
        known = {(node.parent, node.token): index for index, node in enumerate(nodes)}
        calibrated = self.drafter.calibration
        added = []
        for (parent, source, row), row_logprobs, row_tokens in zip(growing, logprobs.tolist(), tokens):
            base = nodes[parent].score if parent >= 0 else 1.0
            for logprob, token in zip(row_logprobs, row_tokens):
                confidence = math.exp(logprob)
                score = base * calibrated(confidence, depth)
                index = known.get((parent, token))
                if index is None:  # new
                    added.append(len(nodes))
                    nodes.append(_Node(token, parent, score, confidence, source, row))
                else:  # the lookup drafted it already: now the head has too
                    node = nodes[index]
                    node.score, node.confidence, node.source, node.row = max(node.score, score), confidence, source, row
                    added.append(index)
        return added
