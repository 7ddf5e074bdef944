"""The CTC draft head: one pass over the target's last known feature emits ``slots`` distributions, blank included.

After Wen, Gui and Feng, "Speculative Decoding with CTC-based Draft Model for LLM Inference Acceleration"
(NeurIPS 2024).  Slot s reads the target's final hidden state h of the last position whose feature is known
(as a Medusa head does) through its own residual block ``h + SiLU(W_s h + b_s)``, and scores the draft
vocabulary (VocabTrim: the target's own LM-head rows of those ids, frozen and shared by the slots) plus a
*blank* (a trained row of its own).  The slots are not one token each: trained with CTC loss against the
target's next tokens, a token may span several slots and blanks may sit between them, so the slots' outputs
collapse — repeats merged, blanks removed — into a draft whose length the head chooses.  That alignment is
where the tokens' correlations come from that independent Medusa heads lack.

The paper reads the context through an attention draft module before its heads; here the slots read the one
feature Medusa's heads read, so training needs only the final hidden states and drafting is a few H x H products
and one LM-head call per step.

Files: ``config.json`` (``model_type`` :data:`MODEL_TYPE`, the config under ``specdecode``),
``model.safetensors`` (the state dict) and the SHA-256 ``manifest.json`` (:mod:`specdecode.heads.files`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from specdecode.errors import SpecDecodeError
from specdecode.heads.files import CONFIG_FILE, WEIGHTS_FILE, check_manifest, write_head_files
from specdecode.heads.medusa import ResidualBlock
from specdecode.models.base import HiddenStates, LayerwiseExecution

#: The directory a CTC head is saved in next to its target model (``specdecode train ctc``), where the ctc
#: drafter finds it.
HEAD_DIR = "ctc-head"
#: ``model_type`` of its ``config.json``; no other engine has a layout for CTC heads.
MODEL_TYPE = "specdecode-ctc"


@dataclass(frozen=True)
class CTCConfig:
    """Everything needed to build :class:`CTCHead` (saved with it)."""

    hidden_size: int
    slots: int
    target_vocab_size: int
    draft_vocab_size: int  # the blank is one more output: index ``draft_vocab_size``
    target_num_layers: int

    def __post_init__(self) -> None:
        if not isinstance(self.slots, int) or self.slots < 1:
            raise SpecDecodeError(f"ctc: the slots must be a positive integer, got {self.slots!r}")

    @property
    def blank(self) -> int:
        return self.draft_vocab_size


class CTCHead(nn.Module):
    """``slots`` residual blocks over one feature, a frozen VocabTrim LM head shared by them and a blank row."""

    def __init__(self, config: CTCConfig) -> None:
        super().__init__()
        self.config = config
        self.blocks = nn.ModuleList(ResidualBlock(config.hidden_size, config.hidden_size) for _ in range(config.slots))
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.lm_head.weight.requires_grad_(False)
        self.blank_head = nn.Linear(config.hidden_size, 1)
        self.register_buffer("token_map", torch.arange(config.draft_vocab_size))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [..., slots, draft_vocab + 1] (the blank last) of final hidden states [..., H]."""
        out = torch.stack([block(hidden, hidden) for block in self.blocks], dim=-2)
        return torch.cat([self.lm_head(out), self.blank_head(out)], dim=-1).float()

    @property
    def target_ids(self) -> torch.Tensor:
        """[draft_vocab] the target id of each draft id."""
        return self.token_map


def ctc_head_for_target(backend: object, slots: int, draft_ids: torch.Tensor) -> CTCHead:
    """A fresh head for ``backend`` drafting the target ids ``draft_ids`` (sorted), its LM head the target's rows of
    those ids; the blocks start at zero (Medusa's initialisation) and the blank at a logit of zero."""
    if not isinstance(backend, HiddenStates) or not isinstance(backend, LayerwiseExecution):
        raise SpecDecodeError("a CTC head needs a backend with hidden states and a reusable LM head")
    weight = backend.output_weight()
    ids = torch.as_tensor(draft_ids, dtype=torch.long).sort().values
    head = CTCHead(CTCConfig(backend.hidden_size, slots, weight.shape[0], ids.numel(), backend.num_layers))
    with torch.no_grad():
        head.lm_head.weight.copy_(weight.index_select(0, ids.to(weight.device)).float())
        head.token_map.copy_(ids)
        for block in head.blocks:
            block.layers[0].weight.zero_()
            block.layers[0].bias.zero_()
        head.blank_head.weight.zero_()
        head.blank_head.bias.zero_()
    return head


def save_ctc(head: CTCHead, directory: Path, verifier: str) -> None:
    """Write ``head`` to ``directory`` (created; files replaced atomically one by one)."""
    tensors = {name: tensor.detach().cpu().contiguous() for name, tensor in head.state_dict().items()}
    config = {
        "architectures": ["CTCDraftHead"],
        "model_type": MODEL_TYPE,
        "verifier": verifier,
        "specdecode": asdict(head.config),
    }
    write_head_files(directory, tensors, config)


def load_ctc(directory: Path) -> CTCHead:
    """Read a head written by :func:`save_ctc`, after checking its SHA-256 manifest."""
    try:
        data = json.loads((directory / CONFIG_FILE).read_text())
        if data.get("model_type") != MODEL_TYPE:
            raise SpecDecodeError(f"{directory} holds no CTC head (model_type {data.get('model_type')!r})")
        check_manifest(directory)  # required: only heads written here exist in this layout
        head = CTCHead(CTCConfig(**data["specdecode"]))
        state = load_file(str(directory / WEIGHTS_FILE))
        head.load_state_dict({**state, "token_map": state["token_map"].long()})
    except (OSError, KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise SpecDecodeError(f"cannot read CTC head {directory}: {exc}") from exc
    return head.eval()
