"""``specdecode train ctc``: data → cached target features → training → the head where the drafter looks.

The same pipeline as ``train medusa`` (:mod:`specdecode.train.medusa_run`) through the same feature cache
(:mod:`specdecode.train.features`), keeping the final hidden states only; training checkpoints every couple of
minutes and after every epoch, so an interrupted run started again with the same flags picks up where it stopped.
"""

from __future__ import annotations

import argparse

from specdecode.heads.ctc import HEAD_DIR, save_ctc
from specdecode.train.common import checked_tasks, report_training
from specdecode.train.ctc import CTCTrainConfig, check_slots, train_ctc
from specdecode.train.features import collect, training_in_bf16


def run_ctc_training(args: argparse.Namespace) -> int:
    tasks = checked_tasks(args, ("slots", "tokens"))
    check_slots(args.slots, args.tokens)
    # No intermediate layers: the head reads the final hidden state only.
    run = collect(args, tasks, HEAD_DIR, "the head goes", lambda num_layers: ())
    config = CTCTrainConfig(
        draft_vocab=args.draft_vocab,
        slots=args.slots,
        tokens=args.tokens,
        epochs=args.epochs,
        lr=args.lr,
        seed=args.seed,
        bf16=training_in_bf16(args.train_dtype),
    )
    result = train_ctc(
        run.target.backend, run.features, config, progress=True, checkpoint=run.checkpoint, spill=run.checkpoint.parent
    )
    save_ctc(result.head, run.out, verifier=args.model)
    vocab = result.head.config.draft_vocab_size
    report_training(args, result, "ctc head", vocab, "drafted token", run.seconds, run.out, "ctc", "head")
    return 0
