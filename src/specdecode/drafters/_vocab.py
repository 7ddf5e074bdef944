"""VocabTrim for drafters that run an LM head: the head restricted to a subset of the vocabulary.

After Goel et al., "VocabTrim: Vocabulary Pruning for Efficient Speculative Decoding in LLMs".  On a CPU
the LM head of a small model is a large share of a drafting step (49k-262k rows); drafting over the
``draft_vocab`` token ids most frequent in chat text (:func:`frequent_tokens`) plus the request's prompt
tokens costs a fraction of it.  A token outside the subset is simply never drafted:
verification is exact whatever is drafted, and sampled drafts report a full-vocabulary distribution that
is zero outside the subset, so rejection sampling stays exact.  Used by the self-speculative drafters and
by ``draft-model``; trained heads (EAGLE) carry their own subset from training.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

import torch
from torch import nn

from specdecode.config import DEFAULT_DRAFT_VOCAB
from specdecode.data.corpus import token_ranking
from specdecode.errors import SpecDecodeError
from specdecode.models.base import LayerwiseExecution
from specdecode.models.fastpath import PackedLinear
from specdecode.models.loading import packs_by_default
from specdecode.models.quantize import quantized_like
from specdecode.models.quantized_layers import QuantizedLinear
from specdecode.sampling import argmax_last, sample, sampling_probs
from specdecode.sampling_params import SamplingParams

if TYPE_CHECKING:
    from specdecode.models.loading import LoadedModel


def frequent_tokens(model: LoadedModel, size: int) -> torch.Tensor | None:
    """The ``size`` ids of ``model``'s vocabulary most frequent in chat text, ascending
    (:func:`specdecode.data.corpus.token_ranking`); None where ``size`` keeps the full head, or where no ranking
    can be made (no tokenizer, no text): :class:`DraftHead` then takes the first ``size`` ids.  BPE and
    SentencePiece vocabularies put frequent pieces first, less reliably: Qwen2.5-Coder's first 32,768 ids
    missed 2.7% of its own answers' tokens where the 32,768 most frequent missed 1.1%."""
    vocab_size = model.backend.vocab_size
    if size <= 0 or size >= vocab_size or model.tokenizer is None:
        return None
    ranking = token_ranking(model, vocab_size)
    return None if ranking is None else ranking[:size].sort().values


class DraftHead:
    """An LM head restricted to a ``base`` set of ids (:func:`frequent_tokens`, the tokens a trained adapter
    saw; without one the first ``size`` ids) plus each request's prompt tokens.

    ``size`` 0 (or at least the vocabulary) keeps the full head.  The base rows are copied once per
    drafter, in the head's own precision (an int4 head's rows stay int4: in fp32 a 32k-row copy of a 0.5B
    model's head cost about as much per token as the whole int4 head), or prepacked for oneDNN in fp32;
    each request adds only the rows of its prompt tokens outside the base, as a small second block."""

    def __init__(
        self, backend: LayerwiseExecution, size: int = DEFAULT_DRAFT_VOCAB, base: torch.Tensor | None = None
    ) -> None:
        if size < 0:
            raise SpecDecodeError(f"draft_vocab must be >= 0, got {size!r}")
        self.backend = backend
        too_big = base is None and size >= backend.vocab_size
        self.full = size == 0 or too_big or getattr(backend.lm_head(), "bias", None) is not None
        self.base = base if base is not None else torch.arange(min(size, backend.vocab_size))
        self._packed = packs_by_default(backend.device, torch.float32)  # the rows are copied in fp32 (_rows)
        self._weight: torch.Tensor | None = None  # the head's weight, read once (a quantized head dequantizes)
        self._base_rows: HeadRows | None = None
        self._last: HeadRows | None = None

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self._weight is None:
            weight = self.backend.output_weight()
            # A quantized head computes a dense copy on each read: keep one, in bf16 (half the memory),
            # for the rows prompts add later.
            self._weight = weight.to(torch.bfloat16) if isinstance(self.backend.lm_head(), QuantizedLinear) else weight
        return self._weight.index_select(0, ids.to(self._weight.device)).float().contiguous()

    def _block(self, ids: torch.Tensor, like_head: bool) -> nn.Module:
        rows = nn.Linear(self.backend.config.hidden_size, len(ids), bias=False, device="meta")
        rows.weight = nn.Parameter(self._rows(ids), requires_grad=False)
        quantized = quantized_like(self.backend.lm_head(), rows) if like_head else None
        if quantized is not None:
            return quantized
        return PackedLinear(rows, tied=False) if self._packed else rows

    def for_prompt(self, prompt_ids: tuple[int, ...] | list[int]) -> HeadRows:
        if self.full:
            return HeadRows(self.backend, None, ())
        if self._base_rows is None:
            self._base_rows = HeadRows(self.backend, self.base, (self._block(self.base, like_head=True),), self)
        prompt = torch.unique(torch.tensor(list(prompt_ids), dtype=torch.long))
        extra = prompt[~torch.isin(prompt, self.base)]
        if not len(extra):
            return self._base_rows
        last = self._last
        if last is not None and torch.equal(last.ids[len(self.base) :], extra):
            return last
        block = self._block(extra, like_head=False)
        self._last = HeadRows(self.backend, torch.cat([self.base, extra]), (*self._base_rows.blocks, block), self)
        return self._last


