"""What the self-speculative drafters (``layer-skip``, ``early-exit``, ``kangaroo``) share.

The target drafts for itself by running only some of its layers.  The engine owns the target's
verification cache, so a self-drafter keeps its *own* cache of the target run with layers left out and
resynchronises it to the accepted context on every ``propose`` (like ``draft-model``).

A cache position is only reusable under a layer subset that computes the same keys/values for every
layer that subset runs: a layer reads its own cache, and its keys/values depend on the layers below
it.  Positions written under another subset (skipped layers hold placeholders, see
:mod:`specdecode.models.hf`) are cropped and recomputed.  For early exits this is cheap: every position
computed with at least L layers is exact for an exit at L.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from specdecode.config import SamplingParams
from specdecode.drafters.base import Draft
from specdecode.drafters.draft_model import common_prefix_length
from specdecode.errors import SpecDecodeError
from specdecode.models.base import CausalLM
from specdecode.models.hf import HFCausalLM
from specdecode.verify.logits import sample, sampling_probs

#: Runs the target on the tokens to feed under the current layer subset; returns the last row's logits.
LogitsFn = Callable[[torch.Tensor], torch.Tensor]


def require_layer_backend(backend: CausalLM, drafter: str) -> HFCausalLM:
    if not isinstance(backend, HFCausalLM):
        raise SpecDecodeError(f"drafter {drafter!r} needs the transformers backend (it skips the target's layers)")
    return backend


def reusable(written: frozenset[int], wanted: frozenset[int], num_layers: int) -> bool:
    """Whether cache entries written with layers ``written`` skipped are exact for a run skipping ``wanted``:
    the two must agree on every layer up to the last one ``wanted`` runs."""
    executed = [i for i in range(num_layers) if i not in wanted]
    top = executed[-1] + 1 if executed else 0
    return {i for i in written if i < top} == {i for i in wanted if i < top}


def tail(exit_layer: int, num_layers: int) -> frozenset[int]:
    """The skip set of an early exit after ``exit_layer`` layers."""
    return frozenset(range(exit_layer, num_layers))


@dataclass
class CostModel:
    """Costs in units of one full single-token target forward.

    A draft token costs the LM head plus the fraction of decoder layers run (the head is a large part
    of a small model: ~20% of SmolLM2-135M).  Verifying k draft tokens costs ``1 + verify_token_cost * k``
    (on CPUs 8 extra rows cost ~1.2-1.4x one, see MODELS.md).
    """

    num_layers: int
    head_fraction: float
    verify_token_cost: float

    @classmethod
    def of(cls, backend: HFCausalLM, verify_token_cost: float) -> CostModel:
        head = backend.model.get_output_embeddings().weight.numel()
        # Buffers too: the CPU fast path keeps prepacked weights as buffers, not parameters.
        stack = backend._decoder().layers
        layers = sum(t.numel() for t in (*stack.parameters(), *stack.buffers()))
        return cls(backend.num_layers, head / (head + layers), verify_token_cost)

    def draft_token(self, layers_run: int, extra: float = 0.0) -> float:
        return self.head_fraction + (1 - self.head_fraction) * layers_run / self.num_layers + extra

    def step(self, drafted: int, per_draft_token: float) -> float:
        return drafted * per_draft_token + 1 + self.verify_token_cost * drafted


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a step yields when each of k draft tokens is accepted with probability ``acceptance``
    given its predecessors were (plus the target's own token)."""
    return sum(acceptance**i for i in range(k + 1))


class SelfDraftCache:
    """The drafter's own cache of the target run under changing layer subsets, plus the draft loop."""

    def __init__(self, backend: HFCausalLM) -> None:
        self.backend = backend
        self.cache = backend.new_cache()
        self.tokens: list[int] = []
        self.written: list[frozenset[int]] = []  # skip set each cached position was computed with
        self.sampling = SamplingParams()
        self.generator = torch.Generator()

    def start(self, sampling: SamplingParams) -> None:
        self.sampling = sampling
        self.generator = torch.Generator()
        # A different stream from the verifier's, but reproducible from the same seed.
        self.generator.manual_seed((sampling.seed if sampling.seed is not None else torch.seed()) + 1)

    def clear(self) -> None:
        self.cache = self.backend.new_cache()
        self.tokens, self.written = [], []

    def sync(self, context: list[int], skipped: frozenset[int]) -> torch.Tensor:
        """Crop to the longest prefix that is both the context's and exact under ``skipped``; the rest of
        the context (at least its last token) is returned, to be fed with the first draft step."""
        keep = min(common_prefix_length(self.tokens, context), len(context) - 1)
        written, layers = self.written, self.backend.num_layers
        stale = (i for i in range(keep) if written[i] is not skipped and not reusable(written[i], skipped, layers))
        keep = next(stale, keep)
        self.cache.crop(keep)
        del self.tokens[keep:], self.written[keep:]
        return torch.tensor(context[keep:], dtype=torch.long)

    def warm(self, context: list[int], skipped: frozenset[int]) -> None:
        """Fill the cache with all but the last context token (a prefill), so that later syncs reuse it."""
        pending = self.sync(context, skipped)
        if len(pending) > 1:
            self.backend.forward(pending[:-1], self.cache, skip_layers=skipped, logits_rows=slice(-1, None))
            self.record(pending[:-1].tolist(), skipped)

    def record(self, fed: list[int], skipped: frozenset[int]) -> None:
        self.tokens.extend(fed)
        self.written.extend([skipped] * len(fed))

    def draft(
        self, context: list[int], max_tokens: int, skipped: frozenset[int], logits_fn: LogitsFn, threshold: float
    ) -> Draft:
        """Draft up to ``max_tokens`` tokens; stop after the first whose probability is below ``threshold``.

        Greedy requests draft the argmax (a point mass); sampled ones draw from the sampling distribution
        of the draft logits and return it, as lossless speculative sampling needs."""
        max_tokens = min(max_tokens, self.backend.max_context - len(context))
        if max_tokens <= 0:
            return Draft(tokens=[])
        pending = self.sync(context, skipped)
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        while len(tokens) < max_tokens:
            logits = logits_fn(pending)
            self.record(pending.tolist(), skipped)
            if self.sampling.greedy:
                probs = torch.softmax(logits.float(), dim=-1)
                token = int(probs.argmax())
            else:
                probs = sampling_probs(logits, self.sampling)
                token = sample(probs, self.generator)
                rows.append(probs)
            tokens.append(token)
            if float(probs.max()) < threshold:
                break
            pending = torch.tensor([token], dtype=torch.long)
        # The last drafted token was never fed, so the cache ends one before it.
        return Draft(tokens=tokens, probs=torch.stack(rows) if rows else None)

    def skipping(self, skipped: frozenset[int]) -> LogitsFn:
        """The plain self-draft: the target with ``skipped`` layers left out."""

        def logits(pending: torch.Tensor) -> torch.Tensor:
            out = self.backend.forward(pending, self.cache, skip_layers=skipped, logits_rows=slice(-1, None))
            return out.logits[0]

        return logits
