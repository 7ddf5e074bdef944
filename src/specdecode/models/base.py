"""The backend protocol the engine and drafters are written against, and the optional capabilities a
drafter may ask a backend for.

A backend owns a causal LM and the KV caches of the sequences it decodes.  The engine needs a cache per
sequence (all of a batch from one :class:`KVPool`), one forward over the *new* tokens of many sequences
at once (:meth:`CausalLM.forward_batch`: ragged — each sequence brings its own number of tokens,
positions and tree mask, and sees only its own cache), a way to cut a cache back to an accepted length,
and a few facts (vocabulary size, context length, EOS ids, device).

Everything else is a *capability*: a small interface a backend may also implement and a drafter asks
for with :func:`require_capability` — layer-wise execution for self-speculation today, hidden states for
trained heads tomorrow — so that no drafter imports a particular backend, and a backend without the
capability is refused with a clear error instead of failing deep inside a forward.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from specdecode.errors import SpecDecodeError


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [rows, vocab] float32, one row per requested position
    #: [n_new, d_model * len(layers)]: the hidden states a sequence asked for (``SequenceInput.hidden_layers``
    #: or ``forward_layers(output_hidden=True)``), for every new token, layers side by side; else None.
    hidden: torch.Tensor | None = None
    #: [rows] int64: each requested row's greedy choice (``argmax``, the first on a tie), where the input asked for
    #: ``choices_only`` and the backend computed them without the logits, which then have no rows; else None.
    choices: torch.Tensor | None = None


class KVCache(ABC):
    """Keys and values of one sequence's tokens processed so far, in order."""

    @property
    @abstractmethod
    def length(self) -> int:
        """Number of token positions held."""

    @abstractmethod
    def crop(self, length: int) -> None:
        """Forget every position at or after ``length`` (rollback after rejected drafts)."""

    def keep(self, start: int, offsets: list[int]) -> None:
        """Keep positions ``start + offsets`` (ascending) after ``start`` and drop the rest: compacts a
        verified token tree to its accepted path.  A contiguous prefix is a plain crop."""
        if offsets == list(range(len(offsets))):
            self.crop(start + len(offsets))
        else:
            self._gather(start, offsets)

    def _gather(self, start: int, offsets: list[int]) -> None:
        raise NotImplementedError(f"{type(self).__name__} cannot compact a token tree")

    def release(self) -> None:  # noqa: B027
        """The sequence is finished or cancelled: give its storage back at once."""

    def adopt_prefix(self, source: KVCache, length: int) -> bool:
        """Take ``source``'s first ``length`` positions as this empty cache's own (a prompt prefix another
        sequence has read: the automatic prefix cache); False, nothing done, where the backend cannot."""
        return False


class KVPool(ABC):
    """Cache storage shared by the sequences of a batch; a sequence's cache is a slot in it."""

    @abstractmethod
    def allocate(self) -> KVCache:
        """An empty cache for one more sequence (``KVCache.release`` returns the slot)."""

    @property
    @abstractmethod
    def active(self) -> int:
        """Slots in use."""

    def reserve(self, slots: int, length: int) -> None:  # noqa: B027
        """A hint: room for ``slots`` sequences of ``length`` positions will be needed (growing storage
        later costs a copy of everything held)."""


@dataclass
class SequenceInput:
    """One sequence's part of a batched forward.

    tokens: [n] int64 new tokens, run after everything in ``cache`` and appended to it.
    positions: [n] absolute positions; default ``cache.length + arange(n)``.
    tree_mask: [n, n] bool, ``tree_mask[i, j]`` = new token i may attend to new token j; default causal.
        Every new token always sees the sequence's whole cache, and nothing of any other sequence.
    logits_rows: which of the n rows get logits (default: all).
    hidden_layers: also return these hidden states of every new token (a backend with :class:`HiddenStates`;
        see there for the numbering), concatenated in this order in ``ForwardOutput.hidden``.
    invariant: whether every row must get bitwise what it would get in any other call (a backend that makes
        rows batch invariant does so at some cost).  False where nothing depends on it: a prompt's chunk, fed
        alike whether decoding is plain or speculative, alone or in a batch, and a draft model's forwards, which
        never change the output; the backend may then run the rows in the fastest kernel it has, as long as
        they come out the same whatever else shares the forward.
    choices_only: whether the requested rows are read for their greedy choice (``argmax``) and nothing else: a
        backend may then return ``ForwardOutput.choices``, bitwise the logits' argmax, and skip the logits.
    """

    tokens: torch.Tensor
    cache: KVCache
    positions: torch.Tensor | None = None
    tree_mask: torch.Tensor | None = None
    logits_rows: torch.Tensor | slice | None = None
    hidden_layers: tuple[int, ...] = ()
    invariant: bool = True
    choices_only: bool = False


