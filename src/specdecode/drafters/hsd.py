"""Hierarchical speculative decoding (HSD; Mohri et al., "Fast Inference via Hierarchical Speculative
Decoding"): a stack of drafters, each verifying the one below it in one forward, the target verifying the
top.

``--drafter hsd --draft-model M --drafter-option levels=pld,draft-model``: prompt lookup (or any drafter
that needs no model of its own: ``suffix``, ``recycling``...) guesses what the draft model ``M`` would write;
``M`` checks the guess in one forward over all of it, keeps the longest prefix it agrees with and adds one
token of its own, and repeats until it has drafted what the target asked for.  The draft is therefore
exactly the draft model's own — the tokens ``draft-model`` would propose, with the same distribution when
sampling — produced in fewer draft-model forwards wherever the lower level guesses right.  A draft model
costs a third of a target forward on a CPU: that cost is what the lower level saves.  The target verifies
as for any drafter, so output is unchanged.

The draft model's token at each position is chosen exactly as ``draft-model`` chooses it: its argmax
(greedy), its Gumbel-max argmax with the request's keyed noise (a seeded, coupled request), or a draw from
its sampling distribution, returned with the draft so rejection sampling stays exact.

Like ``draft-model``, the session keeps the draft model's cache of the request and re-synchronises on every
``propose``: the cache is cut back to what it shares with the accepted context, the rest fed.
"""

from __future__ import annotations

import torch

from specdecode.drafters import create_drafter, register_drafter
from specdecode.drafters.base import Drafter, DraftRequest, DraftSession
from specdecode.drafters.draft_model import common_prefix_length
from specdecode.errors import SpecDecodeError
from specdecode.models.base import CausalLM
from specdecode.models.loading import LoadedModel, check_same_vocabulary, load_model
from specdecode.sampling import coupled_argmax, sample, sampling_log_weights, sampling_probs
from specdecode.types import Draft, StepFeedback

#: Drafters that can sit below the draft model: they need no model of their own and nothing of the target's
#: (self-speculative drafters run the target's layers; trained heads read its features).
LOWER_LEVELS = ("pld", "suffix", "recycling", "cacheback", "stand")


@register_drafter("hsd")
class HierarchicalDrafter(Drafter):
    """Hierarchical drafting: a model-free drafter guesses, the draft model verifies it, the target verifies that."""

    provides_probs = True

    def __init__(
        self,
        target: LoadedModel,
        draft_model: str | LoadedModel | None = None,
        levels: str = "pld,draft-model",
        lower_depth: int = 8,
    ) -> None:
        super().__init__(target)
        if draft_model is None:
            raise SpecDecodeError("drafter 'hsd' needs --draft-model (the level the target verifies)")
        names = [name.strip() for name in str(levels).split(",")]
        if len(names) != 2 or names[1] != "draft-model" or names[0] not in LOWER_LEVELS:
            raise SpecDecodeError(
                f"hsd levels must be 'LOWER,draft-model' with LOWER one of {', '.join(LOWER_LEVELS)}; got {levels!r}"
            )
        if not isinstance(lower_depth, int) or isinstance(lower_depth, bool) or lower_depth < 1:
            raise SpecDecodeError(f"hsd lower_depth must be a positive integer, got {lower_depth!r}")
        self.draft = (
            draft_model
            if isinstance(draft_model, LoadedModel)
            else load_model(draft_model, device=target.backend.device)
        )
        check_same_vocabulary(target, self.draft)
        # The lower level drafts for the draft model: built for it, as if it were the target.
        self.lower = create_drafter(names[0], self.draft)
        self.lower_depth = lower_depth

    def session(self, request: DraftRequest) -> DraftSession:
        lower_request = DraftRequest(prompt_ids=request.prompt_ids, sampling=request.sampling, seed=request.seed)
        return HierarchicalSession(self.draft.backend, self.lower.session(lower_request), request, self.lower_depth)

    def reset(self) -> None:
        self.lower.reset()


class HierarchicalSession(DraftSession):
    """One request: the draft model's cache of it, and the lower level's session drafting for it."""

    def __init__(self, backend: CausalLM, lower: DraftSession, request: DraftRequest, lower_depth: int) -> None:
        self.backend = backend
        self.lower = lower
        self.request = request
        self.sampling = request.sampling
        self.generator = request.torch_generator()
        self.lower_depth = lower_depth
        self.cache = backend.new_cache()
        self.cached: list[int] = []  # the tokens whose entries the draft model's cache holds, in order
        self.draft_forwards = 0  # draft-model forwards so far (what the lower level saves)

    def _choose(self, logits: torch.Tensor, position: int) -> tuple[int, torch.Tensor | None, float]:
        """The draft model's token at absolute ``position``, the distribution it was drawn from (None when
        it is a deterministic function of the logits) and its probability, as ``draft-model`` chooses."""
        if self.sampling.greedy:
            top = logits.float().softmax(-1).max(-1)
            return int(top.indices), None, float(top.values)
        if self.sampling.is_coupled:
            weights = sampling_log_weights(logits, self.sampling)
            token = coupled_argmax(weights, self.request.seed, position)
            return token, None, float(weights.softmax(-1)[token])
        probs = sampling_probs(logits, self.sampling).cpu()
        token = sample(probs, self.generator)
        return token, probs, float(probs[token])

    def propose(self, context: list[int], max_tokens: int) -> Draft:
        max_tokens = min(max_tokens, self.backend.max_context - len(context))
        if max_tokens <= 0:
            return Draft(tokens=[])
        keep = min(common_prefix_length(self.cached, context), len(context) - 1)
        self.cache.crop(keep)
        self.cached = list(context[:keep])
        pending = list(context[keep:])  # not yet in the cache; always ends with the last context token
        written = list(context)  # the context, then what the draft model has written so far
        tokens: list[int] = []
        prob_rows: list[torch.Tensor] = []
        confidence: list[float] = []
        while len(tokens) < max_tokens:
            room = max_tokens - len(tokens) - 1  # the draft model adds a token of its own every round
            guess = self.lower.propose(written, min(self.lower_depth, room)).tokens[:room] if room > 0 else []
            fed = torch.tensor(pending + guess, dtype=torch.long)
            # Rows: what follows the last written token, then what follows each guessed token.
            logits = self.backend.forward(fed, self.cache, logits_rows=slice(len(pending) - 1, None)).logits
            self.draft_forwards += 1
            agreed = 0
            while True:
                token, probs, p = self._choose(logits[agreed], len(written) + agreed)
                tokens.append(token)
                confidence.append(p)
                if probs is not None:
                    prob_rows.append(probs)
                if agreed == len(guess) or token != guess[agreed]:
                    break
                agreed += 1
            # The cache holds cached + pending + guess: keep what the draft model agreed with.
            self.cached += pending + guess[:agreed]
            self.cache.crop(len(self.cached))
            written = [*context, *tokens]
            pending = [token]
            path = tuple(range(agreed))
            self.lower.observe(written, StepFeedback(Draft(tokens=guess), path, torch.empty(0)))
            if self.request.stop(confidence):  # SpecDec++-style early stop, as draft-model
                break
        return Draft(tokens=tokens, probs=torch.stack(prob_rows) if prob_rows else None, confidence=confidence)

    def finish(self, context: list[int]) -> None:
        self.lower.finish(context)
        self.cache.release()
