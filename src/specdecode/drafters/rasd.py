"""RASD (Quan et al., "RASD: Retrieval-Augmented Speculative Decoding", 2025): drafts retrieved from a datastore,
fused with another drafter's tree for one verification.

A draft model or a trained head guesses what it learned; a datastore — a code base, documentation, earlier
answers — holds what the answer will copy, which no prompt contains.  RASD retrieves, for the context's longest
suffix found in the datastore, every continuation that followed it there and how often, grows a retrieval tree from
those counts, prunes it, and fuses it with the other drafter's tree by longest prefix matching: a retrieved path that
begins like a drafted one shares its nodes, and only what differs adds width to the verification forward.

``--drafter rasd --drafter-option datastore=PATH [--drafter-option with=NAME]``: PATH is a directory of text files or
a JSON Lines file of ``{"text": ...}`` objects, tokenized with the target's tokenizer and indexed once
(:mod:`specdecode.data.datastore`: a suffix array, cached on disk, incremental).  ``with`` names the drafter whose
tree the retrieval joins (default ``suffix``, which copies from the request itself and earlier outputs, what the
datastore lacks, and beat ``pld`` there on code and on open chat: ``docs/drafters.md``; ``none`` for retrieval alone;
``draft-model``, ``hsd`` with ``--draft-model``; ``eagle`` with its trained head); the options rasd does not take are
that drafter's (``--drafter-option heads=DIR`` with ``with=hydra``).

Pruning.  The paper prunes the retrieval tree with the draft model's distribution.  A drafter here exposes only its
drafted nodes' confidences, so each retrieved node is scored by its share of the occurrences that continue its
parent, discounted by how many tokens the match rests on (prompt lookup's measured reliability of a match length),
and calibrated online per depth against what verification accepted; the retrieved nodes then join the other
drafter's, best first, as many as pay for their width on the target's measured cost curve.  A retrieval likely enough
to be right is drafted alone, without asking the other drafter (SAM-Decoding's rule, as for the heads' lookup).

Lossless.  The other drafter's nodes come first, unchanged, with the distributions they were sampled from; the
retrieved nodes follow them as later siblings, point masses chosen from the context and the datastore alone, so
recursive rejection sampling stays exact (``verify/rejection.py``), and greedy verification keeps the target's own
tokens whatever is drafted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from specdecode.data.datastore import Datastore
from specdecode.drafters import accepted_options, create_drafter, drafter_class, register_drafter
from specdecode.drafters._lookup_graft import COPY_ALONE
from specdecode.drafters._ngram_tree import Transcript, check_fraction, check_int, grow_tree
from specdecode.drafters._tree_size import Calibration, TreeBudget
from specdecode.drafters.base import Drafter, DraftRequest, DraftSession
from specdecode.drafters.pld import match_confidence
from specdecode.errors import SpecDecodeError
from specdecode.models.loading import LoadedModel
from specdecode.types import Draft, StepFeedback

#: A match followed by more occurrences than this predicts too little to be worth reading them all.
MAX_OCCURRENCES = 1 << 15

#: (suffix array range start, end, tokens matched): where a retrieval tree node stands in the datastore.
Range = tuple[int, int, int]


@register_drafter("rasd")
class RetrievalDrafter(Drafter):
    """RASD: retrieval from a datastore by the context's suffix, fused with another drafter's tree (needs datastore=).

    Options: ``datastore`` (required) a directory of text files or a ``.jsonl`` file of ``{"text": ...}`` objects;
    ``with`` (suffix) the drafter whose tree the retrieval joins (``none``: retrieval alone; in Python also a drafter
    built with its own options); ``draft_model`` for a ``with`` that takes one; ``max_nodes`` (16) retrieved nodes
    grown per step, before the budget prunes them; ``min_match`` (2) and ``max_match`` (32) the shortest suffix of
    the context retrieved by and the longest one searched for after a mismatch (a match that keeps extending grows
    past it); ``min_prob`` (0.1) least estimated path probability of a retrieved node.  Any other option is the
    ``with`` drafter's, passed on to it (``rasd:datastore=D:with=hydra:heads=DIR``)."""

    passes_options_to = "with"

    def __init__(
        self,
        target: LoadedModel,
        datastore: str | None = None,
        with_: str | Drafter = "suffix",
        draft_model: str | LoadedModel | None = None,
        max_nodes: int = 16,
        min_match: int = 2,
        max_match: int = 32,
        min_prob: float = 0.1,
        **with_options: Any,
    ) -> None:
        super().__init__(target)
        if datastore is None:
            raise SpecDecodeError(
                "drafter 'rasd' needs --drafter-option datastore=PATH (a directory of text files or a .jsonl file "
                'of {"text": ...} lines)'
            )
        self.max_nodes = check_int("rasd", "max_nodes", max_nodes, 1)
        self.min_match = check_int("rasd", "min_match", min_match, 1)
        self.max_match = check_int("rasd", "max_match", max_match, self.min_match)
        self.min_prob = check_fraction("rasd", "min_prob", min_prob)
        self.inner = self._inner(target, with_, draft_model, with_options)
        self.store = Datastore.open(str(datastore), target.tokenizer)
        self.budget = TreeBudget(target.backend, "auto", draft_share=0.0)
        self.budget.verification_cost(1)  # measured now (once per model), not inside a step whose drafting is timed
        self.calibration = Calibration()
        # What the engine and the draft-length policy know of a drafter is the other drafter's: it does the work.
        self.provides_probs = self.inner.provides_probs
        self.reads_context = self.inner.reads_context
        self.works_between_steps = self.inner.works_between_steps

    @staticmethod
    def _inner(
        target: LoadedModel, joined: str | Drafter, draft_model: str | LoadedModel | None, options: dict[str, Any]
    ) -> Drafter:
        """The drafter named by ``with`` (built with ``draft_model`` where it takes one, and the options rasd does not
        take), or the one given."""
        if isinstance(joined, RetrievalDrafter) or joined == "rasd":
            raise SpecDecodeError("rasd: with= names another drafter, not rasd")
        if isinstance(joined, Drafter):
            if draft_model is not None or options:
                raise SpecDecodeError("rasd: a drafter given as with= comes with its own draft model and options")
            return joined
        name = str(joined)
        drafter_class(name)  # an unknown name fails with the list of drafters
        if draft_model is not None and "draft_model" not in accepted_options(name):
            raise SpecDecodeError(f"rasd: a draft model is for with=draft-model or with=hsd, not with={name}")
        return create_drafter(name, target, draft_model=draft_model, **options)

    def draft_token_seconds(self) -> float | None:
        return self.inner.draft_token_seconds()

    def draft_token_share(self) -> float | None:
        return self.inner.draft_token_share()

    def acceptance_prior(self) -> float | None:
        return self.inner.acceptance_prior()

    def prepare(self) -> bool:
        return self.inner.prepare()

    def reading_cost(self) -> float | None:
        return self.inner.reading_cost()

    def reset(self) -> None:
        self.inner.reset()
        self.calibration = Calibration()

    def session(self, request: DraftRequest) -> RetrievalSession:
        return RetrievalSession(self, self.inner.session(request))

    def retrieve(self, match: Range, max_depth: int) -> tuple[Draft, list[float]]:
        """The retrieval tree below ``match`` (best first, each node's confidence given its parent) and each node's
        calibrated chance of being reached."""
        vocab = self.target.backend.vocab_size

        def expand(state: Range, floor: float) -> list[tuple[int, float, Range]]:
            low, high, matched = state
            if high - low > MAX_OCCURRENCES:
                return []
            found = self.store.continuations(low, high, matched)
            total = sum(count for _, count, _, _ in found)
            reliability = match_confidence(matched)
            children = []
            for token, count, start, end in found:
                chance = reliability * count / total
                if chance >= floor and token < vocab:
                    children.append((token, chance, (start, end, matched + 1)))
            return children

        tree = grow_tree(match, expand, self.max_nodes, max_depth, self.min_prob).draft
        reach: list[float] = []
        for node, (parent, depth) in enumerate(zip(tree.parent_list, tree.depths())):
            chance = self.calibration(tree.confidence[node], depth)  # type: ignore[index]
            reach.append(chance * (reach[parent] if parent >= 0 else 1.0))
        return tree, reach

    def paying(self, inner: Draft, reach: Sequence[float], new: Sequence[bool], context_tokens: int = 0) -> int:
        """How many of the retrieved nodes (best first; ``new``: not drafted by the other drafter too) to add to
        ``inner``: the count with the most expected tokens per unit of the target's verification cost after
        ``context_tokens``."""
        gain = 1.0 + _expected_tokens(inner)
        width = len(inner.tokens) + 1
        best, best_rate = 0, gain / self.budget.verification_cost(width, context_tokens)
        for count, (chance, fresh) in enumerate(zip(reach, new), start=1):
            gain += chance if fresh else 0.0
            width += fresh
            rate = gain / self.budget.verification_cost(width, context_tokens)
            if rate > best_rate:
                best, best_rate = count, rate
        return best


