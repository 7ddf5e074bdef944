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

How much the lower level guesses each round (``lower_depth``, default ``auto``) is the paper's trade-off at
the lower link: guessing g tokens makes the draft model's forward g + 1 tokens wide, costing ``t(g+1)/t(1)``
of a one-token forward (its cost curve, measured once per model), and yields ``1 + a_1 + a_1 a_2 + ...``
tokens, a_i the rate at which the draft model agreed with the i-th guess given the ones before (counted per
request).  ``auto`` guesses the g with the most tokens per unit of cost; where no guess pays (a lower level
that keeps guessing wrong) it guesses one token every few rounds, to notice when that changes, and the
hierarchy is otherwise plain ``draft-model``.

Like ``draft-model``, the session keeps the draft model's cache of the request and re-synchronises on every
``propose``: the cache is cut back to what it shares with the accepted context, the rest fed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdecode.drafters import create_drafter, register_drafter
from specdecode.drafters._vocab_map import common_prefix_length
from specdecode.drafters.base import Drafter, DraftRequest, DraftSession
from specdecode.drafters.draft_model import choose_draft_token
from specdecode.errors import SpecDecodeError
from specdecode.models.base import CausalLM
from specdecode.models.cost import relative_cost_curve
from specdecode.models.loading import LoadedModel, check_same_vocabulary, load_model
from specdecode.types import Draft, StepFeedback

#: Drafters that can sit below the draft model: they need no model of their own and nothing of the target's
#: (self-speculative drafters run the target's layers; trained heads read its features).
LOWER_LEVELS = ("pld", "suffix", "recycling", "cacheback", "stand")
#: The deepest guess ``lower_depth=auto`` considers, and how often it probes when no guess pays.
MAX_GUESS = 16
PROBE_EVERY = 4


@dataclass
class GuessDepth:
    """How many tokens the lower level guesses per round: ``fixed``, or the most tokens per unit of the draft
    model's forward cost, from per-position agreement counts (a prior of one agreement in two tries)."""

    fixed: int | None
    curve: tuple[float, ...] = ()
    reached: list[float] = field(default_factory=list)  # rounds whose guess had an i-th token, all before agreed
    agreed: list[float] = field(default_factory=list)  # ... of which the draft model agreed with the i-th
    rounds_without: int = 0

    def next(self, room: int) -> int:
        if self.fixed is not None or room <= 0:
            return min(self.fixed or 0, max(room, 0))
        best, best_rate, expected, survive = 0, 1.0, 1.0, 1.0
        for depth in range(1, min(room, MAX_GUESS) + 1):
            survive *= self._rate(depth - 1)
            expected += survive
            rate = expected / self._cost(depth + 1)
            if rate > best_rate:
                best, best_rate = depth, rate
        if best == 0:
            self.rounds_without += 1
            return 1 if self.rounds_without % PROBE_EVERY == 0 else 0
        return best

    def observe(self, guessed: int, agreed: int) -> None:
        for position in range(min(guessed, agreed + 1)):  # positions up to the first disagreement were tried
            while len(self.reached) <= position:
                self.reached.append(0.0)
                self.agreed.append(0.0)
            self.reached[position] += 1
            self.agreed[position] += position < agreed

    def _rate(self, position: int) -> float:
        if position >= len(self.reached):
            return 0.5
        return (self.agreed[position] + 1) / (self.reached[position] + 2)

    def _cost(self, width: int) -> float:
        """``t(width) / t(1)`` of the draft model's forward, extrapolated linearly past the measured curve."""
        if not self.curve:
            return float(width)  # unmeasured: as if every token cost a forward (guess only what surely pays)
        if width <= len(self.curve):
            return self.curve[width - 1]
        slope = (self.curve[-1] - self.curve[0]) / max(len(self.curve) - 1, 1)
        return self.curve[-1] + slope * (width - len(self.curve))


@register_drafter("hsd")
class HierarchicalDrafter(Drafter):
    """Hierarchical drafting: a model-free drafter guesses, the draft model verifies it, the target verifies that."""

    provides_probs = True

    def __init__(
        self,
        target: LoadedModel,
        draft_model: str | LoadedModel | None = None,
        levels: str = "pld,draft-model",
        lower_depth: int | str = "auto",
    ) -> None:
        super().__init__(target)
        if draft_model is None:
            raise SpecDecodeError("drafter 'hsd' needs --draft-model (the level the target verifies)")
        names = [name.strip() for name in str(levels).split(",")]
        if len(names) != 2 or names[1] != "draft-model" or names[0] not in LOWER_LEVELS:
            raise SpecDecodeError(
                f"hsd levels must be 'LOWER,draft-model' with LOWER one of {', '.join(LOWER_LEVELS)}; got {levels!r}"
            )
        if lower_depth != "auto" and (
            not isinstance(lower_depth, int) or isinstance(lower_depth, bool) or lower_depth < 1
        ):
            raise SpecDecodeError(f"hsd lower_depth must be a positive integer or auto, got {lower_depth!r}")
        self.draft = (
            draft_model
            if isinstance(draft_model, LoadedModel)
            else load_model(draft_model, device=target.backend.device)
        )
        check_same_vocabulary(target, self.draft)
        # The lower level drafts for the draft model: built for it, as if it were the target.
        self.lower = create_drafter(names[0], self.draft)
        self.lower_depth = None if lower_depth == "auto" else lower_depth

    def session(self, request: DraftRequest) -> DraftSession:
        lower_request = DraftRequest(prompt_ids=request.prompt_ids, sampling=request.sampling, seed=request.seed)
        depth = GuessDepth(self.lower_depth)
        if self.lower_depth is None:  # measured on first use, then cached per model
            depth.curve = relative_cost_curve(self.draft.backend) or ()
        return HierarchicalSession(self.draft.backend, self.lower.session(lower_request), request, depth)

    def reset(self) -> None:
        self.lower.reset()


class HierarchicalSession(DraftSession):
    """One request: the draft model's cache of it, and the lower level's session drafting for it."""

    def __init__(self, backend: CausalLM, lower: DraftSession, request: DraftRequest, depth: GuessDepth) -> None:
        self.backend = backend
        self.lower = lower
        self.request = request
        self.generator = request.torch_generator()
        self.depth = depth
        self.cache = backend.new_cache()
        self.cached: list[int] = []  # the tokens whose entries the draft model's cache holds, in order
        self.draft_forwards = 0  # draft-model forwards so far (what the lower level saves)

    def _choose(self, logits: torch.Tensor, position: int) -> tuple[int, torch.Tensor | None, float]:
        """The draft model's token at absolute ``position``, chosen as ``draft-model`` chooses it."""
        return choose_draft_token(logits, self.request, position, self.generator)

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
            wanted = self.depth.next(room)
            guess = self.lower.propose(written, wanted).tokens[:wanted] if wanted > 0 else []
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
            self.depth.observe(len(guess), agreed)
            path = tuple(range(agreed))
            self.lower.observe(written, StepFeedback(Draft(tokens=guess), path, torch.empty(0)))
            if self.request.stop(confidence):  # SpecDec++-style early stop, as draft-model
                break
        return Draft(tokens=tokens, probs=torch.stack(prob_rows) if prob_rows else None, confidence=confidence)

    def finish(self, context: list[int]) -> None:
        self.lower.finish(context)
        self.cache.release()
