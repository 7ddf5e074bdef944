"""A draft model with another vocabulary than the target's (``draft-model`` with ``vocab_mapping=``).

The drafter runs on its own token ids and the target verifies target ids, so every step crosses the
vocabularies twice:

* **Context, target → drafter.**  The accepted context is text to the drafter: a
  :class:`~specdecode.drafters._vocab_map.ContextTranslator` keeps the drafter's own tokenisation of it,
  re-tokenising only the last few tokens each step.  Accepted drafts are *not* copied back token by
  token: what the drafter proposed may be a non-canonical split of the text the target accepted, and
  the target's correction token may end in the middle of a drafter token.  Re-tokenising the text gives
  the drafter the context it would have seen had it read the text from the start, and the drafter's KV
  cache is cut back to the prefix that tokenisation shares with what it has cached (exact rollback).
* **Draft, drafter → target**, one of two ways:

  ``intersection`` (token-level intersection): the drafter only drafts tokens whose bytes are a token
  of both vocabularies, paired one to one (:func:`~specdecode.drafters._vocab_map.build_vocab_map`).
  Its logits are restricted to the intersection *before* temperature, top-k and top-p, so its sampling
  distribution is renormalised over the intersection, and that distribution — written over the
  target's vocabulary, zero elsewhere — is what the Draft carries: rejection sampling then stays
  exactly lossless (it is lossless for any proposal whose true probabilities it is given).  Greedy
  drafts the argmax over the intersection; a coupled (seeded) request perturbs the same weights with the
  target's noise at the target's positions.

  ``text`` (universal assisted generation): the drafter decodes greedily on its own, unrestricted; its
  text is re-tokenised by the target's tokenizer together with the context's last tokens, because the
  first drafted characters may belong to a target token that starts before the draft (the target's
  pre-tokeniser splits words, spaces and digits by what precedes them).  When the context's tail comes
  back as the same target tokens, the draft is what follows them; when it does not (the draft would
  merge into a committed token), the draft text is tokenised on its own.  The proposal is deterministic
  (no probabilities), which greedy, coupled and rejection-sampling verification all treat exactly.

  ``ngram`` (OmniDraft's n-gram cache): the drafter decodes greedily on its own; its tokens are converted
  through runs of drafter tokens learnt to spell one target token in verified text, or one by one
  through the intersection, up to the first it cannot convert.  Deterministic too; the cache is shared
  by the drafter's requests and bounded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

import torch

from specdecode.drafters._forward_clock import ForwardClock
from specdecode.drafters._ngram_merge import MergeCache
from specdecode.drafters._vocab_map import (
    ContextTranslator,
    TokenTable,
    VocabMap,
    build_vocab_map,
    common_prefix_length,
    complete_utf8,
)
from specdecode.drafters.base import DraftRequest, DraftSession
from specdecode.errors import SpecDecodeError
from specdecode.models.base import CausalLM
from specdecode.sampling import argmax_last, coupled_argmax, sample, sampling_log_weights, sampling_probs
from specdecode.types import Draft

if TYPE_CHECKING:
    from specdecode.models.loading import LoadedModel

#: The values of ``--drafter-option vocab_mapping=``.
VOCAB_MAPPINGS = ("intersection", "text", "ngram")

#: Target tokens at the end of the context re-tokenised with a ``text`` draft (boundary merges).
TEXT_WINDOW = 2

#: The share of a draft model's tokens the target accepts across vocabularies, expected before any is verified
#: (``Drafter.prior_acceptance``): measured 22-42% for every pair and mapping benchmarked (SmolLM2-135M and
#: Gemma-3-270M for Qwen2.5-Coder-1.5B, SmolLM2-135M for Gemma-3-270M; ``docs/results/cross-vocab-*``), against
#: 71-86% for Qwen2.5-Coder-0.5B, which shares the target's vocabulary.  The policy's default of one half would
#: have a cold request read a long prompt with a drafter that does not pay it back.
PRIOR_ACCEPTANCE = 1 / 3


def check_vocab_mapping(value: str) -> str:
    if value not in VOCAB_MAPPINGS:
        raise SpecDecodeError(f"vocab_mapping must be one of {', '.join(VOCAB_MAPPINGS)}, got {value!r}")
    return value


@dataclass
class CrossVocabulary:
    """What every request of one (target, drafter) pair shares: both token tables and the intersection.

    Built from the two models' tokenizers (what :class:`TokenTable` reads of them: ``convert_ids_to_tokens``,
    ``encode``, ``added_tokens_decoder``, ``all_special_ids`` and the ``tokenizers`` decoder)."""

    mapping: str
    draft: CausalLM
    target_vocab: int
    target_table: TokenTable
    draft_table: TokenTable
    vocab_map: VocabMap
    merges: MergeCache = field(default_factory=MergeCache)  # ``ngram``: learnt across requests, bounded
    clock: ForwardClock = field(default_factory=ForwardClock)  # a one-token drafter forward, across requests

    def __post_init__(self) -> None:
        self.single = dict(zip(self.vocab_map.draft_ids.tolist(), self.vocab_map.target_ids.tolist(), strict=True))

    def reset(self) -> None:
        self.merges.clear()

    @classmethod
    def build(cls, mapping: str, target: LoadedModel, draft: LoadedModel) -> CrossVocabulary:
        check_vocab_mapping(mapping)
        target_table, draft_table = TokenTable.of(target.tokenizer), TokenTable.of(draft.tokenizer)
        target_size = target.backend.vocab_size
        vocab_map = build_vocab_map(draft_table, draft.backend.vocab_size, target_table, target_size)
        if vocab_map.size == 0:
            raise SpecDecodeError(f"draft model {draft.name!r} shares no token with target {target.name!r}")
        return cls(mapping, draft.backend, target_size, target_table, draft_table, vocab_map)

    def session(self, request: DraftRequest) -> CrossVocabSession:
        kind = {"intersection": IntersectionSession, "text": TextSession, "ngram": NgramSession}[self.mapping]
        return kind(self, request)


class CrossVocabSession(DraftSession):
    """One request: the drafter's cache of its own tokenisation of the context."""

    def __init__(self, shared: CrossVocabulary, request: DraftRequest) -> None:
        self.shared = shared
        self.backend = shared.draft
        self.request = request
        self.sampling = request.sampling
        self.generator = request.torch_generator()
        self.translator = ContextTranslator(shared.target_table, shared.draft_table)
        self.cache = self.backend.new_cache()
        self.cached_tokens: list[int] = []
        self.setup_s = 0.0  # of the current propose: catching up with the context (Draft.setup_s)

    def _sync(self, context: list[int], max_tokens: int) -> tuple[torch.Tensor | None, int]:
        """Bring the drafter's cache up to its tokenisation of ``context``: the tokens still to feed (at
        least one) and how many tokens it may draft, or (None, 0) when there is nothing to draft from or
        no room left in its context (the cache is then left as it is)."""
        self.setup_s = 0.0
        tokens = self.translator.translate(context)
        room = min(max_tokens, self.backend.max_context - len(tokens)) if tokens else 0
        if room <= 0:
            return None, 0
        keep = min(common_prefix_length(self.cached_tokens, tokens), len(tokens) - 1)
        self.cache.crop(keep)
        self.cached_tokens = tokens
        return torch.tensor(tokens[keep:], dtype=torch.long), room

    def _logits(self, pending: torch.Tensor) -> torch.Tensor:
        """The drafter's next-token logits after ``pending``; a forward of several tokens (the drafter catching
        up with the context) adds its cost beyond one token's to ``setup_s``."""
        forward = partial(self.backend.draft_logits, pending, self.cache)
        logits, catching_up = self.shared.clock.timed(forward, len(pending))
        self.setup_s += catching_up
        return logits[-1]

    def _greedy(self, pending: torch.Tensor, room: int, usable: Callable[[int], bool] | None = None) -> list[int]:
        """Up to ``room`` drafter tokens by greedy decoding over its whole vocabulary, to its EOS or the
        first token that is not ``usable``."""
        drafted: list[int] = []
        for step in range(room):
            drafted.append(argmax_last(self._logits(pending)))
            if usable is not None and not usable(drafted[-1]):
                break
            if step + 1 == room or drafted[-1] in self.backend.eos_token_ids:
                break  # the last drafted token is never fed: the cache ends one before it
            pending = self._feed(drafted[-1])
        return drafted

    def _feed(self, token: int) -> torch.Tensor:
        """``token`` (a drafter id) goes into the cache with the next forward."""
        self.cached_tokens.append(token)
        return torch.tensor([token], dtype=torch.long)

    def restart(self) -> None:
        """The drafter's weights changed (online adaptation): nothing cached is valid any more."""
        self.cached_tokens = []

    def finish(self, context: list[int]) -> None:
        self.cache.release()