def _expected_tokens(draft: Draft) -> float:
    """Tokens a draft is expected to have accepted by its own confidences (0 where it gives none)."""
    if draft.confidence is None:
        return 0.0
    reach: list[float] = []
    for node, parent in enumerate(draft.parent_list):
        reach.append(draft.confidence[node] * (reach[parent] if parent >= 0 else 1.0))
    return sum(reach)


@dataclass
class Fused:
    """A step's draft and where its nodes came from: the other drafter's draft (its nodes first, in its order;
    None where it was not asked) and the retrieval's confidence in each node it drafted."""

    draft: Draft
    inner: Draft | None
    retrieved: dict[int, float]

    def locate(self, verified: Draft) -> list[int]:
        """The node of this draft that each node of ``verified`` is: the engine verifies a draft as proposed or
        cut (by depth, at its end), so its nodes are these in order."""
        tokens, parents = self.draft.tokens, self.draft.parent_list
        found: list[int] = []
        node = 0
        for token, parent in zip(verified.tokens, verified.parent_list):
            want = found[parent] if parent >= 0 else -1
            while tokens[node] != token or parents[node] != want:
                node += 1
            found.append(node)
            node += 1
        return found


def fuse(inner: Draft, tree: Draft, order: Sequence[int]) -> tuple[Draft, dict[int, float], list[bool]]:
    """``inner`` with the retrieved nodes ``order`` (of ``tree``; each after its parent) merged in by longest prefix
    matching: a node ``inner`` has already is shared, any other appended after every node of ``inner``, in ``order``,
    as a point mass.  Returns the draft, the retrieval's confidence in each of its nodes, and whether each node of
    ``order`` was appended."""
    tokens, parents = list(inner.tokens), list(inner.parent_list)
    index = {(parent, token): node for node, (parent, token) in enumerate(zip(parents, tokens))}
    placed: dict[int, int] = {}
    retrieved: dict[int, float] = {}
    appended: list[bool] = []
    for node in order:
        parent = placed[tree.parent_list[node]] if tree.parent_list[node] >= 0 else -1
        key = (parent, tree.tokens[node])
        appended.append(key not in index)
        if appended[-1]:
            index[key] = len(tokens)
            tokens.append(tree.tokens[node])
            parents.append(parent)
        placed[node] = index[key]
        retrieved[index[key]] = tree.confidence[node]  # type: ignore[index]
    added = len(tokens) - len(inner.tokens)
    if not added:
        return inner, retrieved, appended
    probs = inner.probs
    if probs is not None:
        probs = torch.cat([probs, point_masses(tokens[len(inner.tokens) :], probs)])
    return Draft(tokens, probs, parents, setup_s=inner.setup_s), retrieved, appended


