"""What one request teaches an adapting drafter (:mod:`specdecode.drafters.adapt`), and the session that
collects it.

While a request decodes, :class:`AdaptingSession` notes for every verified token whether the drafter
had drafted it (an accepted draft token) or not (a rejected position, the target's correction, or a
token nothing was drafted for), and at those mismatches the target's top probabilities, read from the
verification logits the step computed anyway (``StepFeedback.target_logits``).  At the request's end it
turns them into an :class:`Example` over the *drafter's* tokens:

* same vocabulary: the context itself, one label per generated token;
* another vocabulary: the drafter's tokenisation of the verified text; a drafter token weighs as a
  mismatch when its bytes overlap a target token the drafter missed, and the target's top
  probabilities become a distillation target only where a target token starts on a drafter token
  boundary, restricted to the tokens both vocabularies share (OmniDraft's hybrid loss: distillation
  where the vocabularies map, the verified text's cross-entropy everywhere).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specdecode.clock import now
from specdecode.drafters._vocab_map import complete_utf8
from specdecode.drafters.base import DraftRequest, DraftSession
from specdecode.types import Draft, StepFeedback

if TYPE_CHECKING:
    from specdecode.drafters.adapt import OnlineAdapter
    from specdecode.drafters.cross_vocab import CrossVocabulary

#: Target probabilities kept per mismatch (the top ones).
TOPK = 8
#: Drafter tokens kept of a request (the last ones): bounds an example's memory and a step's cost.
WINDOW = 512
#: Loss weight of a generated token the drafter had drafted right (a mismatch weighs 1).
AGREED_WEIGHT = 0.2

#: A mismatch's target distribution: (token ids, probabilities), the top :data:`TOPK`.
Soft = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Example:
    """One request's training data in the drafter's vocabulary.

    ids: [n] drafter tokens; rows: [m] logit rows trained on (row r predicts ``ids[r + 1]``); weights: [m];
    soft_rows: [s] indices into ``rows`` with a distillation target; soft_ids / soft_probs: [s, TOPK]."""

    ids: torch.Tensor
    rows: torch.Tensor
    weights: torch.Tensor
    soft_rows: torch.Tensor
    soft_ids: torch.Tensor
    soft_probs: torch.Tensor

    @classmethod
    def build(cls, ids: Sequence[int], rows: Sequence[int], weights: Sequence[float], soft: dict[int, Soft]) -> Example:
        """From labels over the whole text (``soft`` keyed by row), keeping the last :data:`WINDOW` tokens."""
        start = max(0, len(ids) - WINDOW)
        kept = [(row - start, weight) for row, weight in zip(rows, weights) if row >= start]
        index = {row: i for i, (row, _) in enumerate(kept)}
        soft_rows, soft_ids, soft_probs = [], [], []
        for row, (token_ids, probs) in soft.items():
            if row - start in index:
                pad = TOPK - len(token_ids)
                soft_rows.append(index[row - start])
                soft_ids.append(torch.cat([token_ids, torch.zeros(pad, dtype=torch.long)]))
                soft_probs.append(torch.cat([probs / probs.sum(), torch.zeros(pad)]))
        return cls(
            ids=torch.tensor(list(ids[start:]), dtype=torch.long),
            rows=torch.tensor([row for row, _ in kept], dtype=torch.long),
            weights=torch.tensor([weight for _, weight in kept], dtype=torch.float32),
            soft_rows=torch.tensor(soft_rows, dtype=torch.long),
            soft_ids=torch.stack(soft_ids) if soft_ids else torch.zeros(0, TOPK, dtype=torch.long),
            soft_probs=torch.stack(soft_probs) if soft_probs else torch.zeros(0, TOPK),
        )


#: Builds a request's example: (context, prompt length, missed per generated token, soft by generated index).
ExampleBuilder = Callable[[list[int], int, list[bool], dict[int, Soft]], Example | None]


def same_vocab_example(context: list[int], prompt_len: int, missed: list[bool], soft: dict[int, Soft]) -> Example:
    """Drafter and target share ids: generated token j is predicted by row j - 1."""
    positions = [prompt_len + k for k in range(len(missed)) if prompt_len + k >= 1]
    weights = [1.0 if missed[j - prompt_len] else AGREED_WEIGHT for j in positions]
    by_row = {prompt_len + k - 1: value for k, value in soft.items() if prompt_len + k >= 1}
    return Example.build(context, [j - 1 for j in positions], weights, by_row)


def _spans(pieces: Sequence[bytes]) -> list[tuple[int, int]]:
    spans, offset = [], 0
    for piece in pieces:
        spans.append((offset, offset + len(piece)))
        offset += len(piece)
    return spans


def cross_vocab_example(
    cross: CrossVocabulary, context: list[int], prompt_len: int, missed: list[bool], soft: dict[int, Soft]
) -> Example | None:
    """The drafter's tokenisation of the verified text, its labels aligned with the target's by bytes."""
    target, draft = cross.target_table, cross.draft_table
    skip = len(target.prefix) if context[: len(target.prefix)] == list(target.prefix) else 0
    tokens = context[skip:]
    while tokens and complete_utf8(target.text(tokens)) is None:  # the text ends inside a character
        tokens = tokens[:-1]
    text = complete_utf8(target.text(tokens)) or ""
    if not text:
        return None
    target_spans = _spans([target.piece(t) for t in tokens])
    first = prompt_len - skip  # index in ``tokens`` of the first generated token
    prompt_end = target_spans[first - 1][1] if first > 0 else 0
    missed_bytes = bytearray(target_spans[-1][1])
    for k, is_missed in enumerate(missed):
        if is_missed and 0 <= first + k < len(tokens):
            begin, end = target_spans[first + k]
            missed_bytes[begin:end] = b"\x01" * (end - begin)
    prefix = list(draft.prefix)
    ids = draft.encode(text)
    draft_spans = _spans([draft.piece(t) for t in ids])
    rows, weights, row_at = [], [], {}
    for j, (begin, end) in enumerate(draft_spans):
        row = len(prefix) + j - 1
        if end <= prompt_end or row < 0:
            continue
        rows.append(row)
        weights.append(1.0 if any(missed_bytes[begin:end]) else AGREED_WEIGHT)
        row_at[begin] = row
    by_row = {}
    vocab_map = cross.vocab_map
    for k, (token_ids, probs) in soft.items():
        if not 0 <= first + k < len(tokens) or target_spans[first + k][0] not in row_at:
            continue
        index = vocab_map.index_of_target[token_ids]
        shared = index >= 0
        if shared.any():
            by_row[row_at[target_spans[first + k][0]]] = (vocab_map.draft_ids[index[shared]], probs[shared])
    return Example.build(prefix + ids, rows, weights, by_row)


class AdaptingSession(DraftSession):
    """A drafting session that also records what the request teaches, and hands it over at its end."""

    reads_target_logits = True

    def __init__(
        self, inner: DraftSession, adapter: OnlineAdapter, request: DraftRequest, example_of: ExampleBuilder
    ) -> None:
        self.inner = inner
        self.adapter = adapter
        self.example_of = example_of
        self.hidden_layers = inner.hidden_layers
        self.prompt_len = len(request.prompt_ids)
        self.length = self.prompt_len
        self.missed: list[bool] = []
        self.soft: dict[int, Soft] = {}  # by generated index
        self.version = adapter.version
        self.started = now()

    def propose(self, context: list[int], max_tokens: int) -> Draft:
        if self.version != self.adapter.version:  # the weights changed since the session's cache was filled
            self.inner.restart()
            self.version = self.adapter.version
        return self.inner.propose(context, max_tokens)

    def observe(self, context: list[int], feedback: StepFeedback) -> None:
        self.inner.observe(context, feedback)
        rows, logits = feedback.accepted_rows, feedback.target_logits
        for i in range(len(context) - self.length):
            missed = i >= feedback.num_accepted
            if missed and self.adapter.options.train and logits.numel() and i < len(rows):
                top = logits[rows[i]].float().softmax(-1).topk(TOPK)
                self.soft[len(self.missed)] = (top.indices.cpu(), top.values.cpu())
            self.missed.append(missed)
        self.length = len(context)

    def finish(self, context: list[int]) -> None:
        self.inner.finish(context)
        decoding_s = now() - self.started  # its own clock: a lockstep's turns of others excluded
        if self.adapter.options.train and self.missed:
            example = self.example_of(context[: self.length], self.prompt_len, self.missed, self.soft)
            self.adapter.learn(example, decoding_s)
