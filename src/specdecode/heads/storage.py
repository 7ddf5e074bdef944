"""Saving and loading trained draft heads in vLLM's ``speculators`` layout.

A head directory holds ``config.json`` (the ``speculators`` 0.9 config of an EAGLE-3 head: the decoder
layer's config, draft and target vocabulary sizes, the target layers fused, the verifier's name),
``model.safetensors`` (the state dict under ``speculators``' names) and ``manifest.json`` (SHA-256 of both,
checked on load).  So a head trained here loads in vLLM and ``speculators``, and a head trained with
``speculators`` for a model we can load drafts here (``--drafter-option head=DIR``).

What the two readers expect, from ``speculators`` 0.9.0 (``Eagle3SpeculatorConfig``, ``Eagle3DraftModel``,
``DraftVocabMixin``) and vLLM (``llama_eagle3.py``, ``transformers_utils/configs/speculators``):

- ``norm_before_residual`` written out: ``speculators`` reads a missing one as false, vLLM as true;
- ``d2t`` int64 offsets [draft_vocab] and ``t2d`` bool [target_vocab], both or neither: neither when the
  draft vocabulary is the whole vocabulary (``speculators`` then has no such buffers);
- no ``embed_tokens.weight``: vLLM and ``speculators`` then take the verifier's embedding, as we do;
- vLLM's ``fc`` always reads three target layers, and the decoder layer is built as Llama's.

Heads written by ``speculators`` carry copies of the verifier's weights (``embed_tokens``,
``verifier_lm_head``, ``verifier_norm``), which we ignore, and no ``manifest.json``.  Options of theirs
that we do not implement (``norm_before_residual``, ``norm_before_fc``, ``fc_norm``, ``norm_output``, more
than one layer, Qwen3's q/k norms, scaled RoPE, sliding windows, biases) are refused rather than drafted from wrongly.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

import torch
from safetensors.torch import load_file

from specdecode.errors import SpecDecodeError
from specdecode.heads.eagle import EagleConfig, EagleHead, default_aux_layers
from specdecode.heads.files import (
    CONFIG_FILE,
    MANIFEST_FILE,
    WEIGHTS_FILE,
    check_manifest,
    head_directory,
    write_head_files,
)
from specdecode.heads.medusa import DraftHeads
from specdecode.models.base import HiddenStates
from specdecode.models.fastpath import apply_cpu_fast_path
from specdecode.models.loading import packs_by_default
from specdecode.models.quantize import W4A8_DRAFT_QUANTIZE, default_draft_quantization, int8_fits, quantize_supported
from specdecode.models.quantized_layers import Int8Linear
from specdecode.models.w4a8 import W4A8Linear, w4a8_fits

#: The directory an EAGLE head is saved in next to its target model (``specdecode train eagle``), where the
#: eagle drafter finds it and ``specdecode export eagle`` reads it.
HEAD_DIR = "eagle-head"
SPECULATORS_VERSION = "0.9.0"
# speculators' copies of the verifier's weights: the target's own are used instead.
VERIFIER_TENSORS = frozenset({"embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight"})
# speculators' EAGLE-3 options, each false in the heads we can run.
UNSUPPORTED_FLAGS = ("norm_before_fc", "fc_norm", "norm_output")


@dataclass(frozen=True)
class Verifier:
    """The target a head drafts for, as ``speculators_config.verifier`` names it (``name_or_path``: a
    Hugging Face id or a path; ``architectures``: those of its config.json)."""

    name_or_path: str
    architectures: tuple[str, ...] = ()
    max_position_embeddings: int | None = None


def eagle_speculators_config(config: EagleConfig, verifier: Verifier, speculative_tokens: int = 5) -> dict:
    """``config.json`` of an EAGLE-3 head in ``speculators``' format (0.9), as its config classes write it.

    ``target_num_layers`` goes in a ``specdecode`` section (``speculators`` keeps unknown keys): a head
    fuses layers by index, and the depth lets us refuse a head made for another model."""
    layer = {
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
    }
    if verifier.max_position_embeddings is not None:
        layer["max_position_embeddings"] = verifier.max_position_embeddings
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "draft_vocab_size": config.draft_vocab_size,
        "norm_before_residual": False,
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "target_hidden_size": config.hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(config.aux_layers),
        "transformer_layer_config": layer,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": speculative_tokens,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "verifier": {"name_or_path": verifier.name_or_path, "architectures": list(verifier.architectures)},
        },
        "specdecode": {"target_num_layers": config.target_num_layers},
    }


def _refuse_unsupported(data: dict, layer: dict) -> None:
    """Raise for any option of the head that drafting here would not reproduce."""
    if "norm_before_residual" not in data:
        raise SpecDecodeError(
            "the head's config.json does not say norm_before_residual (speculators reads that as false, "
            "vLLM as true): add it"
        )
    flags = [name for name in ("norm_before_residual", *UNSUPPORTED_FLAGS) if data.get(name)]
    if flags:
        raise SpecDecodeError(f"EAGLE-3 heads with {', '.join(flags)} are not supported")
    model_type = layer.get("model_type")
    if model_type != "llama":
        raise SpecDecodeError(
            f"only Llama-style EAGLE-3 decoder layers are supported, this head's is {model_type or 'unnamed'!r}"
        )
    if int(layer.get("num_hidden_layers", 1)) != 1:
        raise SpecDecodeError(f"only one-layer EAGLE-3 heads are supported, this one has {layer['num_hidden_layers']}")
    for name in ("attention_bias", "mlp_bias"):
        if layer.get(name):
            raise SpecDecodeError(f"EAGLE-3 heads with {name} are not supported")
    if layer.get("hidden_act", "silu") != "silu":
        raise SpecDecodeError(f"EAGLE-3 heads with hidden_act {layer['hidden_act']!r} are not supported")
    if any(kind != "full_attention" for kind in layer.get("layer_types") or ()):
        raise SpecDecodeError(f"EAGLE-3 heads with sliding-window attention ({layer['layer_types']}) are not supported")
    rope = layer.get("rope_scaling") or layer.get("rope_parameters") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise SpecDecodeError(f"EAGLE-3 heads with scaled RoPE ({rope}) are not supported")
    target_hidden = data.get("target_hidden_size")
    if target_hidden is not None and int(target_hidden) != int(layer["hidden_size"]):
        raise SpecDecodeError(
            f"EAGLE-3 heads whose width ({layer['hidden_size']}) differs from the target's ({target_hidden}) "
            "are not supported"
        )


def _eagle_config_from(data: dict, target_num_layers: int | None) -> EagleConfig:
    layer = data["transformer_layer_config"]
    _refuse_unsupported(data, layer)
    heads = int(layer["num_attention_heads"])
    hidden = int(layer["hidden_size"])
    # Our own heads record the target's depth; speculators' leave it to the verifier they are used with.
    depth = data.get("specdecode", {}).get("target_num_layers", target_num_layers)
    if depth is None:
        raise SpecDecodeError("the head's config names no target depth: load it with its target model")
    aux = data.get("eagle_aux_hidden_state_layer_ids") or default_aux_layers(int(depth))
    rope = layer.get("rope_parameters") or {}
    return EagleConfig(
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=int(layer.get("num_key_value_heads") or heads),
        head_dim=int(layer.get("head_dim") or hidden // heads),
        intermediate_size=int(layer["intermediate_size"]),
        rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
        rope_theta=float(layer.get("rope_theta", rope.get("rope_theta", 10000.0))),
        target_vocab_size=int(layer["vocab_size"]),
        draft_vocab_size=int(data["draft_vocab_size"]),
        aux_layers=tuple(int(i) for i in aux),
        target_num_layers=int(depth),
    )


def save_eagle(head: EagleHead, directory: Path, verifier: str | Verifier) -> None:
    """Write ``head`` to ``directory`` (created; files replaced atomically one by one)."""
    if isinstance(verifier, str):
        verifier = Verifier(verifier)
    tensors = {name: tensor.detach().cpu().contiguous() for name, tensor in head.state_dict().items()}
    if head.config.draft_vocab_size == head.config.target_vocab_size:
        # The whole vocabulary: speculators has no vocabulary maps then, and would not expect them.
        del tensors["d2t"], tensors["t2d"]
    write_head_files(directory, tensors, eagle_speculators_config(head.config, verifier))


def _vocabulary(head: EagleHead, state: dict[str, torch.Tensor], directory: Path) -> None:
    """Set the head's draft vocabulary from ``d2t``/``t2d`` (taken out of ``state``), checking they agree.

    Our heads keep draft ids in ascending target order; a ``d2t`` in another order (the format allows it)
    is brought into ours by reordering ``lm_head``'s rows, which drafts exactly the same tokens."""
    d2t, t2d = state.pop("d2t", None), state.pop("t2d", None)
    config = head.config
    if d2t is None and t2d is None:
        if config.draft_vocab_size != config.target_vocab_size:
            raise SpecDecodeError(
                f"EAGLE head {directory} drafts {config.draft_vocab_size} of {config.target_vocab_size} tokens "
                "but has no d2t/t2d to say which"
            )
        return
    if d2t is None or t2d is None:
        raise SpecDecodeError(f"EAGLE head {directory} has only one of d2t and t2d")
    if d2t.shape != (config.draft_vocab_size,) or t2d.shape != (config.target_vocab_size,):
        raise SpecDecodeError(
            f"EAGLE head {directory}: d2t {tuple(d2t.shape)} and t2d {tuple(t2d.shape)} do not fit a draft "
            f"vocabulary of {config.draft_vocab_size} in {config.target_vocab_size}"
        )
    ids = d2t.long() + torch.arange(config.draft_vocab_size)
    if ids.min() < 0 or ids.max() >= config.target_vocab_size or ids.unique().numel() != ids.numel():
        raise SpecDecodeError(f"EAGLE head {directory}: d2t maps to ids outside the target vocabulary or twice")
    head.set_draft_vocabulary(ids)
    if not torch.equal(head.t2d, t2d.bool()):
        raise SpecDecodeError(f"EAGLE head {directory}: t2d does not mark the ids d2t maps to")
    state["lm_head.weight"] = state["lm_head.weight"][ids.argsort()]