def point_masses(tokens: list[int], like: torch.Tensor) -> torch.Tensor:
    """The distributions retrieved ``tokens`` were drawn from, as rows like ``like``'s: each a point mass on its
    token, which it was chosen without drawing anything."""
    rows = torch.zeros(len(tokens), like.shape[1], dtype=like.dtype, device=like.device)
    rows[torch.arange(len(tokens)), torch.tensor(tokens)] = 1.0
    return rows


class RetrievalSession(DraftSession):
    """One request: where its context's suffix stands in the datastore, and the other drafter's session."""

    def __init__(self, drafter: RetrievalDrafter, inner: DraftSession) -> None:
        self.drafter = drafter
        self.inner = inner
        self.hidden_layers = inner.hidden_layers
        self.reads_target_logits = inner.reads_target_logits
        self._transcript = Transcript()
        self._match: Range | None = None  # the longest suffix of the context found: (start, end, length)
        self._last: Fused | None = None

    def _follow(self, context: list[int]) -> Range:
        """The datastore range of the context's longest suffix that occurs, extended token by token while the
        context goes on copying, searched for again (up to ``max_match`` tokens) where it stops."""
        drafter, store = self.drafter, self.drafter.store
        new = self._transcript.advance(context)
        if new is None:
            self._transcript, self._match = Transcript(context), None
        else:
            for token in new:
                if self._match is None:
                    break
                start, end, length = self._match
                start, end = store.narrow(start, end, length, token)
                self._match = (start, end, length + 1) if start < end and length > 0 else None
        if self._match is None:
            length, start, end = store.longest_suffix(context, drafter.min_match, drafter.max_match)
            self._match = (start, end, length)
        return self._match

    def propose(self, context: list[int], max_tokens: int) -> Draft:
        drafter = self.drafter
        match = self._follow(context)
        if match[2] > 0 and max_tokens > 0:
            tree, reach = drafter.retrieve(match, max_tokens)
        else:
            tree, reach = Draft(tokens=[], confidence=[]), []
        alone = bool(reach) and reach[0] >= COPY_ALONE and drafter.inner.drafts
        inner = Draft(tokens=[]) if alone else self.inner.propose(context, max_tokens)
        order = sorted(range(len(reach)), key=lambda node: -reach[node])  # parents first: a child is never likelier
        fused, retrieved, appended = fuse(inner, tree, order)
        # A chain passes whole, as the other drafters' do: its depth is the draft-length policy's to choose.
        paying = (
            len(order)
            if fused.is_chain
            else drafter.paying(inner, [reach[node] for node in order], appended, len(context))
        )
        size = len(inner.tokens) + sum(appended[:paying])  # the appended nodes that pay are the first appended
        draft = fused.keep(list(range(size))) if size > len(inner.tokens) else inner
        retrieved = {node: confidence for node, confidence in retrieved.items() if node < size}
        self._last = Fused(draft, None if alone else inner, retrieved)
        return draft

    def observe(self, context: list[int], feedback: StepFeedback) -> None:
        last, self._last = self._last, None
        if last is None or not feedback.asked:  # not this step's own draft: nothing to learn of it
            self.inner.observe(context, feedback)
            return
        verified, path = feedback.draft, feedback.path
        nodes = last.locate(verified)
        self.drafter.calibration.learn(verified, path, [last.retrieved.get(node) for node in nodes])
        self.inner.observe(context, _inner_feedback(feedback, last.inner, nodes))

    def observe_prompt(self, hidden: torch.Tensor) -> None:
        self.inner.observe_prompt(hidden)

    def finish(self, context: list[int]) -> None:
        self.inner.finish(context)


