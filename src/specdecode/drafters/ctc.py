"""CTC drafter: one head pass emits ``slots`` distributions (blank included), collapsed into the draft.

After Wen, Gui and Feng, "Speculative Decoding with CTC-based Draft Model for LLM Inference Acceleration"
(NeurIPS 2024).  The head (:mod:`specdecode.heads.ctc`) reads the target's final hidden state of the last
position whose feature is known, which the verification forward hands over (``hidden_layers``), so nothing runs
twice; one call gives every slot's distribution over the draft vocabulary and the blank.

The paper's CTC transform turns the slots into candidates by removing repeats and blanks.  Greedy requests
verify a tree of them: CTC prefix beam search over the slots (``top_k`` prefixes kept per slot, each prefix's
probability summed over the alignments that collapse to it) gives the likeliest collapsed drafts, merged into a
trie; a node's score is the probability of the kept drafts through it, and the likeliest nodes are verified
(``tree_nodes``: a count, or ``auto`` as many as pay for their verification, :mod:`specdecode.drafters._tree_size`).
Greedy requests with ``tree_nodes=0`` draft the best path, collapsed.

Sampled requests draft a chain that walks the slots as the collapse does: each slot draws a symbol from its
distribution; a blank, or the previous slot's symbol again, adds nothing; otherwise the slot adds a token sampled
from its processed distribution without the blank and that previous symbol (zero outside the draft vocabulary),
returned with the draft — the distribution the token was drawn from, so rejection sampling stays exact.
"""

from __future__ import annotations

from collections import defaultdict
from typing import ClassVar

import torch

from specdecode.drafters import register_drafter
from specdecode.drafters._tree_size import TreeBudget, check_tree_nodes, subtree
from specdecode.drafters._vocab import choose_from_subset
from specdecode.drafters.base import Drafter, DraftRequest, DraftSession, flag_option
from specdecode.errors import SpecDecodeError
from specdecode.heads.ctc import HEAD_DIR, CTCHead, load_ctc
from specdecode.heads.storage import head_for_drafter
from specdecode.models.base import HiddenStates, require_capability
from specdecode.models.loading import LoadedModel
from specdecode.types import Draft, StepFeedback

#: A step's drafting and bookkeeping in units of a one-token target forward, for sizing trees: Medusa's (the same
#: blocks and one LM-head call over the draft vocabulary).
DRAFT_SHARE = 0.05


@register_drafter("ctc")
class CTCDrafter(Drafter):
    """CTC head: one pass emits slots (with blanks) over the target feature, collapsed into drafts (needs training)."""

    provides_probs = True
    needs_training: ClassVar[bool] = True

    def __init__(
        self,
        target: LoadedModel,
        head: str | CTCHead | None = None,
        top_k: int = 4,
        tree_nodes: int | str = "auto",
        int8_head: bool | str = True,
    ) -> None:
        super().__init__(target)
        self.backend = require_capability(target.backend, HiddenStates, "drafter 'ctc'")
        if not isinstance(top_k, int) or top_k < 1:
            raise SpecDecodeError(f"ctc: top-k must be a positive integer, got {top_k!r}")
        tree_nodes = check_tree_nodes("ctc", tree_nodes)
        int8_head = flag_option("ctc: int8_head", int8_head)
        self.head = head_for_drafter(
            "ctc", head, CTCHead, load_ctc, HEAD_DIR, self.backend, target.backend.vocab_size, target.name, int8_head
        )
        self.target_ids = self.head.target_ids.to(self.backend.device)
        self.top_k = min(top_k, self.head.config.draft_vocab_size)
        self.budget = TreeBudget(target.backend, tree_nodes, DRAFT_SHARE)

    def session(self, request: DraftRequest) -> CTCSession:
        return CTCSession(self, request)