class IntersectionSession(CrossVocabSession):
    """Drafts over the tokens both vocabularies share; reports its distribution over the target's."""

    def _choose(self, logits: torch.Tensor, position: int) -> tuple[int, torch.Tensor | None, float]:
        """The next draft token as an index into the intersection, the target-vocabulary distribution it
        was sampled from (None: deterministic), and its probability (the draft-length policy's confidence)."""
        shared = self.shared.vocab_map
        restricted = logits[shared.draft_ids.to(logits.device)].float()
        if self.sampling.greedy:
            top = restricted.softmax(-1).max(-1)
            return int(top.indices), None, float(top.values)
        if self.sampling.is_coupled:
            weights = sampling_log_weights(restricted, self.sampling)
            full = torch.full((self.shared.target_vocab,), float("-inf"), device=weights.device)
            full[shared.target_ids.to(weights.device)] = weights
            index = int(shared.index_of_target[coupled_argmax(full, self.request.seed, position)])
            return index, None, float(weights.softmax(-1)[index])
        probs = sampling_probs(restricted, self.sampling).cpu()
        index = sample(probs, self.generator)
        full = torch.zeros(self.shared.target_vocab)
        full[shared.target_ids] = probs
        return index, full, float(probs[index])

    def propose(self, context: list[int], max_tokens: int) -> Draft:
        pending, max_tokens = self._sync(context, max_tokens)
        if pending is None:
            return Draft(tokens=[])
        shared = self.shared.vocab_map
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        confidence: list[float] = []
        for step in range(max_tokens):
            index, probs, p = self._choose(self._logits(pending), len(context) + step)
            tokens.append(int(shared.target_ids[index]))
            confidence.append(p)
            if probs is not None:
                rows.append(probs)
            if step + 1 == max_tokens or self.request.stop(confidence):
                break  # the last drafted token is never fed: the cache ends one before it
            pending = self._feed(int(shared.draft_ids[index]))
        probs = torch.stack(rows) if rows else None
        return Draft(tokens=tokens, probs=probs, confidence=confidence, setup_s=self.setup_s)


