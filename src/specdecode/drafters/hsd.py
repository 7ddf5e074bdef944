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

``levels=auto`` chooses the hierarchy as it goes, by the paper's expected-latency comparison: every lower
level of :data:`LOWER_LEVELS` follows the request, and each round the one expected to yield the most draft-model
tokens per second guesses — its agreement so far (per position, as ``lower_depth=auto``) against the draft
model's forward cost for that width plus the lower level's own measured time to guess, both in seconds of a
one-token draft forward.  When no level beats the draft model alone (one token per forward) none guesses, and
every few rounds the least-tried level guesses one token, so that a level that starts to agree is noticed.

Like ``draft-model``, the session keeps the draft model's cache of the request and re-synchronises on every
``propose``: the cache is cut back to what it shares with the accepted context, the rest fed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from specdecode.drafters import create_drafter, register_drafter
from specdecode.drafters._vocab import HeadRows, RequestRows
from specdecode.drafters._vocab_map import common_prefix_length
from specdecode.drafters.base import Drafter, DraftRequest, DraftSession
from specdecode.drafters.draft_model import (
    choose_with_head,
    loaded_draft,
    time_draft_token,
    time_reading,
    vocab_trim_head,
)
from specdecode.errors import SpecDecodeError
from specdecode.models.base import CausalLM
from specdecode.models.cost import relative_cost_curve
from specdecode.models.loading import LoadedModel, check_same_vocabulary
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
        best, _ = self.best(room)
        if best == 0:
            self.rounds_without += 1
            return 1 if self.rounds_without % PROBE_EVERY == 0 else 0
        return best

    def best(self, room: int, guess_cost: float = 0.0) -> tuple[int, float]:
        """(the guess depth with the most draft-model tokens per unit of cost, that rate); ``guess_cost``: the
        lower level's own time to guess, in one-token draft forwards.  Depth 0 (no guess) yields one token
        per forward: rate 1."""
        best, best_rate, expected, survive = 0, 1.0, 1.0, 1.0
        for depth in range(1, min(room, MAX_GUESS) + 1):
            survive *= self._rate(depth - 1)
            expected += survive
            rate = expected / (self.cost(depth + 1) + guess_cost)
            if rate > best_rate:
                best, best_rate = depth, rate
        return best, best_rate

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

    def cost(self, width: int) -> float:
        """``t(width) / t(1)`` of the draft model's forward, extrapolated linearly past the measured curve."""
        if not self.curve:
            return float(width)  # unmeasured: as if every token cost a forward (guess only what surely pays)
        if width <= len(self.curve):
            return self.curve[width - 1]
        slope = (self.curve[-1] - self.curve[0]) / max(len(self.curve) - 1, 1)
        return self.curve[-1] + slope * (width - len(self.curve))


@dataclass
class LowerLevel:
    """One lower level following a request: its session, its agreement with the draft model, its cost."""

    name: str
    session: DraftSession
    depth: GuessDepth
    guess_s: float = 0.0  # running mean of its propose time
    guesses: int = 0

    def timed_guess(self, written: list[int], wanted: int) -> list[int]:
        tick = time.perf_counter()
        guess = self.session.propose(written, wanted).tokens[:wanted]
        elapsed = time.perf_counter() - tick
        self.guesses += 1
        self.guess_s += (elapsed - self.guess_s) / min(self.guesses, 16)
        return guess


