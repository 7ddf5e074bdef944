"""Medusa: K trained heads on the target's last final hidden state, a tree from the heads' own confidences.

After Cai et al., "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding Heads"
(2024).  The session keeps one vector: the target's final hidden state of the last position whose
feature is known (the verification forward hands it over, ``hidden_layers``, at no extra forward) — the
one the target's LM head turned into the last context token.  Head k reads it and guesses the token k
positions after that one (:mod:`specdecode.heads.medusa`); all heads run in one call per step.  Heads with
Hydra++'s prefix attention read its output instead, the session sliding its window of keys along (the states of
the tokens verification accepted go through it as they come: one small layer on a few rows per step).

Greedy requests verify a tree: best-first over the Cartesian product of each head's ``top_k`` guesses,
scored by the product of the heads' probabilities, each calibrated online per head against what
verification accepted (:mod:`specdecode.drafters._tree_size`).  A prefix scores at least as high as its
extensions, so the best nodes form a tree — Medusa's tree, chosen per step from the heads' confidences
instead of a static one calibrated offline — and with ``tree_nodes=auto`` (the default) it holds as many
nodes as pay for their verification, none when no guess does (heads trained on a CPU budget are
overconfident: a fixed 16-node tree is slower than plain decoding on SmolLM2-135M).  Sampled requests (and greedy
ones with ``tree_nodes=0``) draft a chain, one token sampled from each head's processed distribution
over the full vocabulary (zero outside the draft vocabulary), returned with the draft so rejection
sampling stays exact.  Tokens outside the draft vocabulary are never drafted: that cannot change output.

:mod:`specdecode.drafters.hydra` shares the session's bookkeeping, with sequentially dependent heads.
"""

from __future__ import annotations

import heapq
from abc import abstractmethod
from typing import ClassVar

import torch

from specdecode.drafters import register_drafter
from specdecode.drafters._lookup_graft import Copy, LookupBranch, NodeSources, copy_draft
from specdecode.drafters._tree_size import Calibration, TreeBudget, check_tree_nodes, subtree
from specdecode.drafters._vocab import choose_from_subset
from specdecode.drafters.base import Drafter, DraftRequest, DraftSession, flag_option
from specdecode.errors import SpecDecodeError
from specdecode.heads.files import head_directory
from specdecode.heads.medusa import DraftHeads, heads_dir, load_heads
from specdecode.heads.prefix import PrefixWindow
from specdecode.heads.storage import target_mismatch, to_backend
from specdecode.models.base import HiddenStates, LayerwiseExecution, require_capability
from specdecode.models.loading import LoadedModel
from specdecode.types import Draft, StepFeedback

#: A step's drafting and bookkeeping in units of a one-token target forward, for sizing trees (the heads
#: are one small MLP each and an LM-head call over the draft vocabulary: SmolLM2's take about 2%).
DRAFT_SHARE = 0.05


