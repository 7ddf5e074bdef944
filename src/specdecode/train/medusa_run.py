"""``specdecode train {medusa,hydra}``: data → cached target features → training → heads where the drafter looks.

The same pipeline as ``train eagle`` (:mod:`specdecode.train.eagle_run`), whose feature cache this reuses:
the target's final hidden states are computed once and cached (keyed by the data settings) next to the
heads' directory, and training checkpoints there every couple of minutes and after every epoch, so an
interrupted run started again with the same flags picks up where it stopped.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from specdecode.errors import SpecDecodeError


def run_heads_training(args: argparse.Namespace, tasks: list[str], kind: str) -> int:
    from specdecode.heads.medusa import save_heads
    from specdecode.models.artifacts import trained_artifact_path
    from specdecode.models.loading import load_model
    from specdecode.train.eagle_run import _features, _work_dir
    from specdecode.train.medusa import HeadsTrainConfig, train_heads

    out = Path(args.out).expanduser() if args.out else trained_artifact_path(args.model, f"{kind}-heads")
    if out is None:
        raise SpecDecodeError(
            f"unknown model {args.model!r}: not a registry name (see `specdecode models`), a local model directory "
            "or a .gguf file; for a hub id pass --out DIR to say where the heads go"
        )
    started = time.perf_counter()
    target = load_model(args.model)
    work = _work_dir(out)
    features = _features(target, args, tasks, work, ())  # no intermediate layers: the final state only
    collected = time.perf_counter()
    config = HeadsTrainConfig(
        kind=kind,
        num_heads=args.num_heads,
        draft_vocab=args.draft_vocab,
        epochs=args.epochs,
        lr=args.lr,
        seed=args.seed,
    )
    result = train_heads(target.backend, features, config, progress=True, checkpoint=work / "checkpoint.pt")
    save_heads(result.heads, out, verifier=args.model)
    per_head = ", ".join(f"{rate:.0%}" for rate in result.acceptance)
    print(
        f"{kind} heads for {args.model}: {result.rows} training rows, {result.heads.config.draft_vocab_size} draft "
        f"tokens; held-out ({result.held_out_rows} rows) top-1 acceptance per head {per_head} "
        f"(a greedy chain of {len(result.acceptance)} would average {result.expected_accepted:.2f} accepted tokens)"
    )
    print(
        f"data {collected - started:.0f} s, training {result.seconds:.0f} s; "
        f"losses per epoch {', '.join(f'{loss:.3f}' for loss in result.epoch_losses)}"
    )
    print(f"saved {out}")
    hint = "" if not args.out else f" --drafter-option heads={out}"
    print(f'use it: specdecode generate "..." --model {args.model} --drafter {kind}{hint}')
    return 0
