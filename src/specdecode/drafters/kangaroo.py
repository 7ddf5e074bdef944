"""Kangaroo self-drafting: the target's first L layers plus a small trained adapter, then the target's own
final norm and LM head.

After Liu et al. 2024, "Kangaroo: Lossless Self-Speculative Decoding via Double Early Exiting".  The
adapter is a residual MLP block on the exit layer's hidden state (attention-free, so it needs no cache
of its own), trained by ``specdecode train kangaroo`` to match the full model's next-token distribution
(:mod:`specdecode.train.kangaroo`).  Its output projection starts at zero, so an untrained adapter is
exactly the plain early exit.  Drafting stops at the first token whose probability is below
``threshold`` (Kangaroo's second early exit).  The default 0.35 comes from held-out calibration of the
SmolLM2-135M adapter (exit 10/30): tokens drafted at >= 0.3 confidence were right 39% of the time,
more than the ~0.15 target-forwards a further draft token costs, and below it they rarely pay.

Drafts use the target's LM head restricted to the adapter's vocabulary (the first ``draft_vocab`` ids
plus every token the full model predicted in the training data, saved with the adapter) and the
prompt's tokens; any other ``draft_vocab`` than the default uses the ``draft_vocab`` most frequent ids
instead (0: the full head).
"""

from __future__ import annotations

from functools import cached_property, partial
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from specdecode.config import DEFAULT_DRAFT_VOCAB
from specdecode.drafters import register_drafter
from specdecode.drafters._calibration import self_draft_agreement
from specdecode.drafters._self_draft import CostModel, SelfDraftSession, require_layer_backend, tail
from specdecode.drafters._vocab import DraftHead, frequent_tokens
from specdecode.drafters.base import Drafter, DraftRequest, DraftSession
from specdecode.errors import SpecDecodeError
from specdecode.heads.files import replace_atomically
from specdecode.models.artifacts import trained_artifact_path
from specdecode.models.base import LayerwiseExecution
from specdecode.models.loading import LoadedModel
from specdecode.types import Draft

ADAPTER_FILE = "kangaroo-adapter.pt"
_FORMAT = 1


