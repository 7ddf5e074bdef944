"""``specdecode train kangaroo``: the adapter trained on the target's own answers, saved where the drafter looks."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from specdecode.drafters.kangaroo import default_adapter_path
from specdecode.errors import SpecDecodeError
from specdecode.models.loading import load_model
from specdecode.train.common import check_positive, task_names
from specdecode.train.data import prompt_ids
from specdecode.train.kangaroo import TrainConfig, train_adapter


def run_kangaroo_training(args: argparse.Namespace) -> int:
    check_positive(args, "prompts", "new_tokens", "max_prompt_tokens", "epochs", "inner_size", "lr")
    tasks = task_names(args.tasks)
    out = Path(args.out).expanduser() if args.out else default_adapter_path(args.model)
    if out is None:
        raise SpecDecodeError(
            f"unknown model {args.model!r}: not a registry name (see `specdecode models`), a local model directory "
            "or a .gguf file; for a hub id pass --out PATH to say where the adapter goes"
        )
    target = load_model(args.model)
    config = TrainConfig(
        exit_layer=args.exit_layer,
        new_tokens=args.new_tokens,
        max_prompt_tokens=args.max_prompt_tokens,
        epochs=args.epochs,
        lr=args.lr,
        seed=args.seed,
        inner_size=args.inner_size,
        draft_vocab=args.draft_vocab,
    )
    started = time.perf_counter()
    result = train_adapter(target, prompt_ids(target, tasks, args.prompts, args.seed), config, progress=True)
    result.adapter.save(out, target.backend)
    print(
        f"kangaroo adapter for {args.model}: exit after {result.adapter.exit_layer}/{target.backend.num_layers} "
        f"layers, {result.positions} positions; held-out KL {result.before.kl:.3f} -> {result.after.kl:.3f}, "
        f"top-1 agreement with the full model {result.before.top1:.1%} -> {result.after.top1:.1%}"
    )
    print(f"saved {out} ({time.perf_counter() - started:.0f} s)")
    hint = "" if not args.out else f" --drafter-option adapter={out}"
    print(f'use it: specdecode generate "..." --model {args.model} --drafter kangaroo{hint}')
    return 0
