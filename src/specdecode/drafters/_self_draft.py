"""What the self-speculative drafters (``layer-skip``, ``early-exit``, ``kangaroo``) share.

The target drafts for itself by running only some of its layers, *on top of the target's own KV cache of the
context*. The engine hands each session its sequence's verification cache (``DraftRequest.target_cache``);
between steps it holds ``context[:-1]`` with every layer's exact entries. A draft feeds the last context
token and then each drafted token through the executed layers, which append entries for the draft positions
only (a skipped layer writes nothing, see :class:`~specdecode.models.base.LayerwiseExecution`), and the
cache is cropped back to its length before verification. So the context costs the drafter nothing — no
prefill of its own, no catch-up after each step, no rebuild when the exit or the skip set changes — and the
verification forward finds exactly the entries it left. For an early exit the draft is the same as a
truncated model's (layers below L depend only on layers below L); a skip set reads the full model's entries
for the context, as in SWIFT, which is an approximation that only changes what gets drafted. Outside the
engine (a drafter driven by hand) the drafter keeps a private copy of that cache, synced to the context with
full-model forwards.

Draft logits come from a VocabTrim head (:class:`~specdecode.drafters._vocab.DraftHead`): the target's
own LM head restricted to the ``draft_vocab`` most frequent token ids plus the prompt's.  The full head is a large
share of a shallow draft (49k rows on SmolLM2, 262k on Gemma 3); the subset costs a few percent of it and
covers ~97% of generated tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from specdecode.drafters._vocab import DraftHead
from specdecode.drafters._vocab_map import common_prefix_length
from specdecode.drafters.base import DraftRequest
from specdecode.models.base import KVCache, LayerwiseExecution, require_capability
from specdecode.sampling import sample, sampling_probs
from specdecode.types import Draft

#: Runs the target on the tokens to feed, on top of the given cache, under the current layer subset;
#: returns the last row's logits over the draft head's vocabulary (``HeadRows.ids``).
LogitsFn = Callable[[torch.Tensor, KVCache], torch.Tensor]


def require_layer_backend(backend: object, drafter: str) -> LayerwiseExecution:
    return require_capability(backend, LayerwiseExecution, f"drafter {drafter!r} (it skips the target's layers)")


def tail(exit_layer: int, num_layers: int) -> frozenset[int]:
    """The skip set of an early exit after ``exit_layer`` layers."""
    return frozenset(range(exit_layer, num_layers))


@dataclass
class CostModel:
    """Costs in units of one full single-token target forward.

    A draft token costs the LM head plus the fraction of decoder layers run (the head is a large part
    of a small model: ~20% of SmolLM2-135M).  Verifying k draft tokens costs ``1 + verify_token_cost * k``
    (on CPUs 8 extra rows cost ~1.2-1.4x one: ``docs/results/forward-cost``).
    """

    num_layers: int
    head_fraction: float
    verify_token_cost: float

    @classmethod
    def of(cls, backend: LayerwiseExecution, verify_token_cost: float) -> CostModel:
        return cls(backend.num_layers, backend.head_fraction(), verify_token_cost)

    def draft_token(self, layers_run: int, extra: float = 0.0) -> float:
        return self.head_fraction + (1 - self.head_fraction) * layers_run / self.num_layers + extra

    def step(self, drafted: int, per_draft_token: float) -> float:
        return drafted * per_draft_token + 1 + self.verify_token_cost * drafted


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a step yields when each of k draft tokens is accepted with probability ``acceptance``
    given its predecessors were (plus the target's own token)."""
    return sum(acceptance**i for i in range(k + 1))


class SelfDraftSession:
    """One request's self-drafting: its draft head, sampling stream, and the target cache of its context
    that drafts run on (the engine's, or a private copy when driven outside the engine)."""

    def __init__(self, backend: LayerwiseExecution, head: DraftHead, request: DraftRequest) -> None:
        self.backend = backend
        self.head = head.for_prompt(request.prompt_ids)
        self.sampling = request.sampling
        self.generator = request.torch_generator()
        self.bound = request.target_cache
        self._no_rows = torch.empty(0, dtype=torch.long)
        self._own: KVCache | None = None  # used only when no cache in step with the context is bound
        self._own_tokens: list[int] = []

    def context_cache(self, context: list[int]) -> KVCache:
        """A full-model cache holding exactly ``context[:-1]``: the bound one (the engine's) when it is in
        step, else the private copy, cropped to what it shares with the context and extended by a forward."""
        if self.bound is not None and self.bound.length == len(context) - 1:
            return self.bound
        if self._own is None:
            self._own = self.backend.new_cache()
        keep = min(common_prefix_length(self._own_tokens, context), len(context) - 1)
        self._own.crop(keep)
        del self._own_tokens[keep:]
        rest = context[keep:-1]
        if rest:
            self.backend.forward(
                torch.tensor(rest, dtype=torch.long), self._own, logits_rows=self._no_rows, invariant=False
            )
            self._own_tokens.extend(rest)
        return self._own

    def finish(self) -> None:
        if self._own is not None:
            self._own.release()
            self._own = None

    def draft(self, context: list[int], max_tokens: int, logits_fn: LogitsFn, threshold: float) -> Draft:
        """Draft up to ``max_tokens`` tokens on top of the context's cache; stop after the first whose
        probability is below ``threshold``.

        Greedy requests draft the argmax (a point mass); sampled ones draw from the sampling distribution
        of the draft logits and return it, as lossless speculative sampling needs."""
        max_tokens = min(max_tokens, self.backend.max_context - len(context))
        if max_tokens <= 0:
            return Draft(tokens=[])
        cache = self.context_cache(context)
        length = cache.length
        pending = context[-1]
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        try:
            while len(tokens) < max_tokens:
                logits = logits_fn(torch.tensor([pending], dtype=torch.long), cache)
                if self.sampling.greedy:
                    probs = torch.softmax(logits.float(), dim=-1)
                    token = self.head.token(int(probs.argmax()))
                else:
                    probs = sampling_probs(self.head.full_vocab(logits), self.sampling).cpu()
                    token = sample(probs, self.generator)
                    rows.append(probs)
                tokens.append(token)
                if float(probs.max()) < threshold:
                    break
                pending = token
        finally:
            cache.crop(length)  # the draft's entries go; the context's were never touched
        return Draft(tokens=tokens, probs=torch.stack(rows) if rows else None)

    def skipping(self, skipped: frozenset[int]) -> LogitsFn:
        """The plain self-draft: the target with ``skipped`` layers left out, then the draft head."""
        return self.adapted(skipped, None)

    def adapted(self, skipped: frozenset[int], adapter: Callable[[torch.Tensor], torch.Tensor] | None) -> LogitsFn:
        """The target with ``skipped`` layers left out, ``adapter`` on the last residual state, the draft head."""

        @torch.inference_mode()
        def logits(pending: torch.Tensor, cache: KVCache) -> torch.Tensor:
            out = self.backend.forward_layers(
                pending,
                cache,
                skip_layers=skipped,
                exit_layer=self.backend.num_layers,
                output_hidden=True,
                logits_rows=self._no_rows,
            )
            hidden = out.hidden[-1:]
            return self.backend.exit_logits(adapter(hidden) if adapter else hidden, self.head)[0]

        return logits
