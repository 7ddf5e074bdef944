"""``specdecode train {medusa,hydra}``: data → cached target features → training → heads where the drafter looks.

The same pipeline as ``train eagle`` (:mod:`specdecode.train.eagle_run`), through the same feature cache
(:mod:`specdecode.train.features`): the target's final hidden states are computed once and cached (keyed
by the data settings) next to the heads' directory, and training checkpoints there every couple of
minutes and after every epoch, so an interrupted run started again with the same flags picks up where it
stopped.
"""

from __future__ import annotations

import argparse

from specdecode.errors import SpecDecodeError
from specdecode.heads.medusa import heads_dir, save_heads
from specdecode.train.common import checked_tasks, report_training
from specdecode.train.features import collect, training_in_bf16
from specdecode.train.medusa import HeadsTrainConfig, train_heads


def run_heads_training(args: argparse.Namespace) -> int:
    """``specdecode train medusa`` or ``specdecode train hydra`` (``args.method``)."""
    kind = args.method
    tasks = checked_tasks(args, ("num_heads", "head_layers"))
    if args.prefix_window < 0:
        raise SpecDecodeError("--prefix-window must be >= 0 (0: no prefix attention)")
    # No intermediate layers: the heads read the final hidden state only.
    run = collect(args, tasks, heads_dir(kind), "the heads go", lambda num_layers: ())
    config = HeadsTrainConfig(
        kind=kind,
        num_heads=args.num_heads,
        num_layers=args.head_layers,
        prefix_window=args.prefix_window,
        draft_vocab=args.draft_vocab,
        epochs=args.epochs,
        lr=args.lr,
        seed=args.seed,
        bf16=training_in_bf16(args.train_dtype),
    )
    result = train_heads(
        run.target.backend, run.features, config, progress=True, checkpoint=run.checkpoint, spill=run.checkpoint.parent
    )
    save_heads(result.heads, run.out, verifier=args.model)
    vocab = result.heads.config.draft_vocab_size
    report_training(args, result, f"{kind} heads", vocab, "head", run.seconds, run.out, kind, "heads")
    return 0