class CausalLM(ABC):
    """A causal language model backend that decodes many sequences per forward."""

    name: str
    vocab_size: int
    max_context: int
    num_layers: int
    eos_token_ids: tuple[int, ...]
    device: torch.device = torch.device("cpu")

    @abstractmethod
    def new_pool(self) -> KVPool:
        """Empty cache storage for a batch of sequences."""

    def new_cache(self) -> KVCache:
        """An empty KV cache for one sequence on its own (a private one-slot pool)."""
        return self.new_pool().allocate()

    @abstractmethod
    def forward_batch(self, inputs: list[SequenceInput]) -> list[ForwardOutput]:
        """One forward over every sequence's new tokens (all caches from one pool); one output each."""

    def forward(
        self,
        tokens: torch.Tensor,
        cache: KVCache,
        *,
        positions: torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
        logits_rows: torch.Tensor | slice | None = None,
        hidden_layers: tuple[int, ...] = (),
        invariant: bool = True,
    ) -> ForwardOutput:
        """One sequence's forward (see :class:`SequenceInput`)."""
        item = SequenceInput(tokens, cache, positions, tree_mask, logits_rows, hidden_layers, invariant)
        return self.forward_batch([item])[0]

    def draft_logits(
        self,
        tokens: torch.Tensor,
        cache: KVCache,
        head: Callable[[torch.Tensor], torch.Tensor] | None = None,
        first_row: int = -1,
    ) -> torch.Tensor:
        """[rows, vocab] logits after each of ``tokens[first_row:]`` (by default the last one) fed on top of
        ``cache`` (which grows by all of them), for a draft: a backend may take a faster route for one token
        whose last bits differ from :meth:`forward`'s, since the target verifies.  ``head`` (VocabTrim's rows,
        on final-normed states) replaces the LM head where the backend has an output stage of its own
        (:class:`LayerwiseExecution`); the logits are then over its rows."""
        if head is not None:
            raise SpecDecodeError(f"{self.name}: drafting through a VocabTrim head needs layer-wise execution")
        return self.forward(tokens, cache, logits_rows=slice(first_row, None), invariant=False).logits

    def rows_read_alone(self) -> int | None:
        """The fewest tokens a prompt chunk needs for this backend to compute each of its rows on its own: a prompt
        token then gets bitwise the same keys and values in any chunk of at least that many tokens, so a prefix of any
        length may be shared (:mod:`specdecode.prefix_cache`).  None (the default): a chunk's rows may depend on the
        chunk, and only whole chunks at the fixed offsets are shared."""
        return None

    def prepare_drafting(self) -> None:  # noqa: B027
        """Build what :meth:`draft_logits` needs before its first call, so that no draft token is timed with a
        one-off setup in it (a drafter prices its tokens by their time).  Default: nothing to build."""


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary position embedding by halves (transformers' ``rotate_half`` convention), as Llama-shaped
    decoders apply it to queries and keys."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


@dataclass(frozen=True)
class DecoderShape:
    """One decoder layer's sizes and constants (Llama-style: RMSNorm, rotary attention, gated MLP)."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float


class HiddenStates(ABC):
    """Capability: the target's hidden states out of a forward it runs anyway, and its token embedding.

    What trained draft heads (EAGLE, Medusa, Hydra) draft from: they read the features of the tokens the
    target just verified, at no extra forward.  A backend with this capability honours
    ``SequenceInput.hidden_layers``: index ``i < num_layers`` is the residual stream entering decoder layer
    ``i`` (0: the token embeddings; EAGLE-3 reads three of these), ``num_layers`` is the final hidden state
    after the model's final norm — what its LM head reads."""

    num_layers: int
    hidden_size: int
    dtype: torch.dtype

    @abstractmethod
    def decoder_shape(self) -> DecoderShape:
        """The shape of one of the model's decoder layers, so that a head can mirror it."""

    @abstractmethod
    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's final norm on [n, hidden_size] residual states (what its LM head reads), without
        gradient: a head starts from the target's own output stage."""

    @abstractmethod
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The target's input embeddings of ``tokens`` [n] → [n, hidden_size] (whatever scaling the model
        applies included), without gradient."""


class LayerwiseExecution(ABC):
    """Capability: run a subset of the model's layers on a sequence, and reuse its output stage.

    What self-speculation needs (``layer-skip``, ``early-exit``, ``kangaroo``): a draft runs the target
    with layers skipped or exited early on top of the target's own cache, then the model's own final norm
    and (a restricted) LM head."""

    num_layers: int
    hidden_size: int
    dtype: torch.dtype

    @abstractmethod
    def forward_layers(
        self,
        tokens: torch.Tensor,
        cache: KVCache,
        *,
        skip_layers: frozenset[int] = frozenset(),
        exit_layer: int | None = None,
        output_hidden: bool = False,
        logits_rows: torch.Tensor | slice | None = None,
    ) -> ForwardOutput:
        """Like ``forward`` over one sequence, with ``skip_layers`` left out and nothing after
        ``exit_layer`` run; ``hidden`` is then the residual stream entering the final norm.  A skipped
        layer writes nothing into the cache: whoever mixes layer subsets on one cache crops first."""

    @abstractmethod
    def exit_logits(
        self, hidden: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor] | None = None
    ) -> torch.Tensor:
        """The output stage (final norm, LM head or ``head``, logit softcapping) on [n, d] residual states."""

    @abstractmethod
    def head_logits(
        self, normed: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor] | None = None
    ) -> torch.Tensor:
        """The output stage after the final norm: LM head (or ``head``) and logit softcapping."""

    @abstractmethod
    def output_weight(self) -> torch.Tensor:
        """The LM head's [vocab, d] weight as a dense tensor."""

    @abstractmethod
    def lm_head(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The full LM head: [n, d] final-normed states → [n, vocab] logits (before softcapping)."""

    @abstractmethod
    def head_fraction(self) -> float:
        """The LM head's share of the parameters a one-token forward reads (it is large in small models)."""


Capability = TypeVar("Capability")


def require_capability(backend: object, capability: type[Capability], who: str) -> Capability:
    """``backend`` as a ``capability``, or a clear error naming who needed it and why."""
    if not isinstance(backend, capability):
        doc = (capability.__doc__ or capability.__name__).strip().splitlines()[0].rstrip(".")
        raise SpecDecodeError(
            f"{who} needs a backend with {capability.__name__} ({doc}); {type(backend).__name__} has none"
        )
    return backend