@register_drafter("medusa")
class MedusaDrafter(Drafter):
    """Medusa heads over the target's final hidden state; a tree from the heads' top-k (needs training)."""

    provides_probs = True
    needs_training: ClassVar[bool] = True
    kind: ClassVar[str] = "medusa"

    def __init__(
        self,
        target: LoadedModel,
        heads: str | DraftHeads | None = None,
        top_k: int = 4,
        tree_nodes: int | str = "auto",
        lookup: bool | str = True,
        int8_head: bool | str = True,
    ) -> None:
        super().__init__(target)
        self.backend = require_capability(target.backend, HiddenStates, f"drafter {self.kind!r}")
        if not isinstance(top_k, int) or top_k < 1:
            raise SpecDecodeError(f"{self.kind}: top-k must be a positive integer, got {top_k!r}")
        tree_nodes = check_tree_nodes(self.kind, tree_nodes)
        loaded = heads if isinstance(heads, DraftHeads) else self._load(target, heads)
        if loaded.config.kind != self.kind:
            raise SpecDecodeError(f"drafter {self.kind!r} got {loaded.config.kind} heads")
        self._check(loaded, target)
        int8_head = flag_option(f"{self.kind}: int8_head", int8_head)
        self.heads = to_backend(loaded, self.backend.device, self.backend.dtype, int8_head)
        self.target_ids = self.heads.target_ids.to(self.backend.device)
        self.top_k = min(top_k, self.heads.config.draft_vocab_size)
        self.budget = TreeBudget(target.backend, tree_nodes, DRAFT_SHARE)
        self.calibration = Calibration()
        self.lookup = LookupBranch(self.kind, lookup)

    @classmethod
    def _load(cls, target: LoadedModel, heads: str | None) -> DraftHeads:
        return load_heads(head_directory(heads, target.name, heads_dir(cls.kind), cls.kind, "heads", "heads"), cls.kind)

    def _check(self, heads: DraftHeads, target: LoadedModel) -> None:
        """Refuse heads trained for another target: other sizes, or (when the backend exposes its LM head)
        a stored LM head that is not this target's."""
        backend = self.backend
        retrain = f"retrain with `specdecode train {self.kind} --model {target.name}`"
        mismatch = target_mismatch(heads.config, backend, target.backend.vocab_size)
        if mismatch is not None:
            (d, layers, vocab), (own_d, own_layers, own_vocab) = mismatch
            raise SpecDecodeError(
                f"{self.kind}: the heads were trained for another target (d={d}, {layers} layers, {vocab} tokens; "
                f"{target.name!r} has d={own_d}, {own_layers} layers, {own_vocab} tokens): {retrain}"
            )
        if isinstance(target.backend, LayerwiseExecution):
            own = target.backend.output_weight().index_select(0, heads.target_ids.to(backend.device))
            if not torch.allclose(own.float().cpu(), heads.lm_head.weight.float(), rtol=1e-2, atol=1e-3):
                raise SpecDecodeError(
                    f"{self.kind}: the heads were trained for another target (their LM head is not "
                    f"{target.name!r}'s): {retrain}"
                )

    def session(self, request: DraftRequest) -> MedusaSession:
        return MedusaSession(self, request)


class HeadsSession(DraftSession):
    """One request: the target's last known final hidden state, and chain drafting shared by Medusa and
    Hydra (a subclass says what a head predicts after a path, and how a tree grows)."""

    def __init__(self, drafter: MedusaDrafter, request: DraftRequest) -> None:
        self.drafter = drafter
        self.heads = drafter.heads
        self.backend = drafter.backend
        self.hidden_layers = (self.backend.num_layers,)
        self.sampling = request.sampling
        self.request = request
        self.generator = request.torch_generator()
        self.known = 0  # positions whose final hidden state the session has been given
        self.last: torch.Tensor | None = None  # [H] what the heads read of position known - 1
        # Hydra++'s prefix attention, when the heads have it, turns each final hidden state into what they read.
        self.window = PrefixWindow(self.heads.prefix) if self.heads.prefix is not None else None
        self.sources = NodeSources()  # of the last greedy draft

    def observe_prompt(self, hidden: torch.Tensor) -> None:
        self._read(hidden)

    def observe(self, context: list[int], feedback: StepFeedback) -> None:
        self.sources.learn(feedback, self.drafter.calibration, self.drafter.lookup.calibration)
        if feedback.target_hidden is not None:
            self._read(feedback.target_hidden[feedback.accepted_rows])

    @torch.inference_mode()
    def _read(self, hidden: torch.Tensor) -> None:
        """The final hidden states [n, H] of the next ``n`` positions."""
        if self.window is not None:
            hidden = self.window.extend(hidden)
        self.last, self.known = hidden[-1], self.known + hidden.shape[0]

    @torch.inference_mode()
    def propose(self, context: list[int], max_tokens: int) -> Draft:
        self.sources = NodeSources()
        tree = self.sampling.greedy and self.drafter.budget.drafts_trees
        copy = self.drafter.lookup.copy(context, max_tokens) if tree and max_tokens > 0 else Copy()
        if self.drafter.lookup.alone(copy):
            self.sources = NodeSources.of_copy(copy)
            return copy_draft(copy)
        depth = min(max_tokens, self.heads.config.num_heads)
        if self.last is None or depth <= 0 or self.known != len(context) - 1:
            return Draft(tokens=[])  # no feature of the position before the last token: nothing to draft from
        self._start(context, depth)
        if tree:
            return self._tree(depth, copy, len(context))
        return self._chain(depth)

    def _start(self, context: list[int], depth: int) -> None:
        """Prepare a step's drafting, ``depth`` deep (after ``self.last`` is current)."""

    @abstractmethod
    def _head_logits(self, k: int, paths: list[list[int]]) -> torch.Tensor:
        """Head ``k``'s draft-vocabulary logits [len(paths), draft_vocab] after each path of k draft tokens."""

    @abstractmethod
    def _tree(self, depth: int, copy: Copy, context_tokens: int) -> Draft:
        """A greedy request's draft tree, the heads' nodes at most ``depth`` deep, with ``copy`` grafted on, sized
        for verification after ``context_tokens``."""

    def _chain(self, depth: int) -> Draft:
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        confidence: list[float] = []
        for k in range(depth):
            token, conf, probs = choose_from_subset(
                self._head_logits(k, [tokens])[0],
                self.drafter.target_ids,
                self.heads.config.target_vocab_size,
                self.sampling,
                self.generator,
            )
            if probs is not None:
                rows.append(probs)
            tokens.append(token)
            confidence.append(conf)
            if self.request.stop(confidence):
                break
        return Draft(tokens, probs=torch.stack(rows) if rows else None, confidence=confidence)


