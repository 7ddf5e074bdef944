"""The model backend protocol the engine and drafters are written against.

A backend owns a causal LM and its KV cache.  The engine only ever needs four things from it:
a fresh cache, a forward over *new* tokens on top of that cache, a way to cut the cache back to an
accepted length, and a few facts (vocabulary size, context length, EOS ids).  The forward already
takes what later drafters and verifiers need, so adding them does not change this file:

* ``positions`` and ``tree_mask`` — verify a token *tree* in one pass (depth-based positions,
  each node attending only to its ancestors);
* ``logits_rows`` — compute the LM head only for rows that are read (the head is often the largest
  matrix of a small model);
* ``output_hidden`` — hidden states for trained draft heads;
* ``skip_layers`` / ``exit_layer`` — run a shallower version of the target for self-speculation.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [rows, vocab] float32, one row per requested position
    hidden: torch.Tensor | None = None  # [n_new, d_model] final hidden states, if requested


class KVCache(ABC):
    """Keys and values of the tokens processed so far, in order."""

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


class CausalLM(ABC):
    """A causal language model backend for one sequence at a time."""

    name: str
    vocab_size: int
    max_context: int
    num_layers: int
    eos_token_ids: tuple[int, ...]

    @abstractmethod
    def new_cache(self) -> KVCache:
        """An empty KV cache for one sequence."""

    @abstractmethod
    def forward(
        self,
        tokens: torch.Tensor,
        cache: KVCache,
        *,
        positions: torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
        logits_rows: torch.Tensor | slice | None = None,
        output_hidden: bool = False,
        skip_layers: frozenset[int] = frozenset(),
        exit_layer: int | None = None,
    ) -> ForwardOutput:
        """Run ``tokens`` ([n] int64) after everything in ``cache`` and append them to it.

        positions: [n] absolute positions; default ``cache.length + arange(n)``.
        tree_mask: [n, n] bool, ``tree_mask[i, j]`` = new token i may attend to new token j;
            default causal.  Every new token always sees the whole cache.
        logits_rows: which of the n rows get logits (default: all).
        skip_layers / exit_layer: run a subset of the layers (self-speculation).  Backends that
            cannot do this raise ``NotImplementedError``.
        """