@dataclass
class LevelChooser:
    """Which lower level guesses each round, and how deep: the only one there is, or (``levels=auto``) the one
    with the best expected draft-model tokens per second (see the module docstring)."""

    levels: list[LowerLevel]
    forward_s: float = 0.0  # running mean of a draft forward's seconds, per one-token-forward of cost
    forwards: int = 0
    rounds_without: int = 0

    def choose(self, room: int) -> tuple[LowerLevel | None, int]:
        if len(self.levels) == 1:
            level = self.levels[0]
            return level, level.depth.next(room)
        if room <= 0:
            return None, 0
        scale = self.forward_s or 1.0
        rated = [(level.depth.best(room, level.guess_s / scale), level) for level in self.levels]
        (depth, rate), level = max(rated, key=lambda item: item[0][1])
        if depth > 0:
            self.rounds_without = 0
            return level, depth
        self.rounds_without += 1
        if self.rounds_without % PROBE_EVERY:
            return None, 0
        return min(self.levels, key=lambda lv: sum(lv.depth.reached[:1])), 1  # the least-tried level probes

    def timed_forward(self, seconds: float, width: int) -> None:
        """Learn the seconds of a one-token draft forward from one of ``width`` tokens (its cost curve)."""
        self.forwards += 1
        relative = self.levels[0].depth.cost(width)
        self.forward_s += (seconds / relative - self.forward_s) / min(self.forwards, 16)


@register_drafter("hsd")
class HierarchicalDrafter(Drafter):
    """Hierarchical drafting: a model-free drafter guesses, the draft model verifies it, the target verifies that."""

    provides_probs = True
    reads_context = True

    def __init__(
        self,
        target: LoadedModel,
        draft_model: str | LoadedModel | None = None,
        levels: str = "pld,draft-model",
        lower_depth: int | str = "auto",
        draft_vocab: int | None = None,
    ) -> None:
        super().__init__(target)
        if draft_model is None:
            raise SpecDecodeError("drafter 'hsd' needs --draft-model (the level the target verifies)")
        names = [name.strip() for name in str(levels).split(",")]
        if names == ["auto"]:
            names = ["auto", "draft-model"]
        if len(names) != 2 or names[1] != "draft-model" or names[0] not in (*LOWER_LEVELS, "auto"):
            raise SpecDecodeError(
                f"hsd levels must be 'LOWER,draft-model' with LOWER one of {', '.join(LOWER_LEVELS)}, or auto; "
                f"got {levels!r}"
            )
        if lower_depth != "auto" and (
            not isinstance(lower_depth, int) or isinstance(lower_depth, bool) or lower_depth < 1
        ):
            raise SpecDecodeError(f"hsd lower_depth must be a positive integer or auto, got {lower_depth!r}")
        self.draft = loaded_draft(draft_model, target)
        check_same_vocabulary(target, self.draft)
        self.draft.backend.prepare_drafting()
        # VocabTrim for the draft-model level, as draft-model has it (its drafts are draft-model's own).
        self.head = vocab_trim_head(self.draft, draft_vocab, "hsd")
        # The lower levels draft for the draft model: built for it, as if it were the target.
        chosen = LOWER_LEVELS if names[0] == "auto" else (names[0],)
        self.lowers = {name: create_drafter(name, self.draft) for name in chosen}
        self.lower_depth = None if lower_depth == "auto" or names[0] == "auto" else lower_depth
        self._token_s: float | None = None
        self._reading: float | None = None

    def draft_token_seconds(self) -> float:
        """A draft model's token, timed once: what ``auto`` prices a first draft's tokens at (at most what they
        cost, since the lower level spares some of the draft model's forwards)."""
        if self._token_s is None:
            self._token_s = time_draft_token(self.draft.backend, self.head)
        return self._token_s

    def reading_cost(self) -> float:
        """Its draft model's reading of a prompt against the target's prefill, timed once (``time_reading``)."""
        if self._reading is None:
            self._reading = time_reading(self.draft.backend, self.target.backend, self.head)
        return self._reading

    def session(self, request: DraftRequest) -> DraftSession:
        lower_request = DraftRequest(prompt_ids=request.prompt_ids, sampling=request.sampling, seed=request.seed)
        # The draft model's cost curve: measured on first use, then cached per model.
        curve = (relative_cost_curve(self.draft.backend) or ()) if self.lower_depth is None else ()
        levels = [
            LowerLevel(name, drafter.session(lower_request), GuessDepth(self.lower_depth, curve=curve))
            for name, drafter in self.lowers.items()
        ]
        rows = self.head.for_prompt(request.prompt_ids) if self.head is not None else None
        return HierarchicalSession(self.draft.backend, LevelChooser(levels), request, rows)

    def reset(self) -> None:
        for drafter in self.lowers.values():
            drafter.reset()