def load_eagle(directory: Path, target_num_layers: int | None = None) -> EagleHead:
    """Read a head written by :func:`save_eagle` or by ``speculators`` (EAGLE-3, one layer).

    ``target_num_layers``: the depth of the target it will draft for, which ``speculators``' heads leave
    out (and may leave the fused layers to: vLLM's default is layers 2, L/2 and L-3)."""
    try:
        data = json.loads((directory / CONFIG_FILE).read_text())
        if data.get("speculators_model_type") != "eagle3":
            raise SpecDecodeError(
                f"not an EAGLE-3 head (speculators_model_type={data.get('speculators_model_type')!r})"
            )
        if (directory / MANIFEST_FILE).is_file():  # speculators' heads have none
            check_manifest(directory)
        config = _eagle_config_from(data, target_num_layers)
        head = EagleHead(config)
        state = load_file(str(directory / WEIGHTS_FILE))
    except (OSError, KeyError, TypeError, ValueError) as exc:
        raise SpecDecodeError(f"cannot read EAGLE head {directory}: {exc}") from exc
    unknown = set(state) - set(head.state_dict()) - VERIFIER_TENSORS
    if unknown:
        raise SpecDecodeError(f"EAGLE head {directory} has weights we do not implement: {', '.join(sorted(unknown))}")
    expected = {name: tensor.shape for name, tensor in head.state_dict().items() if name not in ("d2t", "t2d")}
    missing = set(expected) - set(state)
    if missing:
        raise SpecDecodeError(f"EAGLE head {directory} lacks weights: {', '.join(sorted(missing))}")
    wrong = [
        f"{name} {tuple(state[name].shape)} (expected {tuple(shape)})"
        for name, shape in expected.items()
        if state[name].shape != shape
    ]
    if wrong:
        raise SpecDecodeError(f"EAGLE head {directory} has weights of the wrong shape: {', '.join(wrong)}")
    _vocabulary(head, state, directory)
    state = {name: tensor for name, tensor in state.items() if name not in VERIFIER_TENSORS}
    head.load_state_dict(state, strict=False)
    return head.eval()


