"""Layer-skipping self-drafting (SWIFT): the target with a set of its layers skipped drafts for itself;
the set is searched on the fly against observed acceptance.

After Xia et al. 2024, "SWIFT: On-the-Fly Self-Speculative Decoding for LLM Inference Acceleration".
The search is a (1+1) evolution strategy over skip masks: the current best set is scored by accepted
tokens per unit cost (:class:`~specdecode.drafters._self_draft.CostModel`) over windows of
``trial_steps`` steps; in between, a mutation of it (one layer added, removed or swapped) is tried for
a window and replaces it if it scores higher. ``search_trials`` mutations are tried in all, and the
best set (and its score) persists across requests, so later requests only exploit it. Every set drafts
on the target's own cache of the context (as SWIFT does), so trying a new set costs nothing extra.
Drafting stops at the first token whose probability is below ``threshold``. Draft logits come from the
target's head restricted to ``draft_vocab`` frequent ids + the prompt's tokens (0: full head). Layer 0
always runs (the cache length and mask are read from its slot).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import cached_property

from specdecode.config import DEFAULT_DRAFT_VOCAB
from specdecode.drafters import register_drafter
from specdecode.drafters._calibration import self_draft_agreement
from specdecode.drafters._self_draft import CostModel, SelfDraftSession, require_layer_backend
from specdecode.drafters._vocab import DraftHead, frequent_tokens
from specdecode.drafters.base import Drafter, DraftRequest, DraftSession
from specdecode.errors import SpecDecodeError
from specdecode.models.loading import LoadedModel
from specdecode.types import Draft, StepFeedback


@dataclass
class Window:
    """Tokens gained and cost spent by one skip set over its current evaluation window."""

    tokens: float = 0.0
    cost: float = 0.0
    steps: int = 0

    @property
    def score(self) -> float:
        return self.tokens / self.cost if self.cost else 0.0


def initial_skip_set(num_layers: int, ratio: float) -> frozenset[int]:
    """``ratio`` of the layers, evenly spread over the upper three quarters minus the last layer (the
    first layers and the last one matter most to the output distribution; layer 0 always runs)."""
    lo, hi = max(1, num_layers // 4), num_layers - 1
    count = min(max(1, round(ratio * num_layers)), hi - lo) if num_layers > 1 else 0
    if count <= 0:
        return frozenset()
    step = (hi - lo) / count
    return frozenset(lo + int(i * step) for i in range(count))


@register_drafter("layer-skip")
class LayerSkipDrafter(Drafter):
    """Layer skipping (SWIFT): the target minus a searched set of layers drafts; confident-stop."""

    provides_probs = True

    def __init__(
        self,
        target: LoadedModel,
        skip_ratio: float = 0.4,
        threshold: float = 0.5,
        search_trials: int = 6,
        trial_steps: int = 6,
        verify_token_cost: float = 0.15,
        seed: int = 0,
        draft_vocab: int = DEFAULT_DRAFT_VOCAB,
    ) -> None:
        super().__init__(target)
        backend = require_layer_backend(target.backend, "layer-skip")
        if not 0.0 < skip_ratio < 1.0:
            raise SpecDecodeError(f"layer-skip: skip_ratio must be in (0, 1), got {skip_ratio!r}")
        if not 0.0 <= threshold < 1.0:
            raise SpecDecodeError(f"layer-skip: threshold must be in [0, 1), got {threshold!r}")
        self.backend = backend
        self.skip_ratio = skip_ratio
        self.threshold = threshold
        self.search_trials = search_trials
        self.trial_steps = max(1, trial_steps)
        self.seed = seed
        self.costs = CostModel.of(backend, verify_token_cost)
        self.head = DraftHead(backend, draft_vocab, frequent_tokens(target, draft_vocab))
        self.reset()

    def reset(self) -> None:
        self.best = initial_skip_set(self.backend.num_layers, self.skip_ratio)
        self.best_score: float | None = None
        self.candidate: frozenset[int] | None = None
        self.trials_left = self.search_trials
        self.window = Window()
        self.rng = random.Random(self.seed)

    @cached_property
    def measured_acceptance(self) -> float | None:
        """The initial skip set's agreement with the full model on a built-in text, teacher-forced (once)."""
        initial = initial_skip_set(self.backend.num_layers, self.skip_ratio)
        return self_draft_agreement(self.target, self.backend, self.head, initial)

    @property
    def active(self) -> frozenset[int]:
        return self.candidate if self.candidate is not None else self.best

    def draft_token_share(self) -> float:
        """A token through the layers the current skip set runs, and the head."""
        return self.costs.draft_token(self.backend.num_layers - len(self.active))

    def session(self, request: DraftRequest) -> DraftSession:
        return LayerSkipSession(self, SelfDraftSession(self.backend, self.head, request))

    def score(self, skipped: frozenset[int], feedback: StepFeedback) -> None:
        """Count a step drafted with ``skipped`` towards the current window (if that set is still on trial)."""
        if skipped != self.active:
            return
        drafted = len(feedback.draft.tokens)
        per_token = self.costs.draft_token(self.backend.num_layers - len(skipped))
        self.window.tokens += feedback.num_accepted + 1
        self.window.cost += self.costs.step(drafted, per_token)
        self.window.steps += 1
        if self.window.steps >= self.trial_steps:
            self._end_window()

    def _end_window(self) -> None:
        score = self.window.score
        if self.candidate is None:
            self.best_score = score if self.best_score is None else (self.best_score + score) / 2
        elif self.best_score is None or score > self.best_score:
            self.best, self.best_score = self.candidate, score
        self.window = Window()
        if self.candidate is None and self.trials_left > 0:
            self.candidate = self._mutate(self.best)
            self.trials_left -= 1
        else:
            self.candidate = None

    def _mutate(self, skipped: frozenset[int]) -> frozenset[int]:
        """Add, remove or swap one layer; the first and the last layer always run."""
        inner = set(range(1, self.backend.num_layers - 1))
        can_add, can_remove = sorted(inner - skipped), sorted(skipped)
        moves = [m for m, ok in (("add", can_add), ("remove", can_remove), ("swap", can_add and can_remove)) if ok]
        if not moves:
            return skipped
        move = self.rng.choice(moves)
        result = set(skipped)
        if move in ("remove", "swap"):
            result.discard(self.rng.choice(can_remove))
        if move in ("add", "swap"):
            result.add(self.rng.choice(can_add))
        return frozenset(result)


class LayerSkipSession(DraftSession):
    def __init__(self, drafter: LayerSkipDrafter, state: SelfDraftSession) -> None:
        self.drafter = drafter
        self.state = state
        self.used: frozenset[int] | None = None  # the skip set of this step's draft

    def propose(self, context: list[int], max_tokens: int) -> Draft:
        self.used = self.drafter.active
        return self.state.draft(context, max_tokens, self.state.skipping(self.used), self.drafter.threshold)

    def observe(self, context: list[int], feedback: StepFeedback) -> None:
        # Only steps that ran the skip set score it: while the draft-length policy holds drafting off,
        # windows must not elapse, or a candidate would be judged on the rare probes alone.
        if self.used is not None and feedback.asked:
            self.drafter.score(self.used, feedback)
        self.used = None

    def finish(self, context: list[int]) -> None:
        self.state.finish()
