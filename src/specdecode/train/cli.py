"""``specdecode train {kangaroo,eagle,medusa,hydra,judge} --model M``: fit drafter (or judge) weights, saved where
the drafter (or verifier) looks."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from specdecode.config import DEFAULT_DRAFT_VOCAB
from specdecode.errors import SpecDecodeError
from specdecode.models.registry import DEFAULT_MODEL
from specdecode.train.data import DEFAULT_TASKS
from specdecode.train.judge_cli import add_judge_command


def add_train_command(subparsers: argparse._SubParsersAction) -> None:
    train = subparsers.add_parser("train", help="train drafter weights on the target model's own outputs")
    methods = train.add_subparsers(dest="method", required=True)
    kangaroo = methods.add_parser(
        "kangaroo", help="the adapter of the kangaroo drafter (shallow exit + small trained block)"
    )
    kangaroo.add_argument("--model", default=DEFAULT_MODEL, help="registry short name, local dir, .gguf or hub id")
    kangaroo.add_argument("--exit-layer", type=int, help="layers the draft runs (default: a third of the depth)")
    kangaroo.add_argument("--prompts", type=int, default=42, help="training prompts, spread over --tasks")
    kangaroo.add_argument("--tasks", default=DEFAULT_TASKS, help="benchmark tasks to take prompts from")
    kangaroo.add_argument("--new-tokens", type=int, default=96, help="tokens the model generates per prompt")
    kangaroo.add_argument("--max-prompt-tokens", type=int, default=384, help="prompts are cut to their last N tokens")
    kangaroo.add_argument("--epochs", type=int, default=12)
    kangaroo.add_argument("--lr", type=float, default=2e-3)
    kangaroo.add_argument("--inner-size", type=int, help="adapter width (default: twice the hidden size)")
    kangaroo.add_argument(
        "--draft-vocab", type=int, default=DEFAULT_DRAFT_VOCAB, help="frequent ids in the loss's vocabulary (0: all)"
    )
    kangaroo.add_argument("--seed", type=int, default=0)
    kangaroo.add_argument("--out", help="adapter file (default: next to the cached model, where the drafter looks)")
    kangaroo.set_defaults(run=cmd_train_kangaroo)
    add_eagle_command(methods)
    add_heads_commands(methods)
    add_judge_command(methods)


def cmd_train_kangaroo(args: argparse.Namespace) -> int:
    from specdecode.drafters.kangaroo import default_adapter_path
    from specdecode.models.loading import load_model
    from specdecode.train.data import prompt_ids
    from specdecode.train.kangaroo import TrainConfig, train_adapter

    for flag in ("prompts", "new_tokens", "max_prompt_tokens", "epochs", "inner_size"):
        if getattr(args, flag) is None:
            continue
        if getattr(args, flag) <= 0:
            raise SpecDecodeError(f"--{flag.replace('_', '-')} must be positive")
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise SpecDecodeError("--tasks names no task")
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


def _add_head_training_flags(command: argparse.ArgumentParser, what: str) -> None:
    """The flags every trained head shares: the target, the data it is built from, and the optimisation.
    ``what`` says whose they are in the help: "head's" or "heads'"."""
    command.add_argument("--model", default=DEFAULT_MODEL, help="registry short name, local dir, .gguf or hub id")
    command.add_argument("--prompts", type=int, default=96, help="prompts the model answers itself (self-distillation)")
    command.add_argument("--tasks", default=DEFAULT_TASKS, help="benchmark tasks to take those prompts from")
    command.add_argument("--new-tokens", type=int, default=128, help="tokens the model generates per prompt")
    command.add_argument("--conversations", type=int, default=600, help="ShareGPT conversations prefilled as data")
    command.add_argument("--max-tokens", type=int, default=512, help="tokens per training sequence (longer are cut)")
    _add_precision_flag(command, "--feature-dtype", "the target while it writes the data and its features")
    command.add_argument(
        "--draft-vocab", type=int, default=DEFAULT_DRAFT_VOCAB, help=f"VocabTrim: the {what} vocabulary (0: all)"
    )
    command.add_argument("--epochs", type=int, default=4)
    command.add_argument("--lr", type=float, default=1e-3)
    _add_precision_flag(command, "--train-dtype", "training's matmuls (bf16 by autocast: weights stay fp32)")
    command.add_argument("--seed", type=int, default=0)
    command.add_argument(
        "--out", help=f"the {what} directory (default: next to the cached model, where the drafter looks)"
    )


def _add_precision_flag(command: argparse.ArgumentParser, flag: str, of_what: str) -> None:
    """A precision choice read by :func:`specdecode.train.features.feature_dtype`."""
    command.add_argument(
        flag,
        choices=("auto", "fp32", "bf16"),
        default="auto",
        help=f"precision of {of_what} (auto: bf16 where the CPU multiplies bf16 natively, else fp32)",
    )


def _checked_tasks(args: argparse.Namespace, positive: tuple[str, ...]) -> list[str]:
    """The training tasks, after refusing flags out of range."""
    for flag in ("prompts", "new_tokens", "max_tokens", "epochs", *positive):
        if getattr(args, flag) <= 0:
            raise SpecDecodeError(f"--{flag.replace('_', '-')} must be positive")
    for flag in ("conversations", "draft_vocab"):
        if getattr(args, flag) < 0:
            raise SpecDecodeError(f"--{flag.replace('_', '-')} must be >= 0")
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise SpecDecodeError("--tasks names no task")
    return tasks


def add_eagle_command(methods: argparse._SubParsersAction) -> None:
    eagle = methods.add_parser(
        "eagle", help="the EAGLE-3 draft head of the eagle drafter (one layer over the target's features)"
    )
    _add_head_training_flags(eagle, "head's")
    eagle.add_argument("--ttt-steps", type=int, default=3, help="drafting steps unrolled in training")
    eagle.add_argument(
        "--init",
        metavar="DIR",
        help="start from this head (ours or speculators' EAGLE-3 layout) instead of the target's output stage: "
        "more epochs for a head trained before, or one trained elsewhere fine-tuned on this data; its layout and "
        "draft vocabulary are kept (--draft-vocab does not apply)",
    )
    # 3 epochs: SmolLM2-135M's head then trains within half an hour on two cores, data included
    # (docs/results/eagle-default-smollm2-135m).
    eagle.set_defaults(run=cmd_train_eagle, epochs=3)


def cmd_train_eagle(args: argparse.Namespace) -> int:
    from specdecode.train.eagle_run import run_eagle_training

    return run_eagle_training(args, _checked_tasks(args, ("ttt_steps",)))


def add_heads_commands(methods: argparse._SubParsersAction) -> None:
    """``train medusa`` and ``train hydra``: the eagle command's data flags, and the number of heads."""
    helps = {
        "medusa": "the heads of the medusa drafter (K residual blocks over the target's final hidden state)",
        "hydra": "the heads of the hydra drafter (each also reads the tokens drafted before it)",
    }
    for kind, text in helps.items():
        sub = methods.add_parser(kind, help=text)
        _add_head_training_flags(sub, "heads'")
        sub.add_argument("--num-heads", type=int, default=4, help="heads, i.e. the deepest draft")
        sub.set_defaults(run=cmd_train_heads)


def cmd_train_heads(args: argparse.Namespace) -> int:
    from specdecode.train.medusa_run import run_heads_training

    return run_heads_training(args, _checked_tasks(args, ("num_heads",)), args.method)
