"""Resolve a model name to a loaded backend + tokenizer.

Accepted names, tried in order: a short name from the offline registry (``specdecode models``), a
local directory saved by transformers, a local ``.gguf`` file, and a Hugging Face hub id (the normal
path for users with a network; it fails with a clear message on machines without one).
"""

from __future__ import annotations

import json
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from specdecode.errors import SpecDecodeError, UnknownModelError, VocabularyMismatchError
from specdecode.models import registry
from specdecode.models.auto_quantize import auto_format
from specdecode.models.base import CausalLM
from specdecode.models.cost import tune_fast_path
from specdecode.models.fastpath import fast_path_supported
from specdecode.models.hf import HFCausalLM
from specdecode.models.layer_forward import apply_cpu_fast_path_with_layers
from specdecode.models.quantize import AUTO_QUANTIZE, check_quantize, quantize_model
from specdecode.threads import threads_from_environment


@dataclass
class LoadedModel:
    name: str
    backend: CausalLM
    tokenizer: PreTrainedTokenizerBase
    quantize: str = "none"  # the weight format it was loaded in (``auto`` resolved)


def _from_pretrained_args(name: str) -> tuple[str, dict]:
    if registry.is_registered(name):
        return str(registry.ensure_model(name)), {}
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return str(path.parent), {"gguf_file": path.name}
    if path.is_dir():
        return str(path), {}
    if path.exists() or name.startswith((".", "/", "~")) or name.endswith(".gguf"):
        raise UnknownModelError(f"model path {name!r} is neither a transformers model directory nor a .gguf file")
    return name, {}


