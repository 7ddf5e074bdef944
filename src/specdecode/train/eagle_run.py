"""``specdecode train eagle``: data → cached target features → training → the head where the drafter looks.

Everything slow is resumable: the target features are cached (keyed by the data settings) next to the
head's directory, and training checkpoints there every couple of minutes and after every epoch, so an
interrupted run started again with the same flags picks up where it stopped.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from specdecode.errors import SpecDecodeError
from specdecode.heads.eagle import default_aux_layers
from specdecode.heads.files import CONFIG_FILE
from specdecode.heads.storage import HEAD_DIR, load_eagle, save_eagle
from specdecode.train.common import checked_tasks, report_training
from specdecode.train.eagle import EagleTrainConfig, train_eagle
from specdecode.train.features import collect, training_in_bf16


def run_eagle_training(args: argparse.Namespace) -> int:
    tasks = checked_tasks(args, ("ttt_steps",))
    init = Path(args.init).expanduser() if args.init else None
    if init is not None and not (init / CONFIG_FILE).is_file():  # before the slow part, not after it
        raise SpecDecodeError(f"--init {args.init}: no EAGLE head there (no {CONFIG_FILE})")
    run = collect(args, tasks, HEAD_DIR, "the head goes", default_aux_layers)
    config = EagleTrainConfig(
        draft_vocab=args.draft_vocab,
        ttt_steps=args.ttt_steps,
        epochs=args.epochs,
        lr=args.lr,
        seed=args.seed,
        bf16=training_in_bf16(args.train_dtype),
    )
    initial = None if init is None else load_eagle(init, run.target.backend.num_layers)
    result = train_eagle(
        run.target.backend,
        run.features,
        config,
        progress=True,
        checkpoint=run.checkpoint,
        initial=initial,
        spill=run.checkpoint.parent,
    )
    save_eagle(result.head, run.out, verifier=args.model)
    vocab = result.head.config.draft_vocab_size
    report_training(args, result, "eagle head", vocab, "drafting step", run.seconds, run.out, "eagle", "head")
    return 0
