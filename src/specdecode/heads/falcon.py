"""The Falcon draft head: a semi-autoregressive layer that drafts ``block`` tokens per pass.

After Gao et al., "Falcon: Faster and Parallel Inference of Large Language Models through Enhanced
Semi-Autoregressive Drafting and Custom-Designed Decoding Tree" (AAAI 2025).  Like EAGLE-1 the head reads,
per position, the target's final feature of token j with the embedding of token j+1, and its output is a
*feature*: the one the target would have ``block`` positions later (trained to be, by regression and KL).
Unlike EAGLE, positions come in blocks of ``block`` rows that see one another (the paper's relaxed causal
mask): the last block of the context predicts the next ``block`` tokens in one pass, the r-th row the
r+1-th of them; feeding those tokens back with the predicted features as the next block gives the next
``block``.  Drafting is therefore ``block`` times fewer head passes than EAGLE's one token per pass.

The module is EAGLE-3's (:mod:`specdecode.heads.eagle`: ``fc``, one decoder layer reading [embedding,
feature], ``norm``, a VocabTrim ``lm_head`` with ``d2t``/``t2d``) fed the target's final hidden state alone
(``aux_layers`` = the last layer), so its ``fc`` is a square map that starts as the identity, and the same
``fuse`` reads a target feature or one the head predicted.  With one layer a row's keys and values depend on
its own inputs only, so the mask matters only to the rows whose outputs are read: a block's.

Files: ``config.json`` (``model_type`` :data:`MODEL_TYPE`, the config under ``specdecode``),
``model.safetensors`` (the state dict) and the SHA-256 ``manifest.json`` (:mod:`specdecode.heads.files`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from safetensors.torch import load_file

from specdecode.errors import SpecDecodeError
from specdecode.heads.eagle import EagleConfig, EagleHead
from specdecode.heads.files import CONFIG_FILE, WEIGHTS_FILE, check_manifest, write_head_files
from specdecode.models.base import DecoderShape

#: The directory a Falcon head is saved in next to its target model (``specdecode train falcon``), where the
#: falcon drafter finds it.
HEAD_DIR = "falcon-head"
#: ``model_type`` of its ``config.json``; no other engine has a layout for Falcon heads.
MODEL_TYPE = "specdecode-falcon"


@dataclass(frozen=True)
class FalconConfig(EagleConfig):
    """An EAGLE layer's shape reading the final feature only, and the tokens drafted per pass."""

    block: int = 2

    @classmethod
    def for_target(
        cls, shape: DecoderShape, num_layers: int, target_vocab_size: int, draft_vocab_size: int, block: int = 2
    ) -> FalconConfig:
        """A head shaped like one of the target's layers, reading its final hidden state."""
        if not isinstance(block, int) or block < 1:
            raise SpecDecodeError(f"falcon: the block must be a positive integer, got {block!r}")
        base = super().for_target(shape, num_layers, target_vocab_size, draft_vocab_size)
        return replace(base, aux_layers=(num_layers,), block=block)


class FalconHead(EagleHead):
    """EAGLE's module; what differs is how its rows see one another (in blocks) and what its outputs are trained
    to be (the feature ``block`` positions later)."""

    config: FalconConfig

    def __init__(self, config: FalconConfig) -> None:
        if config.aux_layers != (config.target_num_layers,):
            raise ValueError(f"a Falcon head reads the final layer {config.target_num_layers} only")
        super().__init__(config)


def save_falcon(head: FalconHead, directory: Path, verifier: str) -> None:
    """Write ``head`` to ``directory`` (created; files replaced atomically one by one)."""
    tensors = {name: tensor.detach().cpu().contiguous() for name, tensor in head.state_dict().items()}
    config = {
        "architectures": ["FalconDraftHead"],
        "model_type": MODEL_TYPE,
        "verifier": verifier,
        "specdecode": head.config.to_dict(),
    }
    write_head_files(directory, tensors, config)


def load_falcon(directory: Path) -> FalconHead:
    """Read a head written by :func:`save_falcon`, after checking its SHA-256 manifest."""
    try:
        data = json.loads((directory / CONFIG_FILE).read_text())
        if data.get("model_type") != MODEL_TYPE:
            raise SpecDecodeError(f"{directory} holds no Falcon head (model_type {data.get('model_type')!r})")
        check_manifest(directory)  # required: only heads written here exist in this layout
        head = FalconHead(FalconConfig.from_dict(data["specdecode"]))
        head.load_state_dict(load_file(str(directory / WEIGHTS_FILE)))
    except (OSError, KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise SpecDecodeError(f"cannot read Falcon head {directory}: {exc}") from exc
    return head.eval()