class CTCSession(DraftSession):
    """One request: the target's last known final hidden state."""

    def __init__(self, drafter: CTCDrafter, request: DraftRequest) -> None:
        self.drafter = drafter
        self.head = drafter.head
        self.blank = self.head.config.blank
        self.hidden_layers = (drafter.backend.num_layers,)
        self.sampling = request.sampling
        self.request = request
        self.generator = request.torch_generator()
        self.known = 0  # positions whose final hidden state the session has been given
        self.last: torch.Tensor | None = None  # [H] the final hidden state of position known - 1

    def observe_prompt(self, hidden: torch.Tensor) -> None:
        self.last, self.known = hidden[-1], hidden.shape[0]

    def observe(self, context: list[int], feedback: StepFeedback) -> None:
        if feedback.target_hidden is not None:
            rows = feedback.target_hidden[feedback.accepted_rows]
            self.last, self.known = rows[-1], self.known + rows.shape[0]

    @torch.inference_mode()
    def propose(self, context: list[int], max_tokens: int) -> Draft:
        if self.last is None or max_tokens <= 0 or self.known != len(context) - 1:
            return Draft(tokens=[])  # no feature of the position before the last token: nothing to draft from
        logits = self.head(self.last)  # [slots, draft_vocab + 1]
        if not self.sampling.greedy:
            return self._sampled_chain(logits, max_tokens)
        if self.drafter.budget.drafts_trees:
            return self._tree(torch.softmax(logits, dim=-1), max_tokens, len(context))
        return self._best_path(torch.softmax(logits, dim=-1), max_tokens)

    def _best_path(self, probs: torch.Tensor, max_tokens: int) -> Draft:
        """The slots' argmax, collapsed; a token's confidence is its slot's probability of it."""
        best, path = probs.max(dim=-1)
        tokens: list[int] = []
        confidence: list[float] = []
        previous = self.blank
        for symbol, probability in zip(path.tolist(), best.tolist()):
            if symbol != previous and symbol != self.blank:
                tokens.append(int(self.drafter.target_ids[symbol]))
                confidence.append(probability)
                if len(tokens) == max_tokens or self.request.stop(confidence):
                    break
            previous = symbol
        return Draft(tokens, confidence=confidence)

    def _tree(self, probs: torch.Tensor, max_tokens: int, context_tokens: int) -> Draft:
        beams = prefix_beam_search(probs, self.blank, self.drafter.top_k)
        index: dict[tuple[int, ...], int] = {}
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        for prefix, probability in beams.items():
            for depth in range(1, min(len(prefix), max_tokens) + 1):
                node = index.get(prefix[:depth])
                if node is None:
                    node = index[prefix[:depth]] = len(tokens)
                    tokens.append(int(self.drafter.target_ids[prefix[depth - 1]]))
                    parents.append(index[prefix[: depth - 1]] if depth > 1 else -1)
                    scores.append(0.0)
                scores[node] += probability
        confidence = [score / (scores[parent] if parent >= 0 else 1.0) for score, parent in zip(scores, parents)]
        order = self.drafter.budget.best_nodes(parents, scores, context_tokens)
        return subtree(order, tokens, parents, confidence)

    def _sampled_chain(self, logits: torch.Tensor, max_tokens: int) -> Draft:
        target_ids, vocab_size = self.drafter.target_ids, self.head.config.target_vocab_size
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        confidence: list[float] = []
        previous = self.blank
        for slot in logits:
            symbol = int(torch.multinomial(torch.softmax(slot, dim=-1), 1, generator=self.generator))
            if symbol == self.blank or symbol == previous:
                previous = symbol
                continue
            allowed = slot[: self.blank].clone()
            if previous != self.blank:
                allowed[previous] = float("-inf")
            token, conf, probs = choose_from_subset(allowed, target_ids, vocab_size, self.sampling, self.generator)
            tokens.append(token)
            rows.append(probs)
            confidence.append(conf)
            if len(tokens) == max_tokens or self.request.stop(confidence):
                break
            previous = int(torch.searchsorted(target_ids, token))  # target_ids ascend: the token's draft id
        return Draft(tokens, probs=torch.stack(rows) if rows else None, confidence=confidence)


def prefix_beam_search(probs: torch.Tensor, blank: int, width: int) -> dict[tuple[int, ...], float]:
    """CTC prefix beam search over slot distributions [slots, V + 1]: the ``width`` likeliest collapsed prefixes
    after the last slot (the empty one included), each with its probability summed over its alignments; each slot
    extends a prefix by its ``width`` likeliest symbols only."""
    # Per prefix: (probability of the alignments ending in a blank, ... ending in the prefix's last symbol).
    beams: dict[tuple[int, ...], tuple[float, float]] = {(): (1.0, 0.0)}
    top = probs[:, :blank].topk(min(width, blank), dim=-1).indices.tolist()
    for row, candidates in zip(probs.tolist(), top):
        grown: defaultdict[tuple[int, ...], list[float]] = defaultdict(lambda: [0.0, 0.0])
        for prefix, (ends_blank, ends_symbol) in beams.items():
            total = ends_blank + ends_symbol
            grown[prefix][0] += total * row[blank]
            last = prefix[-1] if prefix else None
            if last is not None:
                grown[prefix][1] += ends_symbol * row[last]  # a repeat merges into the same token
            for symbol in candidates:
                # After its own symbol a repeat adds a token only across a blank.
                reach = ends_blank if symbol == last else total
                grown[(*prefix, symbol)][1] += reach * row[symbol]
        best = sorted(grown.items(), key=lambda item: item[1][0] + item[1][1], reverse=True)[:width]
        beams = {prefix: (b, s) for prefix, (b, s) in best}
    return {prefix: b + s for prefix, (b, s) in beams.items() if prefix}