@dataclass
class HeadRows:
    """One request's draft head: the rows of ``ids`` (None: the full vocabulary), computed by ``blocks``
    (their outputs side by side, in the order of ``ids``)."""

    backend: LayerwiseExecution
    ids: torch.Tensor | None
    blocks: tuple[nn.Module, ...]
    source: DraftHead | None = field(default=None, repr=False)  # the head these rows came from, to widen them

    @cached_property
    def _known(self) -> frozenset[int]:
        return frozenset(self.ids.tolist()) if self.ids is not None else frozenset()

    def covering(self, tokens: Sequence[int]) -> HeadRows:
        """These rows, or the same head's rows widened by every one of ``tokens`` outside them.

        Why: a request's text can turn to tokens its head lacks, and a head that cannot draft a token the
        text keeps using loses every draft through it. The 32,768 ids most frequent in ShareGPT lack LaTeX's
        `` \\(`` and ``\\)``, 7 of the first 64 tokens Qwen2.5-Coder-1.5B wrote for a CHAMP problem; sessions
        widen their rows by the tokens of the text so far, so such a token is drafted from its second use on."""
        if self.ids is None or self.source is None:
            return self
        missing = [token for token in dict.fromkeys(tokens) if token not in self._known]
        if not missing:
            return self
        extra = self.ids[len(self.source.base) :].tolist()
        return self.source.for_prompt([*extra, *missing])

    def __call__(self, normed: torch.Tensor) -> torch.Tensor:
        """Head logits for final-normed hidden states [n, d]: over ``ids``, or the full vocabulary."""
        if not self.blocks:
            return self.backend.lm_head()(normed)
        if len(self.blocks) == 1:
            return self.blocks[0](normed)
        return torch.cat([block(normed) for block in self.blocks], dim=-1)

    def full_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Subset logits → full-vocabulary logits, -inf outside the subset."""
        if self.ids is None:
            return logits
        out = logits.new_full((self.backend.vocab_size,), float("-inf"))
        return out.index_copy_(0, self.ids.to(logits.device), logits)

    def token(self, index: int) -> int:
        return index if self.ids is None else int(self.ids[index])


@dataclass
class RequestRows:
    """One request's VocabTrim rows (None: the full vocabulary), widened as its text grows: the per-request
    half of :meth:`HeadRows.covering`, whose rows are shared between requests and so cannot count for one."""

    rows: HeadRows | None
    covered: int = 0  # the context's tokens the rows have been widened by

    def __post_init__(self) -> None:
        if self.rows is not None and self.rows.ids is None:
            self.rows = None  # the whole head: nothing to widen, and drafting reads the backend's own

    def follow(self, context: Sequence[int]) -> HeadRows | None:
        """The rows, first widened by the tokens ``context`` added since the last call."""
        if self.rows is not None:
            self.rows, self.covered = self.rows.covering(context[self.covered :]), len(context)
        return self.rows


def choose_from_subset(
    logits: torch.Tensor,
    target_ids: torch.Tensor,
    vocab_size: int,
    sampling: SamplingParams,
    generator: torch.Generator,
) -> tuple[int, float, torch.Tensor | None]:
    """The next draft token from logits over a vocabulary subset (``target_ids``: the target id of each
    entry): greedy, or sampled from the processed distribution over the whole vocabulary (zero outside the
    subset, returned so that rejection sampling stays exact); with the drafter's probability of it."""
    if sampling.greedy:
        choice = argmax_last(logits)
        return int(target_ids[choice]), float(torch.softmax(logits, dim=-1)[choice]), None
    probs = subset_probs(logits, target_ids, vocab_size, sampling)
    token = sample(probs, generator)
    return token, float(probs[token]), probs


def subset_probs(
    logits: torch.Tensor, target_ids: torch.Tensor, vocab_size: int, sampling: SamplingParams
) -> torch.Tensor:
    """[..., vocab_size]: the processed sampling distribution of ``logits`` [..., len(target_ids)] over a vocabulary
    subset (``target_ids``: the target id of each entry), zero outside it."""
    full = logits.new_full((*logits.shape[:-1], vocab_size), float("-inf"))
    full[..., target_ids] = logits
    return sampling_probs(full, sampling)
