"""The drafter protocol: a shared drafter that learns across requests, and one drafting session per request.

Modelled on transformers' ``CandidateGenerator`` and vLLM's one-file-per-proposer layout.  A
:class:`Drafter` is built once per loaded generator and keeps only what it learns across requests
(bounded; sessions of a batch share it from the engine's thread).  For every request the engine asks it
for a :class:`DraftSession`, handing over everything that belongs to that request in a
:class:`DraftRequest` — prompt, sampling, a seed, the draft-length policy's stop rule, the target's cache
of this sequence — so no per-request state is ever set on a shared object from outside.

A session never sees the verifier: it returns a :class:`~specdecode.types.Draft`, and if it sampled its
tokens from a distribution it returns that distribution too, so that lossless speculative sampling can
correct for it.  A drafter without probabilities (n-gram lookup) is treated as a point-mass proposal.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import torch

from specdecode.errors import SpecDecodeError
from specdecode.sampling_params import SamplingParams
from specdecode.types import Draft, StepFeedback

if TYPE_CHECKING:
    from specdecode.models.base import KVCache
    from specdecode.models.loading import LoadedModel


def flag_option(name: str, value: object) -> bool:
    """A drafter's on/off option, as given in Python or on a command line (``true``/``false``, ``1``/``0``...)."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in {"true", "1", "yes", "on"}:
        return True
    if text in {"false", "0", "no", "off"}:
        return False
    raise SpecDecodeError(f"{name} must be true or false, got {value!r}")


#: Called with the confidences of the tokens drafted so far, says whether to stop drafting.
StopRule = Callable[[Sequence[float]], bool]


@dataclass(frozen=True)
class DraftRequest:
    """Everything a drafting session needs to know about its request.

    seed: the request's seed (the engine draws one when the user gave none); a session's random draws
        come from :meth:`torch_generator` / :meth:`numpy_rng`, a stream of their own derived from it, so a
        seeded request drafts the same way every time and never touches a global RNG.
    stop_rule: the draft-length policy's SpecDec++-style stop rule, for drafters that know a confidence
        per token; None: draft as deep as asked.
    target_cache: the target's verification cache of this sequence, holding ``context[:-1]`` whenever
        ``propose`` is called.  A drafter that runs the target itself (self-speculation) may append to it
        while drafting if it crops it back before returning; everyone else ignores it.  None outside the
        engine.
    """

    prompt_ids: tuple[int, ...]
    sampling: SamplingParams = SamplingParams()
    seed: int = 0
    stop_rule: StopRule | None = None
    target_cache: KVCache | None = None

    def torch_generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        generator = torch.Generator(device=device)
        generator.manual_seed((self.seed + 1) % 2**63)  # a different stream from the verifier's
        return generator

    def numpy_rng(self) -> np.random.Generator:
        return np.random.default_rng([self.seed % 2**64, 1])

    def stop(self, confidences: Sequence[float]) -> bool:
        return self.stop_rule is not None and self.stop_rule(confidences)


class DraftSession(ABC):
    """One request's drafting: ``propose`` → (verification) → ``observe`` per step, ``finish`` at the end.

    ``context`` always holds prompt + every token accepted so far, so a session may keep incremental
    state but can always resynchronise from it.

    A session that drafts from the target's features (trained heads) names them in ``hidden_layers``
    (numbered as in :class:`~specdecode.models.base.HiddenStates`): the engine then asks the prompt's
    prefill and every verification forward for them and hands them over — ``observe_prompt`` with the
    prompt's, ``StepFeedback.target_hidden`` with each step's — at no extra forward."""

    hidden_layers: tuple[int, ...] = ()
    #: It reads the target's logits (``StepFeedback.target_logits``): the verification forward then computes them even
    #: where the request's greedy verifier reads only each row's choice.
    reads_target_logits: bool = False
    #: Its proposals cost next to nothing and do not depend on the depth asked for (a lookup): the engine
    #: asks for the deepest draft before it plans the step, so the plan can weigh each draft's confidences.
    proposes_first: bool = False

    def observe_prompt(self, hidden: torch.Tensor) -> None:  # noqa: B027
        """The prompt but its last token has run through the target; ``hidden``: their features, one row
        per token (only called for sessions with ``hidden_layers``)."""

    @abstractmethod
    def propose(self, context: list[int], max_tokens: int) -> Draft:
        """Propose up to ``max_tokens`` tokens that follow ``context``."""

    def observe(self, context: list[int], feedback: StepFeedback) -> None:  # noqa: B027
        """Verification is done: ``context`` now ends with the accepted tokens and the target's own."""

    def finish(self, context: list[int]) -> None:  # noqa: B027
        """The request is over (finished or cancelled): hand what is worth keeping to the drafter."""


