"""An independent small model with the target's vocabulary drafts autoregressively.

It keeps its own KV cache.  Instead of being told what was rejected, it re-synchronises on every
``propose``: the cache is cut back to the longest prefix it shares with the accepted context and
only the missing tokens are fed — so rollback is exact whatever the verifier decided.
"""

from __future__ import annotations

import torch

from specdecode.drafters import register_drafter
from specdecode.drafters.base import Drafter, DraftRequest, DraftSession
from specdecode.errors import SpecDecodeError
from specdecode.models.base import CausalLM
from specdecode.models.loading import LoadedModel, check_same_vocabulary, load_model
from specdecode.sampling import sample, sampling_probs
from specdecode.types import Draft


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


@register_drafter("draft-model")
class DraftModelDrafter(Drafter):
    provides_probs = True

    def __init__(self, target: LoadedModel, draft_model: str | LoadedModel | None = None) -> None:
        super().__init__(target)
        if draft_model is None:
            raise SpecDecodeError("drafter 'draft-model' needs --draft-model (e.g. qwen2.5-coder-0.5b)")
        self.draft = (
            draft_model
            if isinstance(draft_model, LoadedModel)
            else load_model(draft_model, device=target.backend.device)
        )
        check_same_vocabulary(target, self.draft)

    def session(self, request: DraftRequest) -> DraftModelSession:
        return DraftModelSession(self.draft.backend, request)


class DraftModelSession(DraftSession):
    """One request: the draft model's own cache of it, its sampling and random stream."""

    def __init__(self, backend: CausalLM, request: DraftRequest) -> None:
        self.backend = backend
        self.request = request
        self.sampling = request.sampling
        self.generator = request.torch_generator()
        self.cache = backend.new_cache()
        self.cached_tokens: list[int] = []

    def _choose(self, logits: torch.Tensor) -> tuple[int, torch.Tensor | None, float]:
        """The next draft token, the distribution it was sampled from (None if greedy) and the draft
        model's probability of it (its confidence, for the draft-length policy's stop rule)."""
        if self.sampling.greedy:
            top = logits.float().softmax(-1).max(-1)
            return int(top.indices), None, float(top.values)
        probs = sampling_probs(logits, self.sampling).cpu()
        token = sample(probs, self.generator)
        return token, probs, float(probs[token])

    def propose(self, context: list[int], max_tokens: int) -> Draft:
        backend = self.backend
        max_tokens = min(max_tokens, backend.max_context - len(context))
        if max_tokens <= 0:
            return Draft(tokens=[])
        keep = min(common_prefix_length(self.cached_tokens, context), len(context) - 1)
        self.cache.crop(keep)
        self.cached_tokens = list(context)
        pending = torch.tensor(context[keep:], dtype=torch.long)
        tokens: list[int] = []
        prob_rows: list[torch.Tensor] = []
        confidence: list[float] = []
        for _ in range(max_tokens):
            logits = backend.forward(pending, self.cache, logits_rows=slice(-1, None)).logits[0]
            token, probs, p = self._choose(logits)
            tokens.append(token)
            confidence.append(p)
            if probs is not None:
                prob_rows.append(probs)
            if self.request.stop(confidence):  # SpecDec++-style early stop
                break
            pending = torch.tensor([token], dtype=torch.long)
        # The last drafted token was never fed to the draft model, so the cache ends one before it.
        self.cached_tokens.extend(tokens[:-1])
        return Draft(tokens=tokens, probs=torch.stack(prob_rows) if prob_rows else None, confidence=confidence)

    def finish(self, context: list[int]) -> None:
        self.cache.release()