class MedusaSession(HeadsSession):
    """Medusa: every head's guess is computed at once from the one hidden state, whatever was drafted."""

    def _start(self, context: list[int], depth: int) -> None:
        outputs = torch.stack([self.heads.head(k, self.last) for k in range(depth)])
        self.logits = self.heads.logits(outputs)  # [depth, draft_vocab]: one LM-head call for all heads

    def _head_logits(self, k: int, paths: list[list[int]]) -> torch.Tensor:
        return self.logits[k].expand(len(paths), -1)

    def _tree(self, depth: int, copy: Copy, context_tokens: int) -> Draft:
        """The best paths of the heads' top-k Cartesian product, best first: a node enters when popped, and
        only then are its children (the next head's top-k) candidates; with the lookup grafted on, the budget
        keeps the best nodes."""
        logprobs, ids = torch.log_softmax(self.logits, dim=-1).topk(self.drafter.top_k, dim=-1)
        probs, tokens = logprobs.exp().tolist(), self.drafter.target_ids[ids].tolist()
        calibrated = self.drafter.calibration
        scores = [[calibrated(p, level + 1) for p in row] for level, row in enumerate(probs)]
        # Heap entries: (-path score, depth, tie-break, parent index, rank in its head's top-k).
        heap = [(-scores[0][r], 1, r, -1, r) for r in range(len(tokens[0]))]
        heapq.heapify(heap)
        out_tokens: list[int] = []
        parents: list[int] = []
        confidence: list[float] = []
        path_scores: list[float] = []
        counter = len(heap)
        while heap and len(out_tokens) < self.drafter.budget.max_nodes:
            negative, level, _, parent, rank = heapq.heappop(heap)
            index = len(out_tokens)
            out_tokens.append(tokens[level - 1][rank])
            parents.append(parent)
            confidence.append(probs[level - 1][rank])
            path_scores.append(-negative)
            if level < depth:
                for child, score in enumerate(scores[level]):
                    heapq.heappush(heap, (negative * score, level + 1, counter, index, child))
                    counter += 1
        head: list[float | None] = [*confidence]
        grafted = self.drafter.lookup.graft(copy, out_tokens, parents, path_scores)
        order = self.drafter.budget.best_nodes(parents, path_scores, context_tokens)
        head += [None] * (len(out_tokens) - len(head))
        self.sources, confidence = NodeSources.of_tree(order, head, grafted)
        return subtree(order, out_tokens, parents, confidence)