class TextSession(CrossVocabSession):
    """Drafts text greedily in the drafter's vocabulary, re-tokenised into the target's."""

    def propose(self, context: list[int], max_tokens: int) -> Draft:
        pending, room = self._sync(context, max_tokens)
        if pending is None:
            return Draft(tokens=[])
        text = self.shared.draft_table.text(self._greedy(pending, room))
        tokens = draft_to_target(self.shared.target_table, context, text)[:max_tokens]
        return Draft(tokens=tokens, setup_s=self.setup_s)


class NgramSession(CrossVocabSession):
    """Drafts greedily over the drafter's whole vocabulary; its tokens become target tokens through the
    merges learnt from verified text (:mod:`specdecode.drafters._ngram_merge`) and the intersection."""

    def propose(self, context: list[int], max_tokens: int) -> Draft:
        pending, room = self._sync(context, max_tokens)
        if pending is None:
            return Draft(tokens=[])
        shared = self.shared
        shared.merges.learn(shared.target_table, self.translator.last[0], shared.draft_table, self.translator.last[1])
        members = shared.merges.members
        drafted = self._greedy(pending, room, lambda token: token in shared.single or members[token] > 0)
        return Draft(tokens=shared.merges.convert(drafted, shared.single)[:max_tokens], setup_s=self.setup_s)


def draft_to_target(table: TokenTable, context: list[int], draft: bytes) -> list[int]:
    """Target tokens (``table``: the target's) for the text ``draft`` following ``context``: the context's
    last tokens and the draft are tokenised together, and what follows the unchanged tail is the draft;
    if the tail does not come back unchanged (the draft would merge into a committed token), the draft
    text is tokenised on its own.  Incomplete UTF-8 at the draft's end is dropped."""
    tail = context[-TEXT_WINDOW:]
    joined = table.text(tail) + draft
    ids = table.encode(complete_utf8(joined) or joined.decode("utf-8", errors="ignore"))
    if ids[: len(tail)] == tail:
        return ids[len(tail) :]
    alone = complete_utf8(draft) or draft.decode("utf-8", errors="ignore")
    return table.encode(alone) if alone else []
