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


#: Sequences per cached feature shard: an interrupted collection loses at most this many forwards.
SHARD = 16


def _features(target, args: argparse.Namespace, tasks: list[str], work: Path, aux_layers) -> list:
    """The training data's target features, computed once: self-distilled answers are appended to a file
    as they are generated and features are saved in shards, so an interrupted run resumes where it was."""
    from tqdm import tqdm

    from specdecode.train.data import prompt_ids, self_distill, sharegpt_conversations
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
    work.mkdir(parents=True, exist_ok=True)
    whole = work / f"features-{digest}.pt"  # written by earlier versions in one piece
    if whole.is_file():
        print(f"using cached target features {whole}")
        return [Features(**item) for item in torch.load(whole, weights_only=True)]

    distilled_file = work / f"distilled-{digest}.jsonl"
    sequences = (
        [json.loads(line) for line in distilled_file.read_text().splitlines()] if distilled_file.is_file() else []
    )
    prompts = prompt_ids(target, tasks, args.prompts, args.seed)
    with distilled_file.open("a") as sink:
        for sequence in self_distill(target, prompts, args.new_tokens, args.max_tokens, skip=len(sequences)):
            sink.write(json.dumps(sequence) + "\n")
            sink.flush()
            sequences.append(sequence)
    if args.conversations:
        sequences += sharegpt_conversations(target, args.conversations, args.max_tokens, args.seed)

    shards = work / f"features-{digest}"
    shards.mkdir(exist_ok=True)
    features: list[Features] = []
    with tqdm(total=len(sequences), desc="target features", unit="seq") as bar:
        for start in range(0, len(sequences), SHARD):
            shard = shards / f"{start // SHARD:05d}.pt"
            if shard.is_file():
                part = [Features(**item) for item in torch.load(shard, weights_only=True)]
            else:
                part = compute_features(target.backend, sequences[start : start + SHARD], aux_layers, progress=False)
                tmp = shard.with_name(shard.name + ".tmp")
                torch.save([{"ids": f.ids, "aux": f.aux, "final": f.final} for f in part], tmp)
                tmp.replace(shard)
            features += part
            bar.update(len(part))
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