HeadModule = TypeVar("HeadModule", bound=torch.nn.Module)


#: The layers of a head that draft rounded with ``int8_head``: read once per drafting step, after a target forward has
#: pushed them out of the caches, they cost their size in memory traffic; the rest of a head is read again within the
#: step (an EAGLE layer once per depth) and, in int8, moved EAGLE's drafts (``docs/results/int8-head-smollm2-135m``).
#: Medusa's and Hydra's blocks (:data:`BLOCK_LAYERS`) are read once a step too, each at its depth.
INT8_LAYERS = ("lm_head", "prefix.qkv", "prefix.out")
#: The linear layers of Medusa's and Hydra's residual blocks (``blocks.{k}.layers.{i}`` of :class:`DraftHeads`): in
#: w4a8 the shipped Hydra heads' drafting took less time a step on open chat than in fp32, drafting as many tokens a
#: step (``docs/results/w4a8-blocks-xeon-smollm2-135m``).
BLOCK_LAYERS = re.compile(r"blocks\.\d+\.layers\.\d+")


def to_backend(head: HeadModule, device: torch.device, dtype: torch.dtype, int8_head: bool = True) -> HeadModule:
    """The head on the target's device and in its precision, inference only.

    An fp32 head on the CPU drafts from a copy whose linear layers are packed as the target's are
    (:mod:`specdecode.models.fastpath`; the head passed in keeps its own): ``torch.nn.Linear`` read SmolLM2's Hydra
    heads' 8,192-row LM head far below the memory's bandwidth, most of their drafting time
    (``docs/results/heads-packed-smollm2-135m``).  With ``int8_head`` that copy's :data:`INT8_LAYERS` (the LM head,
    the largest layer, and a Hydra++ prefix layer's projections) are rounded to 8-bit integer arithmetic instead, where
    a kernel runs: a draft need not be exact, and on SmolLM2's open chat the shipped Hydra heads then decoded at 1.63x
    plain decoding against 1.56x (``docs/results/int8-head-smollm2-135m``); so are Medusa's and Hydra's blocks
    (:data:`BLOCK_LAYERS`).  The LM head and the blocks take our w4a8 kernel (int4 weights, int8 activations) where
    draft models draft in w4a8 by default (:func:`~specdecode.models.quantize.default_draft_quantization`): half int8's
    bytes, and on a Xeon with AMX a third of the time of torch's int8 kernel
    (``docs/results/w4a8-head-xeon-smollm2-135m``); the others take torch's int8 kernel."""
    packed = packs_by_default(device, dtype)
    head = (copy.deepcopy(head) if packed else head).to(device=device, dtype=dtype).eval()
    for param in head.parameters():
        param.requires_grad_(False)
    if packed:
        if int8_head and quantize_supported("int8"):
            _round_drafting_layers(head)
        apply_cpu_fast_path(head)
    return head


