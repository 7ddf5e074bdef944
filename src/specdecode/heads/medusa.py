"""Medusa and Hydra draft heads: small blocks over the target's final hidden state, one per draft depth.

Medusa (Cai et al., "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding Heads",
2024): head k reads the final hidden state h of the last position whose feature is known and predicts
the token k positions after the last context token, through one residual block ``h + SiLU(W h + b)``
and an LM head.  The heads are independent of one another, so all of them run in one batched call.

Hydra (Ankner et al., "Hydra: Sequentially-Dependent Draft Heads for Medusa Decoding", 2024): head k
also reads the embeddings of the last context token and of the k-1 tokens drafted before it — its
block is ``h + SiLU(W [h; e_0; ...; e_{k-1}] + b)`` — so that its guess follows what was drafted, which
Medusa's heads cannot do (their guesses for depths 2+ ignore depth 1's token).

Hydra++ (the same paper's tuned recipe) also puts one attention layer over the context's final hidden states
before the heads (``prefix_window``; :mod:`specdecode.heads.prefix`): they then read its output, not the state
itself.  Either kind of head can have it.

The LM head is the target's own, restricted to a VocabTrim draft vocabulary (the ids the target emits
most often) and frozen: one ``lm_head`` shared by every head, so a head costs a few H x H products and
the restricted head's matmul on a CPU rather than a full-vocabulary projection per head.

Storage follows vLLM's ``MedusaModel`` names (``speculators`` 0.9 has no Medusa or Hydra layout):
``blocks.{k}.layers.0.{weight,bias}``, ``token_map`` (the target id of each draft id); the shared
``lm_head.weight`` [draft_vocab, H] is stored once where vLLM stores ``lm_heads.{k}`` per head; a prefix
attention's ``prefix.*`` tensors have no vLLM counterpart.
``config.json`` + ``model.safetensors`` + a SHA-256 ``manifest.json``, as for EAGLE heads.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from specdecode.errors import SpecDecodeError
from specdecode.heads.files import CONFIG_FILE, WEIGHTS_FILE, check_manifest, write_head_files
from specdecode.heads.prefix import PrefixAttention
from specdecode.models.base import HiddenStates, LayerwiseExecution

KINDS = ("medusa", "hydra")


def heads_dir(kind: str) -> str:
    """The directory ``kind``'s heads are saved in next to their target model (``specdecode train medusa``), where
    the drafter finds them."""
    return f"{kind}-heads"


@dataclass(frozen=True)
class HeadsConfig:
    """Everything needed to build :class:`DraftHeads` (saved with them)."""

    kind: str  # "medusa" or "hydra"
    hidden_size: int
    num_heads: int
    target_vocab_size: int
    draft_vocab_size: int
    target_num_layers: int
    num_layers: int = 1  # residual layers per head (Medusa's ``medusa_num_layers``; Hydra++'s deeper heads)
    prefix_window: int = 0  # Hydra++'s prefix attention over this many positions before the heads (0: none)
    prefix_heads: int = 0  # its attention heads (the target's own count)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown head kind {self.kind!r}")

    def input_width(self, head: int) -> int:
        """Inputs of head ``head`` (0-based): the hidden state, and for Hydra ``head + 1`` embeddings."""
        return self.hidden_size * (1 if self.kind == "medusa" else head + 2)


class ResidualBlock(nn.Module):
    """Medusa's block, ``h + SiLU(W x + b)`` with x = h (Medusa) or [h; embeddings] (Hydra), then as many more
    ``y + SiLU(W y + b)`` layers as the head has beyond its first."""

    def __init__(self, inputs: int, hidden: int, layers: int = 1) -> None:
        super().__init__()
        deeper = (nn.Linear(hidden, hidden) for _ in range(layers - 1))
        self.layers = nn.ModuleList([nn.Linear(inputs, hidden), *deeper])

    def forward(self, hidden: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        out = hidden + F.silu(self.layers[0](inputs))
        for layer in self.layers[1:]:
            out = out + F.silu(layer(out))
        return out


class DraftHeads(nn.Module):
    """K Medusa or Hydra heads sharing one frozen, vocabulary-trimmed LM head."""

    def __init__(self, config: HeadsConfig) -> None:
        super().__init__()
        self.config = config
        self.blocks = nn.ModuleList(
            ResidualBlock(config.input_width(k), config.hidden_size, config.num_layers) for k in range(config.num_heads)
        )
        self.prefix = (
            PrefixAttention(config.hidden_size, config.prefix_heads, config.prefix_window)
            if config.prefix_window
            else None
        )
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.lm_head.weight.requires_grad_(False)
        self.register_buffer("token_map", torch.arange(config.draft_vocab_size))

    def head(self, k: int, hidden: torch.Tensor, embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Head ``k``'s (0-based) output [..., H] for hidden states [..., H]; Hydra heads also take the
        embeddings [..., k + 1, H] of the last context token and the k tokens drafted before."""
        if self.config.kind == "medusa":
            return self.blocks[k](hidden, hidden)
        if embeds is None or embeds.shape[-2] != k + 1:
            raise ValueError(f"hydra head {k} needs {k + 1} embeddings")
        return self.blocks[k](hidden, torch.cat([hidden, embeds.flatten(-2)], dim=-1))

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [..., draft_vocab] of head outputs."""
        return self.lm_head(out).float()

    @property
    def target_ids(self) -> torch.Tensor:
        """[draft_vocab] the target id of each draft id."""
        return self.token_map


def heads_for_target(
    backend: object, kind: str, num_heads: int, draft_ids: torch.Tensor, num_layers: int = 1, prefix_window: int = 0
) -> DraftHeads:
    """Fresh heads for ``backend`` drafting the target ids ``draft_ids``, ``num_layers`` residual layers each, with
    the target's own LM head rows of those ids as the shared (frozen) LM head, and with ``prefix_window`` > 0
    Hydra++'s prefix attention over that many positions (as many attention heads as the target's layers have)."""
    if not isinstance(backend, HiddenStates) or not isinstance(backend, LayerwiseExecution):
        raise SpecDecodeError(f"{kind} heads need a backend with hidden states and a reusable LM head")
    if prefix_window < 0:
        raise SpecDecodeError(f"{kind} heads: the prefix window must be >= 0, got {prefix_window}")
    weight = backend.output_weight()
    ids = torch.as_tensor(draft_ids, dtype=torch.long).sort().values
    prefix_heads = backend.decoder_shape().num_heads if prefix_window else 0
    config = HeadsConfig(
        kind,
        backend.hidden_size,
        num_heads,
        weight.shape[0],
        ids.numel(),
        backend.num_layers,
        num_layers,
        prefix_window,
        prefix_heads,
    )
    heads = DraftHeads(config)
    with torch.no_grad():
        heads.lm_head.weight.copy_(weight.index_select(0, ids.to(weight.device)).float())
        heads.token_map.copy_(ids)
    return heads


def save_heads(heads: DraftHeads, directory: Path, verifier: str) -> None:
    """Write ``heads`` to ``directory`` (created; files replaced atomically one by one)."""
    tensors = {name: tensor.detach().cpu().contiguous() for name, tensor in heads.state_dict().items()}
    c = heads.config
    config = {
        "architectures": ["MedusaModel" if c.kind == "medusa" else "HydraModel"],
        "model_type": c.kind,
        "hidden_size": c.hidden_size,
        "vocab_size": c.target_vocab_size,
        "truncated_vocab_size": c.draft_vocab_size,
        "num_heads": c.num_heads,
        "num_hidden_layers": c.num_layers,
        "verifier": verifier,
        "specdecode": asdict(c) | {"shared_lm_head": True},
    }
    write_head_files(directory, tensors, config)


def load_heads(directory: Path, kind: str) -> DraftHeads:
    """Read heads of ``kind`` written by :func:`save_heads`, after checking the SHA-256 manifest."""
    try:
        data = json.loads((directory / CONFIG_FILE).read_text())
        if data.get("model_type") != kind:
            raise SpecDecodeError(f"{directory} holds {data.get('model_type')!r} heads, not {kind!r} ones")
        check_manifest(directory)  # required: only heads written here exist in this layout
        fields = {key: value for key, value in data["specdecode"].items() if key != "shared_lm_head"}
        heads = DraftHeads(HeadsConfig(**fields))
        state = load_file(str(directory / WEIGHTS_FILE))
        heads.load_state_dict({**state, "token_map": state["token_map"].long()})
    except (OSError, KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise SpecDecodeError(f"cannot read {kind} heads {directory}: {exc}") from exc
    return heads.eval()
