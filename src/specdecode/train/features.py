"""The target features every head training starts from, and where a ``specdecode train`` run keeps them.

``train eagle``, ``train medusa`` and ``train hydra`` (:mod:`specdecode.train.eagle_run`,
:mod:`specdecode.train.medusa_run`) build their data the same way — the target's own greedy answers and
ShareGPT conversations, one target forward each — and differ only in the layers they keep.  The features
are cached (keyed by the data settings) in a work directory next to the output, or in ``--data-dir``, so everything
slow is resumable: an interrupted run started again with the same flags picks up where it stopped, and runs of other
head kinds or ``--init`` runs pointed at the same data directory reuse the answers (and the features, where they keep
the same layers).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from tqdm import tqdm

from specdecode.data.corpus import sharegpt_conversations
from specdecode.errors import SpecDecodeError
from specdecode.heads.files import replace_atomically
from specdecode.models.artifacts import trained_artifact_path
from specdecode.models.loading import LoadedModel, load_model
from specdecode.models.quantized_layers import bf16_matmul_supported
from specdecode.train.data import kept_sequences, prompt_ids, self_distill
from specdecode.train.eagle import Features, compute_features


def feature_dtype(choice: str) -> torch.dtype:
    """The target's precision while it writes the training data (``auto``, ``fp32`` or ``bf16``).

    ``auto`` takes bf16 where oneDNN multiplies it (``bf16_matmul_supported``, as the bf16 target does):
    SmolLM2's prefill runs about three times faster with AMX than in fp32
    (``docs/results/eagle-1m-rows-smollm2-135m/training.md``).  The head trained on bf16
    features still drafts for the fp32 target: a feature's rounding is far below what one layer's
    approximation of thirty gets wrong, and the target verifies every draft either way."""
    if choice == "auto":
        return torch.bfloat16 if bf16_matmul_supported() else torch.float32
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[choice]


def training_in_bf16(choice: str) -> bool:
    """Whether ``--train-dtype`` (``auto``, ``fp32``, ``bf16``) trains with bf16 matmuls; ``auto`` as for
    the features.  SmolLM2's EAGLE head trains faster that way to the same held-out acceptance as in fp32
    (``docs/results/eagle-1m-rows-smollm2-135m/training.md``)."""
    return feature_dtype(choice) == torch.bfloat16


def work_dir(out: Path) -> Path:
    """Where a run keeps its feature cache and checkpoint: beside ``out``, so a rerun for the same output
    finds them, and the output directory itself only ever holds the finished head."""
    return out.with_name(out.name + ".work")


#: Sequences per cached feature shard: an interrupted collection loses at most this many forwards.
SHARD = 16


def data_digest(target: LoadedModel, args: argparse.Namespace, tasks: list[str], aux_layers: tuple[int, ...]) -> str:
    """Names a run's data (the settings it is built from and the target writing it): the distilled answers and
    feature shards of a work directory are filed under it, so a run with other settings never reads them."""
    key = {
        "model": target.name,
        "prompts": args.prompts,
        "tasks": tasks,
        "new_tokens": args.new_tokens,
        "conversations": args.conversations,
        "max_tokens": args.max_tokens,
        "seed": args.seed,
        "aux": list(aux_layers),
        "dtype": str(target.backend.dtype),
    }
    return settings_digest(key)


def settings_digest(key: dict[str, object]) -> str:
    """A short name for the settings ``key`` (JSON-serialisable), the same in every run given the same settings."""
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def target_features(
    target: LoadedModel, args: argparse.Namespace, tasks: list[str], data: Path, aux_layers: tuple[int, ...]
) -> list[Features]:
    """The training data's target features, computed once: self-distilled answers are appended to a file
    as they are generated and features are saved in shards, so an interrupted run resumes where it was."""
    digest = data_digest(target, args, tasks, aux_layers)
    data.mkdir(parents=True, exist_ok=True)
    whole = data / f"features-{digest}.pt"  # written by earlier versions in one piece
    if whole.is_file():
        print(f"using cached target features {whole}")
        return [Features(**item) for item in torch.load(whole, weights_only=True, mmap=True)]

    # The answers do not depend on the layers kept: filed under the digest of none, every head kind shares them.
    distilled_file = data / f"distilled-{data_digest(target, args, tasks, ())}.jsonl"
    named_with_layers = data / f"distilled-{digest}.jsonl"  # as earlier versions filed an EAGLE run's answers
    if named_with_layers.is_file() and not distilled_file.is_file():
        named_with_layers.rename(distilled_file)
    prompts = prompt_ids(target, tasks, args.prompts, args.seed)
    sequences = kept_sequences(distilled_file, partial(self_distill, target, prompts, args.new_tokens, args.max_tokens))
    if args.conversations:
        sequences += sharegpt_conversations(target, args.conversations, args.max_tokens, args.seed)

    shards = data / f"features-{digest}"
    shards.mkdir(exist_ok=True)
    features: list[Features] = []
    with tqdm(total=len(sequences), desc="target features", unit="seq") as bar:
        for start in range(0, len(sequences), SHARD):
            shard = shards / f"{start // SHARD:05d}.pt"
            if not shard.is_file():
                part = compute_features(target.backend, sequences[start : start + SHARD], aux_layers, progress=False)
                items = [{"ids": f.ids, "aux": f.aux, "final": f.final} for f in part]
                replace_atomically(shard, partial(torch.save, items))
            # Memory-mapped: the data stays in the page cache, not in the process (Qwen's 362k rows are 4.5 GB).
            part = [Features(**item) for item in torch.load(shard, weights_only=True, mmap=True)]
            features += part
            bar.update(len(part))
    return features


@dataclass
class Collected:
    """A run's inputs once the data is ready: where the head goes, the target, its features, and where
    training checkpoints."""

    out: Path
    target: LoadedModel
    features: list[Features]
    checkpoint: Path
    seconds: float  # loading the target and collecting the features


def collect(
    args: argparse.Namespace,
    tasks: list[str],
    artifact: str,
    goes: str,
    aux_layers: Callable[[int], tuple[int, ...]],
) -> Collected:
    """Resolve the output (``--out``, or ``artifact`` next to the model), load the target and gather its
    features, keeping ``aux_layers(num_layers)`` besides the final hidden state.  ``goes`` ends the error
    for a model with no default place, which has to ask for ``--out`` ("the head goes", "the heads go")."""
    out = Path(args.out).expanduser() if args.out else trained_artifact_path(args.model, artifact)
    if out is None:
        raise SpecDecodeError(
            f"unknown model {args.model!r}: not a registry name (see `specdecode models`), a local model directory "
            f"or a .gguf file; for a hub id pass --out DIR to say where {goes}"
        )
    started = time.perf_counter()
    target = load_model(args.model)
    dtype = feature_dtype(args.feature_dtype)
    writer = target if dtype == target.backend.dtype else load_model(args.model, dtype=dtype)
    work = work_dir(out)
    work.mkdir(parents=True, exist_ok=True)
    data = Path(args.data_dir).expanduser() if args.data_dir else work
    features = target_features(writer, args, tasks, data, aux_layers(target.backend.num_layers))
    return Collected(out, target, features, work / "checkpoint.pt", time.perf_counter() - started)
