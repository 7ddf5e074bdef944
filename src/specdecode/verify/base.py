"""What every verifier shares: the rows of the target's verification forward it reads (:class:`TargetRows`), the
class it declares itself with (:class:`VerifierMethod`) and the checks of its options.

A verifier is one module of this package::

    @dataclass(frozen=True)
    class MyOptions:
        strictness: float = 0.5

        def __post_init__(self) -> None:
            check_fractions(self, "strictness")


    @register_verifier("mine", lossless=False)
    class Mine(VerifierMethod):
        \"\"\"one line for ``specdecode verifiers`` (LOSSY)\"\"\"

        options = MyOptions

        @staticmethod
        def verify(rows: TargetRows, draft: Draft, options: MyOptions) -> Verdict: ...

and ``--verifier mine:strictness=0.7``, ``"verifier": "mine"`` and ``verifier="mine"`` choose it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from specdecode.errors import SpecDecodeError
from specdecode.logits_processing import RowHistory, process_rows
from specdecode.models.base import HiddenStates, require_capability
from specdecode.sampling import argmax_last, coupled_sample, sample, sampling_probs, token_logprobs
from specdecode.sampling_params import SamplingParams
from specdecode.types import TokenLogprob

if TYPE_CHECKING:
    from specdecode.models.base import CausalLM
    from specdecode.types import Draft, Verdict


@dataclass
class TargetRows:
    """The target's output of one verification forward in the row layout (row 0 follows the context, row i + 1
    follows draft node i), read lazily along the walked path, and what the request's sampling needs.

    An exact decision reads :attr:`processed_logits`: each row with the request's bias, penalties and ``min_tokens``
    applied over that row's own prefix (``history``; :mod:`specdecode.logits_processing`)."""

    logits: torch.Tensor  # [nodes + 1, vocab] raw
    sampling: SamplingParams
    seed: int | None = None  # a coupled request's seed
    first_position: int = 0  # the absolute position row 0 predicts (the context's length)
    generator: torch.Generator | None = None  # draws of unseeded (or uncoupled) sampling
    final_hidden: torch.Tensor | None = None  # [nodes + 1, hidden_size], for a verifier that reads_final_hidden
    target_name: str = ""  # the target model's name: where a verifier's trained files live
    history: RowHistory | None = None  # what precedes each row: the context and the draft
    #: [nodes + 1] each row's greedy choice, where the forward computed those instead of the logits (which then have
    #: no rows): for a request that reads nothing else (:attr:`specdecode.engine.Sequence.choices_suffice`).
    choices: torch.Tensor | None = None
    _probs: dict[int, torch.Tensor] = field(default_factory=dict)
    _processed: torch.Tensor | None = None

    @property
    def processed_logits(self) -> torch.Tensor:
        """[nodes + 1, vocab]: the logits the request's sampling reads, each row processed with its own prefix."""
        if self._processed is None:
            self._processed = process_rows(self.logits, self.sampling, self.history)
        return self._processed

    def greedy_choices(self) -> list[int]:
        """The argmax of each row's processed logits (the forward's own choices where it computed those only)."""
        if self.choices is not None:
            return self.choices.tolist()
        return argmax_last(self.processed_logits)  # one host transfer for the whole tree

    def choice(self, row: int, position: int) -> int:
        """The token the exact verifier would take at ``row`` (which predicts absolute ``position``)."""
        if self.sampling.greedy and self.choices is not None:
            return int(self.choices[row])
        logits = self.processed_logits[row]
        if self.sampling.greedy:
            return int(logits.argmax())
        if self.sampling.is_coupled and self.seed is not None:
            return coupled_sample(logits, self.sampling, self.seed, position)
        return sample(sampling_probs(logits.float().cpu(), self.sampling), self.generator)

    def logprobs(self, draft: Draft, verdict: Verdict, top: int) -> list[TokenLogprob]:
        """The log-probabilities of the tokens ``verdict`` emits, each read from the row that predicts it and so with
        its own prefix (the same numbers plain decoding reads), with the ``top`` most likely alternatives'."""
        rows = [0, *(node + 1 for node in verdict.path)]
        tokens = [*(draft.tokens[node] for node in verdict.path), verdict.next_token]
        return token_logprobs(self.processed_logits[rows], tokens, top)

    def raw_probs(self, row: int) -> torch.Tensor:
        """softmax of the raw logits (temperature 1, nothing cut): the model's own uncertainty at ``row``."""
        if row not in self._probs:
            self._probs[row] = torch.softmax(self.logits[row].float(), dim=-1).cpu()
        return self._probs[row]

    def processed_probs(self, row: int) -> torch.Tensor:
        """The distribution the request samples from (processing, temperature, min-p, top-k, top-p); the raw one when
        greedy."""
        if self.sampling.greedy:
            return self.raw_probs(row)
        return sampling_probs(self.processed_logits[row].float(), self.sampling).cpu()


@dataclass(frozen=True)
class NoOptions:
    """The options of a verifier without knobs."""


class VerifierMethod:
    """Base of every verifier; subclasses register with ``@register_verifier("name", lossless=...)``, which sets
    ``name`` and ``lossless``, and are described by their docstring's first line."""

    name: ClassVar[str]
    lossless: ClassVar[bool]
    options: ClassVar[type] = NoOptions  # a frozen dataclass of its knobs, validated in its __post_init__
    reads_final_hidden: ClassVar[bool] = False  # the verification forward then records TargetRows.final_hidden
    #: At temperature 0 it reads each row's greedy choice and nothing else (TargetRows.greedy_choices): the forward
    #: may then compute the choices without the logits (SequenceInput.choices_only).
    greedy_reads_choices_only: ClassVar[bool] = False

    @classmethod
    def prepare(cls, target: CausalLM, options: Any) -> None:
        """Refuse before a request starts what cannot run on ``target``."""
        if cls.reads_final_hidden:
            require_capability(target, HiddenStates, f"verifier {cls.name!r}")

    @staticmethod
    def verify(rows: TargetRows, draft: Draft, options: Any) -> Verdict:
        """The path of draft nodes kept and the target's token after it."""
        raise NotImplementedError


def check_fractions(options: object, *names: str) -> None:
    """Each named option a number in [0, 1]."""
    for name in names:
        value = getattr(options, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
            raise SpecDecodeError(f"verifier option {name} must be a number in [0, 1], got {value!r}")


def check_integers(options: object, **lowest: int) -> None:
    """Each named option an integer at least its given lowest value."""
    for name, low in lowest.items():
        value = getattr(options, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise SpecDecodeError(f"verifier option {name} must be an integer >= {low}, got {value!r}")