class KangarooAdapter(nn.Module):
    """``h + W_down · silu(W_up · rmsnorm(h))`` on the exit layer's residual stream."""

    def __init__(self, exit_layer: int, hidden_size: int, inner_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.exit_layer = exit_layer
        #: Token ids the draft head keeps (frequent ids + what the model predicted in the training data);
        #: None: the drafter's default subset.
        self.vocab: torch.Tensor | None = None
        self.norm = nn.RMSNorm(hidden_size, eps=eps)
        self.up = nn.Linear(hidden_size, inner_size)
        self.down = nn.Linear(inner_size, hidden_size)
        nn.init.zeros_(self.down.weight)
        nn.init.zeros_(self.down.bias)

    @classmethod
    def for_backend(
        cls, backend: LayerwiseExecution, exit_layer: int, inner_size: int | None = None
    ) -> KangarooAdapter:
        hidden = backend.hidden_size
        return cls(exit_layer, hidden, inner_size or hidden).to(device=backend.device, dtype=backend.dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.down(nn.functional.silu(self.up(self.norm(hidden))))

    def save(self, path: Path, backend: LayerwiseExecution) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "format": _FORMAT,
            "model": backend.name,
            "num_layers": backend.num_layers,
            "exit_layer": self.exit_layer,
            "hidden_size": self.up.in_features,
            "inner_size": self.up.out_features,
            "state_dict": {k: v.detach().cpu() for k, v in self.state_dict().items()},
            "vocab": self.vocab,
        }
        replace_atomically(path, partial(torch.save, payload))

    @classmethod
    def load(cls, path: Path, backend: LayerwiseExecution) -> KangarooAdapter:
        try:
            payload = torch.load(path, map_location="cpu", weights_only=True)
            adapter = cls(int(payload["exit_layer"]), int(payload["hidden_size"]), int(payload["inner_size"]))
            adapter.load_state_dict(payload["state_dict"])
            adapter.vocab = payload.get("vocab")
        except (OSError, RuntimeError, KeyError, TypeError, ValueError) as exc:
            raise SpecDecodeError(f"cannot read kangaroo adapter {path}: {exc}") from exc
        if payload["num_layers"] != backend.num_layers or payload["hidden_size"] != backend.hidden_size:
            raise SpecDecodeError(
                f"kangaroo adapter {path} was trained for {payload['model']!r} "
                f"({payload['num_layers']} layers, d={payload['hidden_size']}), not for {backend.name!r}"
            )
        return adapter.to(device=backend.device, dtype=backend.dtype).eval()


def default_adapter_path(model_name: str) -> Path | None:
    """Where ``specdecode train kangaroo`` saves by default and the drafter looks."""
    return trained_artifact_path(model_name, ADAPTER_FILE)


@register_drafter("kangaroo")
class KangarooDrafter(Drafter):
    """Kangaroo: the target's first layers + a trained adapter draft; stops when unsure (needs training)."""

    provides_probs = True
    #: Cannot be built with default options until ``specdecode train kangaroo`` has run for the model.
    needs_training: ClassVar[bool] = True

    def __init__(
        self,
        target: LoadedModel,
        adapter: str | KangarooAdapter | None = None,
        threshold: float = 0.35,
        draft_vocab: int = DEFAULT_DRAFT_VOCAB,
    ) -> None:
        super().__init__(target)
        backend = require_layer_backend(target.backend, "kangaroo")
        if not 0.0 <= threshold < 1.0:
            raise SpecDecodeError(f"kangaroo: threshold must be in [0, 1), got {threshold!r}")
        self.adapter = adapter if isinstance(adapter, KangarooAdapter) else self._load(target, adapter)
        self.adapter.eval()
        self.backend = backend
        self.threshold = threshold
        self.skipped = tail(self.adapter.exit_layer, backend.num_layers)
        # The adapter's own vocabulary, unless a size is asked for explicitly (0: the full head).
        vocab = self.adapter.vocab if draft_vocab == DEFAULT_DRAFT_VOCAB else frequent_tokens(target, draft_vocab)
        self.head = DraftHead(backend, draft_vocab, vocab)

    @staticmethod
    def _load(target: LoadedModel, adapter: str | None) -> KangarooAdapter:
        path = Path(adapter).expanduser() if adapter else default_adapter_path(target.name)
        if path is None or not path.is_file():
            where = f" (looked for {path})" if path else ""
            raise SpecDecodeError(
                f"drafter 'kangaroo' needs an adapter trained for {target.name!r}{where}: run "
                f"`specdecode train kangaroo --model {target.name}` first, or pass --drafter-option adapter=PATH"
            )
        return KangarooAdapter.load(path, target.backend)

    def draft_token_share(self) -> float:
        """A token through the layers below the exit and the head (the adapter, one small block, left out)."""
        return CostModel.of(self.backend, verify_token_cost=0.0).draft_token(self.adapter.exit_layer)

    @cached_property
    def measured_acceptance(self) -> float | None:
        """The adapter's agreement with the full model on a built-in text, teacher-forced (once)."""
        return self_draft_agreement(self.target, self.backend, self.head, self.skipped, self.adapter)

    def session(self, request: DraftRequest) -> DraftSession:
        return KangarooSession(self, SelfDraftSession(self.backend, self.head, request))


class KangarooSession(DraftSession):
    def __init__(self, drafter: KangarooDrafter, state: SelfDraftSession) -> None:
        self.drafter = drafter
        self.state = state
        self.logits = state.adapted(drafter.skipped, drafter.adapter)

    def propose(self, context: list[int], max_tokens: int) -> Draft:
        return self.state.draft(context, max_tokens, self.logits, self.drafter.threshold)

    def finish(self, context: list[int]) -> None:
        self.state.finish()