def _round_drafting_layers(head: torch.nn.Module) -> None:
    """Each of :data:`INT8_LAYERS` and :data:`BLOCK_LAYERS` that ``head`` has as a plain linear layer of a shape a
    kernel takes, rounded: the LM head and the blocks in w4a8 where that is the draft models' default, else int8."""
    w4a8 = default_draft_quantization() == W4A8_DRAFT_QUANTIZE
    modules = head.named_modules() if isinstance(head, DraftHeads) else ()
    blocks = [name for name, _ in modules if BLOCK_LAYERS.fullmatch(name)]
    for name in (*INT8_LAYERS, *blocks):
        try:
            layer = head.get_submodule(name)
        except AttributeError:
            continue
        if type(layer) is not torch.nn.Linear:
            continue
        if (name == "lm_head" or name in blocks) and w4a8 and w4a8_fits(layer):
            head.set_submodule(name, W4A8Linear(layer, tied=False))
        elif int8_fits(layer):
            head.set_submodule(name, Int8Linear(layer, tied=False))


class TargetShape(Protocol):
    """What a head config records of the target it was trained for (EAGLE, Medusa and Hydra configs do)."""

    hidden_size: int
    target_num_layers: int
    target_vocab_size: int


def target_mismatch(config: TargetShape, backend: HiddenStates, vocab_size: int) -> tuple[tuple[int, ...], ...] | None:
    """(the head's, the target's) (hidden size, layers, vocabulary) when they differ, else None.

    A head trained for another model would read features of the wrong width or draft ids out of range,
    so every drafter refuses it up front, each in its own words."""
    head = (config.hidden_size, config.target_num_layers, config.target_vocab_size)
    own = (backend.hidden_size, backend.num_layers, vocab_size)
    return None if head == own else (head, own)


def refuse_other_target(drafter: str, config: TargetShape, backend: HiddenStates, vocab_size: int, name: str) -> None:
    """Raise, in the words of a one-head drafter (``eagle``, ``falcon``, ``ctc``), if the head was trained for a
    target of another shape than ``backend`` (the model ``name``)."""
    mismatch = target_mismatch(config, backend, vocab_size)
    if mismatch is not None:
        (d, layers, vocab), (own_d, own_layers, own_vocab) = mismatch
        raise SpecDecodeError(
            f"{drafter}: the head is for a target with d={d}, {layers} layers and {vocab} tokens; "
            f"{name!r} has d={own_d}, {own_layers} layers and {own_vocab} tokens"
        )


def head_for_drafter(
    drafter: str,
    head: object,
    head_class: type,
    load: Callable[[Path], torch.nn.Module],
    artifact: str,
    backend: HiddenStates,
    vocab_size: int,
    name: str,
    int8_head: bool = True,
) -> torch.nn.Module:
    """A one-head drafter's (``eagle``, ``falcon``, ``ctc``) head for the target ``name`` served by ``backend``:
    ``head`` itself when it is a ``head_class``, else ``load`` of the directory it names (None: trained next to the
    model, else shipped with the package); refused when trained for a target of another shape; on the backend's
    device and in its precision (its LM head in int8 with ``int8_head``, see :func:`to_backend`)."""
    if isinstance(head, head_class):
        loaded = head
    else:
        loaded = load(head_directory(head, name, artifact, drafter, "a head", "head"))
    refuse_other_target(drafter, loaded.config, backend, vocab_size, name)
    return to_backend(loaded, backend.device, backend.dtype, int8_head)
