"""``specdecode train eagle``: data → cached target features → training → the head where the drafter looks.

Everything slow is resumable: the target features are cached (keyed by the data settings) next to the
head's directory, and training checkpoints there every couple of minutes and after every epoch, so an
interrupted run started again with the same flags picks up where it stopped.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

import torch

from specdecode.errors import SpecDecodeError


def _work_dir(out: Path) -> Path:
    return out.with_name(out.name + ".work")


def _features(target, args: argparse.Namespace, tasks: list[str], work: Path, aux_layers) -> list:
    from specdecode.train.data import prompt_ids, self_distilled, sharegpt_conversations
    from specdecode.train.eagle import Features, compute_features

    key = {
        "model": target.name,
        "prompts": args.prompts,
        "tasks": tasks,
        "new_tokens": args.new_tokens,
        "conversations": args.conversations,
        "max_tokens": args.max_tokens,
        "seed": args.seed,
        "aux": list(aux_layers),
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    cached = work / f"features-{digest}.pt"
    if cached.is_file():
        print(f"using cached target features {cached}")
        return [Features(**item) for item in torch.load(cached, weights_only=True)]
    sequences = self_distilled(
        target, prompt_ids(target, tasks, args.prompts, args.seed), args.new_tokens, args.max_tokens, progress=True
    )
    if args.conversations:
        sequences += sharegpt_conversations(target, args.conversations, args.max_tokens, args.seed)
    features = compute_features(target.backend, sequences, aux_layers, progress=True)
    work.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_name(cached.name + ".tmp")
    torch.save([{"ids": f.ids, "aux": f.aux, "final": f.final} for f in features], tmp)
    tmp.replace(cached)
    return features


def run_eagle_training(args: argparse.Namespace, tasks: list[str]) -> int:
    from specdecode.drafters.eagle import HEAD_DIR
    from specdecode.heads.eagle import default_aux_layers
    from specdecode.heads.storage import save_eagle
    from specdecode.models.artifacts import trained_artifact_path
    from specdecode.models.loading import load_model
    from specdecode.train.eagle import EagleTrainConfig, train_eagle

    out = Path(args.out).expanduser() if args.out else trained_artifact_path(args.model, HEAD_DIR)
    if out is None:
        raise SpecDecodeError(
            f"unknown model {args.model!r}: not a registry name (see `specdecode models`), a local model directory "
            "or a .gguf file; for a hub id pass --out DIR to say where the head goes"
        )
    started = time.perf_counter()
    target = load_model(args.model)
    work = _work_dir(out)
    features = _features(target, args, tasks, work, default_aux_layers(target.backend.num_layers))
    collected = time.perf_counter()
    config = EagleTrainConfig(
        draft_vocab=args.draft_vocab, ttt_steps=args.ttt_steps, epochs=args.epochs, lr=args.lr, seed=args.seed
    )
    result = train_eagle(target.backend, features, config, progress=True, checkpoint=work / "checkpoint.pt")
    save_eagle(result.head, out, verifier=args.model)
    per_step = ", ".join(f"{rate:.0%}" for rate in result.acceptance)
    print(
        f"eagle head for {args.model}: {result.rows} training rows, {result.head.config.draft_vocab_size} draft "
        f"tokens; held-out ({result.held_out_rows} rows) top-1 acceptance per drafting step {per_step} "
        f"(a greedy chain of {len(result.acceptance)} would average {result.expected_accepted:.2f} accepted tokens)"
    )
    print(
        f"data {collected - started:.0f} s, training {result.seconds:.0f} s; "
        f"losses per epoch {', '.join(f'{loss:.3f}' for loss in result.epoch_losses)}"
    )
    print(f"saved {out}")
    hint = "" if not args.out else f" --drafter-option head={out}"
    print(f'use it: specdecode generate "..." --model {args.model} --drafter eagle{hint}')
    return 0
