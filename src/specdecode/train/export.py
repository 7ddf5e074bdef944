"""``specdecode export eagle --model M --out DIR``: a trained EAGLE head in vLLM's ``speculators`` layout.

The head ``specdecode train eagle`` saved for M is already in that layout; exporting checks it, names the
verifier as vLLM and ``speculators`` read it (``--verifier``, its architectures and context length from
the target's config.json) and writes a fresh directory to hand over.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from specdecode.errors import SpecDecodeError
from specdecode.heads.files import shipped_head
from specdecode.heads.storage import HEAD_DIR, Verifier, load_eagle, save_eagle
from specdecode.models import registry
from specdecode.models.artifacts import trained_artifact_path

WEIGHT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _target_config(model: str) -> dict:
    """The target's transformers config.json, if it is on disk (a cached registry model or a model
    directory); {} for a .gguf file or a hub id.  Looking never downloads anything."""
    if registry.is_registered(model):
        status = next(s for s in registry.list_models() if s.name == model)
        path = status.path / "config.json" if status.cached else None
    else:
        path = Path(model).expanduser() / "config.json"
    if path is None or not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SpecDecodeError(f"cannot read the config of {model!r} ({path}): {exc}") from exc


def _default_head(model: str) -> Path:
    """Where ``--drafter eagle`` finds the head: saved by ``specdecode train eagle --model M``, else shipped."""
    hint = f"train one with `specdecode train eagle --model {model}`, or pass --head DIR"
    if registry.is_registered(model) and not next(s for s in registry.list_models() if s.name == model).cached:
        raise SpecDecodeError(f"no EAGLE head for {model!r}: the model is not even downloaded; {hint}")
    path = trained_artifact_path(model, HEAD_DIR)
    if path is None:
        raise SpecDecodeError(f"no default head location for {model!r} (a hub id): pass --head DIR")
    if not (path / "config.json").is_file():
        path = shipped_head(model, HEAD_DIR) or path
    if not (path / "config.json").is_file():
        raise SpecDecodeError(f"no EAGLE head for {model!r} in {path}: {hint}")
    return path


def export_eagle(args: argparse.Namespace) -> int:
    out = Path(args.out).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise SpecDecodeError(f"--out {out} exists and is not an empty directory: choose a new one")
    source = Path(args.head).expanduser() if args.head else _default_head(args.model)
    if not (source / "config.json").is_file():
        raise SpecDecodeError(f"--head {source} is not a head directory (no config.json)")
    target = _target_config(args.model)
    depth = target.get("num_hidden_layers")
    head = load_eagle(source, target_num_layers=depth)
    config = head.config
    found = (config.hidden_size, config.target_num_layers, config.target_vocab_size)
    wanted = (target.get("hidden_size"), depth, target.get("vocab_size"))
    if target and found != wanted:
        raise SpecDecodeError(
            f"the head in {source} is for a target with d={found[0]}, {found[1]} layers and {found[2]} tokens; "
            f"{args.model!r} has d={wanted[0]}, {wanted[1]} layers and {wanted[2]} tokens"
        )
    verifier = Verifier(
        name_or_path=args.verifier or args.model,
        architectures=tuple(target.get("architectures") or ()),
        max_position_embeddings=target.get("max_position_embeddings"),
    )
    save_eagle(head.to(WEIGHT_DTYPES[args.dtype]), out, verifier)
    print(
        f"exported the EAGLE-3 head for {args.model} ({config.draft_vocab_size} draft tokens, target layers "
        f"{', '.join(map(str, config.aux_layers))}) to {out}"
    )
    if registry.is_registered(args.model) and not args.verifier:
        print(
            f"note: config.json names the verifier {args.model!r}, a short name only specdecode knows: pass "
            "--verifier with the model's Hugging Face id for speculators to find it"
        )
    spec = json.dumps({"model": str(out), "method": "eagle3", "num_speculative_tokens": 5})
    print(f"in vLLM: vllm serve <the target model> --speculative-config '{spec}'")
    return 0