def _hub_reachable(timeout_s: float = 3.0) -> bool:
    """A quick TCP check, so that a typo on an offline machine fails in seconds, not after a minute of
    download retries."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in {"1", "true", "yes", "on"}:
        return False
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout_s).close()
        return True
    except OSError:
        return False


def _tokenizer_args(source: str) -> dict:
    """transformers 4.57.6 warns of a broken "Mistral regex" for every local checkpoint it saved itself;
    for a model that is not a Mistral we say explicitly that no fix applies, which silences it."""
    config = Path(source) / "config.json"
    if config.is_file() and "mistral" not in json.loads(config.read_text()).get("model_type", ""):
        return {"fix_mistral_regex": False}
    return {}


def _unknown_model(name: str, reason: str) -> UnknownModelError:
    known = ", ".join(registry.model_names())
    return UnknownModelError(
        f"cannot load model {name!r}: not a registered short name ({known}), not a local model "
        f"directory or .gguf file, and as a hub id: {reason}"
    )


def fast_path_default() -> bool:
    """On unless ``SPECDECODE_FAST_PATH=0`` (or this torch build lacks the oneDNN ops)."""
    return os.environ.get("SPECDECODE_FAST_PATH", "1") != "0" and fast_path_supported()


def packs_by_default(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether weights of ``dtype`` on ``device`` are packed as a model loaded with the defaults packs its own: the
    drafters' heads and VocabTrim rows follow the target's layers."""
    return device.type == "cpu" and dtype == torch.float32 and fast_path_default()


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``cpu`` (the default), ``cuda`` or ``cuda:N`` — refused clearly when torch cannot see it."""
    try:
        resolved = torch.device(device or "cpu")
    except RuntimeError as exc:
        raise SpecDecodeError(f"unknown device {device!r} (use cpu, cuda or cuda:N)") from exc
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise SpecDecodeError(f"device {device!r}: torch sees no CUDA device on this machine")
    if resolved.type not in {"cpu", "cuda"}:
        raise SpecDecodeError(f"device {device!r} is not supported (use cpu, cuda or cuda:N)")
    return resolved


def load_model(
    name: str,
    dtype: torch.dtype = torch.float32,
    fast_path: bool | None = None,
    device: str | torch.device | None = None,
    quantize: str = "none",
    block_copies: bool = True,
) -> LoadedModel:
    """Load ``name`` (see module doc) in ``dtype`` on ``device`` (default: the CPU).

    ``fast_path`` (default: :func:`fast_path_default`) prepacks fp32 linear layers for oneDNN, which
    makes a forward over several new tokens cost little more than over one — what speculation needs on
    a CPU.  It changes rounding in the last bits; plain and speculative decoding through the same
    loaded model use the same kernels, so their outputs stay identical.

    ``quantize`` (``none``, ``int8``, ``int4``, ``bf16``, ``w4a8``; CPU only) replaces the linear layers by weight-only
    quantized ones (:mod:`specdecode.models.quantize`) before anything runs: the quantized model is then
    *the* model, for plain decoding and verification alike.  ``auto``: the format this CPU runs the model fastest
    in, timed once per machine and model (:mod:`specdecode.models.auto_quantize`; ``none`` off the CPU), named in
    one line on stderr and in the result's ``quantize``.  ``block_copies``: int8 and int4 layers also keep
    a bf16 copy of their weight for prompts and drafts (``QuantizedLinear.block_weight``): a prompt's prefill
    then takes about a tenth of the time, for two more bytes per weight in memory."""
    if not isinstance(name, str) or not name.strip():
        raise UnknownModelError("model name must be a non-empty string")
    target_device = resolve_device(device)
    threads_from_environment()  # a bad SPECDECODE_THREADS is refused before anything loads
    if check_quantize(quantize) not in {"none", AUTO_QUANTIZE} and target_device.type != "cpu":
        raise SpecDecodeError(f"--quantize {quantize} runs on the CPU only (torch's CPU kernels), not on {device}")
    source, extra = _from_pretrained_args(name)
    is_hub_id = source == name and not extra and not Path(source).exists()
    if is_hub_id and not _hub_reachable():
        extra = {"local_files_only": True}  # a model downloaded earlier still loads offline
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **extra, **_tokenizer_args(source))
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **extra)
    except (OSError, ValueError) as exc:
        if extra.get("local_files_only"):
            raise _unknown_model(name, "not in the local Hugging Face cache, and the hub is not reachable") from exc
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise _unknown_model(name, f"loading failed: {first_line}") from exc
    packed = (fast_path_default() if fast_path is None else fast_path) and dtype == torch.float32
    if quantize == AUTO_QUANTIZE:
        choice = auto_format(model, target_device, fast_path=packed)
        print(choice.summary(name), file=sys.stderr)
        quantize = choice.mode
    if target_device.type != "cpu":
        model.to(target_device)
        packed = False
    else:  # the quantized and the oneDNN kernels: the CPU only
        # First: the fast path then packs only the fp32 layers left, if any.
        quantize_model(model, quantize, block_copies=block_copies)
    loaded = from_transformers(model, tokenizer, name, fast_path=packed)
    loaded.quantize = quantize
    return loaded


def from_transformers(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, name: str, fast_path: bool = False
) -> LoadedModel:
    """A causal LM and its tokenizer, already loaded by transformers, as the engine's :class:`LoadedModel`.

    The model is used in place: it is put in eval mode, and with ``fast_path`` (fp32 on the CPU) its linear layers
    are prepacked for oneDNN, which changes rounding in the last bits (plain and speculative decoding through the
    returned model then agree token for token; the model's own ``generate`` may differ from both at near-ties).
    A tokenizer without a pad token gets its EOS token as one."""
    if not isinstance(model, PreTrainedModel) or model.get_output_embeddings() is None:
        raise SpecDecodeError(f"expected a transformers causal LM (with an LM head), got {type(model).__name__}")
    if not isinstance(tokenizer, PreTrainedTokenizerBase):
        raise SpecDecodeError(f"expected a transformers tokenizer, got {type(tokenizer).__name__}")
    if fast_path:
        first = next(model.parameters())
        if first.device.type != "cpu" or first.dtype != torch.float32:
            raise SpecDecodeError(f"the fast path packs fp32 CPU weights, not {first.dtype} on {first.device}")
        apply_cpu_fast_path_with_layers(model)
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is not None:
        tokenizer.pad_token = tokenizer.eos_token
    backend = HFCausalLM(model, name)
    tune_fast_path(backend)  # which of its kernels this CPU runs faster for plain decoding's few rows
    return LoadedModel(name=name, backend=backend, tokenizer=tokenizer)


def check_same_vocabulary(target: LoadedModel, draft: LoadedModel) -> None:
    """Refuse a draft model whose tokenizer maps text to different ids than the target's."""
    if target.tokenizer.get_vocab() != draft.tokenizer.get_vocab():
        raise VocabularyMismatchError(
            f"vocabulary mismatch: draft model {draft.name!r} ({type(draft.tokenizer).__name__}, "
            f"{len(draft.tokenizer)} tokens) does not share the tokenizer of target {target.name!r} "
            f"({type(target.tokenizer).__name__}, {len(target.tokenizer)} tokens); "
            "choose a draft model with the same vocabulary, or draft across vocabularies with "
            "--drafter draft-model (--drafter-option vocab_mapping=text|ngram|intersection)"
        )
