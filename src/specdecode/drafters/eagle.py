"""EAGLE: a trained one-layer head drafts from the target's own features, as a dynamic tree.

After Li et al., EAGLE (2024), EAGLE-2 (dynamic draft trees) and EAGLE-3 (fused low/middle/high
features, training-time test).  The head (:mod:`specdecode.heads.eagle`) costs a few percent of a target
forward; it reads the features the target computed while verifying, which the engine hands over
(``hidden_layers``), so nothing runs twice.

Per step: the positions verified last step are fed to the head with their true features, in one call; its
last output predicts the first draft token. Greedy requests then grow an EAGLE-2 tree: at each depth the
``top_k`` open nodes most likely to be accepted are expanded, of those the budget would verify (one head
call per depth, each node seeing its ancestors only), each into its ``top_k`` likeliest tokens; at the end
the best nodes of the whole tree are verified (a parent is always at least as likely as its children, so
they form a tree): ``tree_nodes`` of them, or by default as many as pay for their verification cost.
"Likely" is the product of the head's probabilities along the path, each calibrated online against what
verification accepted (EAGLE-2 uses them raw; a head trained on a CPU budget is overconfident). Sampled
requests draft a chain sampled from the head's distribution (returned with the draft, so rejection sampling
stays exact); so do greedy ones with ``tree_nodes=0``. With ``samples=k`` a sampled request drafts a tree instead:
k i.i.d. draws from the head at every node, level by level while the whole next level fits ``tree_nodes`` (the
drafts SpecTr and optimal multi-draft verification are built for: ``spectr``, ``optimal-md``).  Tokens outside
the head's draft vocabulary are never drafted, which cannot change the output.

A greedy tree also gets prompt lookup's continuation as one more branch (``lookup``, on by default; see
:mod:`specdecode.drafters._lookup_graft`): the head guesses, the lookup copies, one forward verifies both.  A
lookup likely enough to be right is drafted alone, as SAM-Decoding does with a long match.

Over long contexts the head's memory and work can stay constant (``window``, after LongSpec): it keeps the first
positions and the most recent ``window`` (:class:`~specdecode.heads.eagle.HeadCache`), where the target keeps them all,
and never computes the rows of a long prompt it would drop at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from specdecode.drafters import register_drafter
from specdecode.drafters._head_session import HeadSession
from specdecode.drafters._lookup_graft import Copy, LookupBranch, NodeSources
from specdecode.drafters._tree_size import Calibration, TreeBudget, check_tree_nodes, subtree
from specdecode.drafters._vocab import choose_from_subset, subset_probs
from specdecode.drafters.base import Drafter, DraftRequest, flag_option
from specdecode.errors import SpecDecodeError
from specdecode.heads.eagle import EagleHead, HeadCache
from specdecode.heads.storage import HEAD_DIR, head_for_drafter, load_eagle
from specdecode.models.base import HiddenStates, require_capability
from specdecode.models.loading import LoadedModel
from specdecode.types import Draft

#: A step's drafting and bookkeeping in units of a one-token target forward, for sizing trees (EAGLE on
#: SmolLM2-135M spends roughly a quarter to a third of a plain step drafting).
DRAFT_SHARE = 0.3

#: The head's window by default: on smollm2-135m's long-context tasks (2k-8k tokens) the head with a window of 1,024
#: drafts as well as with the whole context and costs 1-4% of the time instead of 11-22% (0.98-0.99x plain decoding
#: end to end against 0.78-0.90x, docs/results/longctx-window-smollm2-135m/); a context shorter than the window and a
#: block is read whole either way.
DEFAULT_WINDOW = 1024


@register_drafter("eagle")
class EagleDrafter(Drafter):
    """EAGLE-3 head over the target's features; EAGLE-2 dynamic trees (needs training)."""

    provides_probs = True
    needs_training: ClassVar[bool] = True

    def __init__(
        self,
        target: LoadedModel,
        head: str | EagleHead | None = None,
        top_k: int = 4,
        tree_nodes: int | str = "auto",
        lookup: bool | str = True,
        window: int = DEFAULT_WINDOW,
        samples: int = 1,
        int8_head: bool | str = True,
    ) -> None:
        super().__init__(target)
        self.backend = require_capability(target.backend, HiddenStates, "drafter 'eagle'")
        if not isinstance(top_k, int) or top_k < 1:
            raise SpecDecodeError(f"eagle: top-k must be a positive integer, got {top_k!r}")
        if not isinstance(window, int) or isinstance(window, bool) or window < 0:
            raise SpecDecodeError(
                f"eagle: window must be 0 (the whole context) or a number of positions, got {window!r}"
            )
        if not isinstance(samples, int) or isinstance(samples, bool) or samples < 1:
            raise SpecDecodeError(f"eagle: samples must be a positive integer, got {samples!r}")
        self.window = window
        self.samples = samples
        tree_nodes = check_tree_nodes("eagle", tree_nodes)
        num_layers = target.backend.num_layers
        self.head = head_for_drafter(
            "eagle",
            head,
            EagleHead,
            lambda path: load_eagle(path, target_num_layers=num_layers),
            HEAD_DIR,
            self.backend,
            target.backend.vocab_size,
            target.name,
            flag_option("eagle: int8_head", int8_head),
        )
        self.target_ids = self.head.target_ids.to(self.backend.device)
        self.top_k = min(top_k, self.head.config.draft_vocab_size)
        self.budget = TreeBudget(target.backend, tree_nodes, DRAFT_SHARE)
        self.calibration = Calibration()
        self.lookup = LookupBranch("eagle", lookup)

    def session(self, request: DraftRequest) -> EagleSession:
        return EagleSession(self, request)


