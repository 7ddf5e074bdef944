"""Saving and loading trained draft heads in vLLM's ``speculators`` layout.

A head directory holds ``config.json`` (the ``speculators`` config: ``speculators_model_type``, the
decoder layer's config, draft and target vocabulary sizes, the target layers fused, the verifier's
name), ``model.safetensors`` (the state dict under ``speculators``' names) and ``manifest.json`` (SHA-256
of both, checked on load).  So a head trained here loads in vLLM, and a head trained elsewhere for a
model we can load drafts here (``--drafter-option head=DIR``).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from specdecode.errors import SpecDecodeError
from specdecode.heads.eagle import EagleConfig, EagleHead

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
MANIFEST_FILE = "manifest.json"


def eagle_speculators_config(config: EagleConfig, verifier: str, speculative_tokens: int = 5) -> dict:
    """``config.json`` of an EAGLE-3 head in ``speculators``' format (0.9)."""
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.9.0",
        "draft_vocab_size": config.draft_vocab_size,
        "norm_before_residual": False,
        "target_hidden_size": config.hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(config.aux_layers),
        "transformer_layer_config": {
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": config.hidden_size,
            "num_attention_heads": config.num_heads,
            "num_key_value_heads": config.num_kv_heads,
            "head_dim": config.head_dim,
            "intermediate_size": config.intermediate_size,
            "num_hidden_layers": 1,
            "rms_norm_eps": config.rms_norm_eps,
            "rope_theta": config.rope_theta,
            "vocab_size": config.target_vocab_size,
            "attention_bias": False,
            "mlp_bias": False,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
        },
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens}],
            "verifier": {"name_or_path": verifier, "architectures": []},
        },
        "specdecode": {"target_num_layers": config.target_num_layers},
    }


def _eagle_config_from(data: dict) -> EagleConfig:
    layer = data["transformer_layer_config"]
    heads = int(layer["num_attention_heads"])
    hidden = int(layer["hidden_size"])
    aux = data.get("eagle_aux_hidden_state_layer_ids")
    target_layers = data.get("specdecode", {}).get("target_num_layers")
    if not aux or target_layers is None:
        raise SpecDecodeError("the head's config names no target layers (eagle_aux_hidden_state_layer_ids)")
    return EagleConfig(
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=int(layer.get("num_key_value_heads") or heads),
        head_dim=int(layer.get("head_dim") or hidden // heads),
        intermediate_size=int(layer["intermediate_size"]),
        rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
        rope_theta=float(layer.get("rope_theta", 10000.0)),
        target_vocab_size=int(layer["vocab_size"]),
        draft_vocab_size=int(data["draft_vocab_size"]),
        aux_layers=tuple(int(i) for i in aux),
        target_num_layers=int(target_layers),
    )


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def save_eagle(head: EagleHead, directory: Path, verifier: str) -> None:
    """Write ``head`` to ``directory`` (created; files replaced atomically one by one)."""
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: tensor.detach().cpu().contiguous() for name, tensor in head.state_dict().items()}
    config = eagle_speculators_config(head.config, verifier)
    for name, write in (
        (WEIGHTS_FILE, lambda p: save_file(tensors, str(p), metadata={"format": "pt"})),
        (CONFIG_FILE, lambda p: p.write_text(json.dumps(config, indent=2) + "\n")),
    ):
        tmp = directory / (name + ".tmp")
        write(tmp)
        tmp.replace(directory / name)
    manifest = {name: _sha256(directory / name) for name in (CONFIG_FILE, WEIGHTS_FILE)}
    (directory / MANIFEST_FILE).write_text(json.dumps({"sha256": manifest}, indent=2) + "\n")


def load_eagle(directory: Path) -> EagleHead:
    """Read a head written by :func:`save_eagle` or by ``speculators`` (EAGLE-3, one layer)."""
    try:
        data = json.loads((directory / CONFIG_FILE).read_text())
        if data.get("speculators_model_type") != "eagle3":
            raise SpecDecodeError(
                f"not an EAGLE-3 head (speculators_model_type={data.get('speculators_model_type')!r})"
            )
        manifest = directory / MANIFEST_FILE
        if manifest.is_file():
            for name, digest in json.loads(manifest.read_text())["sha256"].items():
                if _sha256(directory / name) != digest:
                    raise SpecDecodeError(f"{name} does not match its SHA-256 in {MANIFEST_FILE}")
        config = _eagle_config_from(data)
        head = EagleHead(config)
        state = load_file(str(directory / WEIGHTS_FILE))
    except (OSError, KeyError, TypeError, ValueError) as exc:
        raise SpecDecodeError(f"cannot read EAGLE head {directory}: {exc}") from exc
    # Heads trained elsewhere may leave out the vocabulary maps (full vocabulary) or carry verifier weights.
    state = {name: tensor for name, tensor in state.items() if name in head.state_dict()}
    if "d2t" in state:
        state["d2t"] = state["d2t"].long()
    if "t2d" in state:
        state["t2d"] = state["t2d"].bool()
    missing = set(head.state_dict()) - set(state) - {"d2t", "t2d"}
    if missing:
        raise SpecDecodeError(f"EAGLE head {directory} lacks weights: {', '.join(sorted(missing))}")
    head.load_state_dict(state, strict=False)
    return head.eval()


def to_backend(head: EagleHead, device: torch.device, dtype: torch.dtype) -> EagleHead:
    """The head on the target's device and in its precision, inference only."""
    head = head.to(device=device, dtype=dtype).eval()
    for param in head.parameters():
        param.requires_grad_(False)
    return head
