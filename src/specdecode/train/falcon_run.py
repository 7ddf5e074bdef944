"""``specdecode train falcon``: data → cached target features → training → the head where the drafter looks.

The same pipeline as ``train eagle`` (:mod:`specdecode.train.eagle_run`) through the same feature cache
(:mod:`specdecode.train.features`), keeping the final hidden states only (as Medusa and Hydra do, so their
cached features serve here too); training checkpoints every couple of minutes and after every epoch, so an
interrupted run started again with the same flags picks up where it stopped.
"""

from __future__ import annotations

import argparse

from specdecode.heads.falcon import HEAD_DIR, save_falcon
from specdecode.train.common import checked_tasks, report_training
from specdecode.train.falcon import FalconTrainConfig, train_falcon
from specdecode.train.features import collect, training_in_bf16


def run_falcon_training(args: argparse.Namespace) -> int:
    tasks = checked_tasks(args, ("block", "passes"))
    # No intermediate layers: the head reads the final hidden state only.
    run = collect(args, tasks, HEAD_DIR, "the head goes", lambda num_layers: ())
    config = FalconTrainConfig(
        draft_vocab=args.draft_vocab,
        block=args.block,
        passes=args.passes,
        epochs=args.epochs,
        lr=args.lr,
        seed=args.seed,
        bf16=training_in_bf16(args.train_dtype),
    )
    result = train_falcon(
        run.target.backend, run.features, config, progress=True, checkpoint=run.checkpoint, spill=run.checkpoint.parent
    )
    save_falcon(result.head, run.out, verifier=args.model)
    vocab = result.head.config.draft_vocab_size
    report_training(args, result, "falcon head", vocab, "drafted token", run.seconds, run.out, "falcon", "head")
    return 0