def iid_draws(probs: torch.Tensor, samples: int, generator: torch.Generator) -> torch.Tensor:
    """[n, samples] token ids: ``samples`` independent draws (with replacement) from each row of ``probs``."""
    return torch.multinomial(probs, samples, replacement=True, generator=generator)


@dataclass
class _Node:
    token: int  # target id
    parent: int  # index in the tree's node list, -1 for children of the context
    score: float  # calibrated probability that verification accepts the whole path to this node
    confidence: float | None = None  # the head's probability of it given the parent (None: only the lookup drafted it)
    source: torch.Tensor | None = None  # [H] the head output that predicted it (its input feature when expanded)
    slot: int = -1  # head cache position once expanded


class EagleSession(HeadSession):
    """One request: the head's cache of it and the target features not yet fed to the head."""

    def __init__(self, drafter: EagleDrafter, request: DraftRequest) -> None:
        self.drafter = drafter
        self.head = drafter.head
        self.backend = drafter.backend
        self.hidden_layers = self.head.config.aux_layers
        self.sampling = request.sampling
        self.request = request
        self.generator = request.torch_generator()
        self.cache = HeadCache(self.head.config, self.backend.device, self.backend.dtype, drafter.window)
        self.committed = 0  # context positions fed to the head as true pairs (target feature j, token j + 1)
        self.pending: list[torch.Tensor] = []  # target features of the positions after those
        self._last: torch.Tensor | None = None  # the head output at the last committed position
        self.sources = NodeSources()  # of the last greedy draft

    def _catch_up(self, context: list[int]) -> torch.Tensor | None:
        """Feed every position whose target feature is now known (all but the last context token) and
        return the head's output at the last one, which predicts the first draft token."""
        self.cache.crop(self.cache.committed)  # last step's draft entries were built on guesses
        known = len(context) - 1
        if not self.pending:
            return self._last if known == self.committed and known > 0 else None
        features = torch.cat(self.pending)
        self.pending = []
        if self.committed + features.shape[0] != known:
            raise RuntimeError(f"eagle: {self.committed} + {features.shape[0]} features for {known} positions")
        device = self.backend.device
        tokens = torch.tensor(context[self.committed + 1 :], dtype=torch.long, device=device)
        positions = torch.arange(self.committed + 1, known + 1, device=device)
        start, end = self.cache.unread(features.shape[0])
        if end > start:  # with a window, the rows whose entries the commit would drop at once are not computed
            kept = torch.cat([torch.arange(start), torch.arange(end, features.shape[0])]).to(device)
            features, tokens, positions = features[kept], tokens[kept], positions[kept]
        out = self.head.extend(self.head.fuse(features), self.backend.embed(tokens), positions, self.cache)
        self.cache.commit(compact=end > start)
        self.committed = known
        self._last = out[-1]
        return self._last

    def _distribution(self, hidden: torch.Tensor) -> torch.Tensor:
        """Log-probabilities over the draft vocabulary [..., draft_vocab]."""
        return torch.log_softmax(self.head.logits(hidden), dim=-1)

    def _chain(self, hidden: torch.Tensor, length: int, max_tokens: int) -> Draft:
        if self.drafter.samples > 1 and not self.sampling.greedy:
            return self._sampled_tree(hidden, length, max_tokens)
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        confidence: list[float] = []
        for depth in range(max_tokens):
            token, conf, probs = choose_from_subset(
                self.head.logits(hidden), self.drafter.target_ids, self.backend_vocab, self.sampling, self.generator
            )
            if probs is not None:
                rows.append(probs)
            tokens.append(token)
            confidence.append(conf)
            if depth + 1 == max_tokens or self.request.stop(confidence):
                break
            embeds = self.backend.embed(torch.tensor([token], device=hidden.device))
            position = torch.tensor([length + depth], device=hidden.device)
            hidden = self.head.extend(hidden[None], embeds, position, self.cache)[0]
        return Draft(tokens, probs=torch.stack(rows) if rows else None, confidence=confidence)

    def _sampled_tree(self, root: torch.Tensor, length: int, max_depth: int) -> Draft:
        """``samples`` i.i.d. draws from the head's distribution under every node, one head call per level; every
        sibling reports the same distribution row, which is what tells the verifier that they are i.i.d."""
        samples, max_nodes = self.drafter.samples, self.drafter.budget.max_nodes
        nodes: list[_Node] = []
        rows: list[torch.Tensor] = []
        parents, outputs = [-1], root[None]
        for depth in range(1, max_depth + 1):
            if len(nodes) + len(parents) * samples > max_nodes and nodes:
                break
            logits = self.head.logits(outputs).float()
            probs = subset_probs(logits, self.drafter.target_ids, self.backend_vocab, self.sampling).cpu()
            draws = iid_draws(probs, samples, self.generator).tolist()
            level = []
            for row, parent in enumerate(parents):
                for token in draws[row]:
                    level.append(len(nodes))
                    rows.append(probs[row])
                    nodes.append(_Node(token, parent, 1.0, float(probs[row, token]), outputs[row]))
            if depth == max_depth:
                break
            outputs = self._expand(level, nodes, length + depth - 1)
            parents = level
        return Draft(
            [n.token for n in nodes],
            probs=torch.stack(rows),
            parents=[n.parent for n in nodes],
            confidence=[n.confidence for n in nodes],
        )

    @property
    def backend_vocab(self) -> int:
        return self.head.config.target_vocab_size

    def _tree(self, root: torch.Tensor, length: int, max_depth: int, copy: Copy) -> Draft:
        top_k = self.drafter.top_k
        nodes: list[_Node] = []
        frontier = self._children(root[None], [-1], nodes, depth=1)
        # Grafted before the head grows its tree, so that the budget weighs the head's nodes against the lookup's.
        # The lookup's own nodes cannot be expanded: the head never predicted them.
        grafted = self.drafter.lookup.graft_nodes(copy, nodes, _Node)
        budget = self.drafter.budget
        for depth in range(1, max_depth):
            expand = budget.worth_expanding([node.score for node in nodes], frontier, top_k, length)
            if not expand:
                break  # no node the budget would verify: its children would not be verified either
            outputs = self._expand(expand, nodes, length + depth - 1)
            frontier = self._children(outputs, expand, nodes, depth=depth + 1)
        order = budget.best_nodes([n.parent for n in nodes], [n.score for n in nodes], length)
        self.sources, confidence = NodeSources.of_tree(order, [n.confidence for n in nodes], grafted)
        return subtree(order, [n.token for n in nodes], [n.parent for n in nodes], confidence)

    def _children(self, hidden: torch.Tensor, parents: list[int], nodes: list[_Node], depth: int) -> list[int]:
        """Add the ``top_k`` likeliest continuations of each parent (its head output a row of ``hidden``
        [n, H]; -1: the context), all through one LM head call."""
        logprobs, ids = self._distribution(hidden).topk(self.drafter.top_k, dim=-1)
        tokens = self.drafter.target_ids[ids].tolist()
        known = {(node.parent, node.token): index for index, node in enumerate(nodes)}
        calibrated = self.drafter.calibration
        added = []
        for row, parent in enumerate(parents):
            base = nodes[parent].score if parent >= 0 else 1.0
            for logprob, token in zip(logprobs[row].tolist(), tokens[row]):
                confidence = math.exp(logprob)
                score = base * calibrated(confidence, depth)
                index = known.get((parent, token))
                if index is None:  # new
                    added.append(len(nodes))
                    nodes.append(_Node(token, parent, score, confidence, hidden[row]))
                else:  # the lookup drafted it already: now the head has too
                    node = nodes[index]
                    node.score, node.confidence, node.source = max(node.score, score), confidence, hidden[row]
                    added.append(index)
        return added

    def _expand(self, expand: list[int], nodes: list[_Node], position: int) -> torch.Tensor:
        """One head call over nodes of one depth: each is fed (its predictor's output, its token) at
        ``position`` and sees the committed context and its own ancestors only; returns their outputs [n, H]."""
        device = self.backend.device
        past, n = self.cache.length, len(expand)
        mask = torch.zeros(n, past + n, dtype=torch.bool, device=device)
        mask[:, : self.cache.committed] = True
        for row, index in enumerate(expand):
            nodes[index].slot = past + row
            ancestor = index
            while ancestor >= 0:
                mask[row, nodes[ancestor].slot] = True
                ancestor = nodes[ancestor].parent
        hidden = torch.stack([nodes[i].source for i in expand])
        tokens = torch.tensor([nodes[i].token for i in expand], dtype=torch.long, device=device)
        positions = torch.full((n,), position, dtype=torch.long, device=device)
        return self.head.extend(hidden, self.backend.embed(tokens), positions, self.cache, mask)