class Drafter(ABC):
    """Base class of every drafter.  Subclasses register themselves with ``@register_drafter``."""

    name: ClassVar[str]
    #: True if the drafter can use a draft distribution (sampling mode benefits from ``Draft.probs``).
    provides_probs: ClassVar[bool] = False
    #: True if the drafter cannot be built before something is trained for the target (e.g. an adapter).
    needs_training: ClassVar[bool] = False
    #: True if the drafter runs a model of its own over the context (its first draft also reads the prompt):
    #: the draft-length policy drafts it shallow until a draft token's cost is timed, from the first step.
    reads_context: ClassVar[bool] = False
    #: The share of its tokens the target is expected to accept before any is verified: ``auto`` weighs a cold
    #: request's first drafts (and a draft model's reading of the prompt) with it.  None: the policy's default.
    #: Declared; a drafter that can measure it does (:attr:`measured_acceptance`).
    prior_acceptance: float | None = None
    #: False for plain decoding (``none``), which never drafts: ``auto`` then has no depth to choose and
    #: need not measure the target's verification cost curve (seconds on a CPU) for it.
    drafts: ClassVar[bool] = True
    #: True if the drafter goes on working after a step returns (a worker drafting ahead, PEARL): that work
    #: overlaps whatever runs next, so the benchmark cannot time it in turns with others (its lockstep).
    works_between_steps: bool = False
    #: The option naming another drafter that this one joins (``rasd``'s ``with``): the options this one does not
    #: take are that drafter's, passed on to it (:func:`specdecode.drafters.accepted_options`).  None: no such option.
    passes_options_to: ClassVar[str | None] = None

    def __init__(self, target: LoadedModel) -> None:
        self.target = target

    def draft_token_seconds(self) -> float | None:
        """For a drafter that reads the context: the seconds of one draft token, which ``auto`` prices its first
        draft of a prompt at (it weighs the reading of the prompt against what drafting will save); None where
        unknown (the token is then priced at the reading's share of a target forward)."""
        return None

    def draft_token_share(self) -> float | None:
        """A draft token's cost in one-token forwards of the target, where the drafter knows it by construction (a
        self-drafter runs a share of the target's layers and its head): ``auto`` prices drafts at it until it has
        timed them, so a cold request's first draft is weighed, not free.  None: unknown."""
        return None

    def acceptance_prior(self) -> float | None:
        """The share of its tokens the target is expected to accept before any is verified, which ``auto`` weighs a
        cold request's first drafts with: measured where the drafter can (:attr:`measured_acceptance`), else
        ``prior_acceptance``."""
        measured = self.measured_acceptance
        return self.prior_acceptance if measured is None else measured

    @cached_property
    def measured_acceptance(self) -> float | None:
        """What a drafter that can measure its acceptance measures, once (a self-drafter: teacher-forced on a built-in
        text, :mod:`specdecode.drafters._calibration`); None: nothing measured."""
        return None

    def prepare(self) -> bool:
        """Measure now what this drafter measures of itself before its first draft whatever the draft length (an
        early exit's agreement with the target, which picks its exit); True if it has such a measure."""
        return False

    def reading_cost(self) -> float | None:
        """For a drafter that reads the context: its reading of a prompt in seconds per second of the target's prefill
        of it, which ``auto`` weighs against what a cold request's drafts will save; None: unknown, never weighed."""
        return None

    @abstractmethod
    def session(self, request: DraftRequest) -> DraftSession:
        """A drafting session for one request."""

    def reset(self) -> None:  # noqa: B027
        """Forget everything learned across requests (drafters that keep history must bound it)."""


class StatelessSession(DraftSession):
    """A session for drafters that need nothing per request: ``propose`` is a function of the context."""

    def __init__(self, propose: Callable[[list[int], int], Draft], proposes_first: bool = False) -> None:
        self._propose = propose
        self.proposes_first = proposes_first

    def propose(self, context: list[int], max_tokens: int) -> Draft:
        return self._propose(context, max_tokens)