def _inner_feedback(feedback: StepFeedback, inner: Draft | None, nodes: list[int]) -> StepFeedback:
    """What the other drafter's session learns of a step: its own draft's nodes as verified, in its own layout, when
    the accepted path ran through them alone; else (a retrieved node accepted, or it was not asked) the accepted
    tokens as a chain it did not draft (``asked=False``), whose rows still carry the target's features of them."""
    verified, path = feedback.draft, feedback.path
    own = [] if inner is None else [index for index, node in enumerate(nodes) if node < len(inner.tokens)]
    if inner is not None and set(path) <= set(own):
        position = {index: rank for rank, index in enumerate(own)}
        rows, draft = [0, *(index + 1 for index in own)], inner.keep([nodes[index] for index in own])
        return _with_rows(feedback, rows, draft, tuple(position[index] for index in path), asked=True)
    chain = Draft(tokens=[verified.tokens[index] for index in path])
    return _with_rows(feedback, [0, *(index + 1 for index in path)], chain, tuple(range(len(path))), asked=False)


def _with_rows(feedback: StepFeedback, rows: list[int], draft: Draft, path: tuple[int, ...], asked: bool):
    logits = feedback.target_logits[rows] if feedback.target_logits.numel() else feedback.target_logits
    hidden = feedback.target_hidden[rows] if feedback.target_hidden is not None else None
    return replace(feedback, draft=draft, path=path, target_logits=logits, target_hidden=hidden, asked=asked)