class HierarchicalSession(DraftSession):
    """One request: the draft model's cache of it, and the lower level(s) drafting for it."""

    def __init__(
        self, backend: CausalLM, chooser: LevelChooser, request: DraftRequest, head: HeadRows | None = None
    ) -> None:
        self.backend = backend
        self.chooser = chooser
        self.request = request
        self.vocab = RequestRows(head)  # VocabTrim's rows, if any, widened as the text grows
        self.generator = request.torch_generator()
        self.cache = backend.new_cache()
        self.cached: list[int] = []  # the tokens whose entries the draft model's cache holds, in order
        self.draft_forwards = 0  # draft-model forwards so far (what the lower level saves)

    def _choose(self, logits: torch.Tensor, position: int) -> tuple[int, torch.Tensor | None, float]:
        """The draft model's token at absolute ``position``, chosen as ``draft-model`` chooses it."""
        return choose_with_head(logits, self.vocab.rows, self.request, position, self.generator)

    def _logits(self, fed: torch.Tensor, first_row: int) -> torch.Tensor:
        """The draft model's logits after each of ``fed[first_row:]`` (fed on top of its cache): over the
        VocabTrim rows when it has them, through the backend's fastest one-token route when one token is fed."""
        return self.backend.draft_logits(fed, self.cache, self.vocab.rows, first_row)

    def propose(self, context: list[int], max_tokens: int) -> Draft:
        max_tokens = min(max_tokens, self.backend.max_context - len(context))
        if max_tokens <= 0:
            return Draft(tokens=[])
        self.vocab.follow(context)
        keep = min(common_prefix_length(self.cached, context), len(context) - 1)
        self.cache.crop(keep)
        self.cached = list(context[:keep])
        pending = list(context[keep:])  # not yet in the cache; always ends with the last context token
        written = list(context)  # the context, then what the draft model has written so far
        tokens: list[int] = []
        prob_rows: list[torch.Tensor] = []
        confidence: list[float] = []
        setup_s = 0.0  # the first forward's share of catching up with the context (Draft.setup_s)
        while len(tokens) < max_tokens:
            room = max_tokens - len(tokens) - 1  # the draft model adds a token of its own every round
            level, wanted = self.chooser.choose(room)
            guess = level.timed_guess(written, wanted) if level is not None and wanted > 0 else []
            fed = torch.tensor(pending + guess, dtype=torch.long)
            # Rows: what follows the last written token, then what follows each guessed token.
            tick = time.perf_counter()
            logits = self._logits(fed, len(pending) - 1)
            elapsed = time.perf_counter() - tick
            self.chooser.timed_forward(elapsed, len(fed))
            setup_s += elapsed * (len(pending) - 1) / len(fed)
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
            for each in self.chooser.levels:  # every level follows the text; the one that guessed learns how it did
                mine = each is level
                if mine:
                    each.depth.observe(len(guess), agreed)
                path = tuple(range(agreed)) if mine else ()
                feedback = StepFeedback(Draft(tokens=guess if mine else []), path, torch.empty(0), asked=mine)
                each.session.observe(written, feedback)
            if self.request.stop(confidence):  # SpecDec++-style early stop, as draft-model
                break
        probs_out = torch.stack(prob_rows) if prob_rows else None
        return Draft(tokens=tokens, probs=probs_out, confidence=confidence, setup_s=setup_s)

    def finish(self, context: list[int]) -> None:
        for level in self.chooser.levels:
            level.session.finish(context)
        self.cache.release()
