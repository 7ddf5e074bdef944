"""``specdecode train kangaroo --model M``: fit a Kangaroo adapter and save it where the drafter looks."""

from __future__ import annotations

import argparse
from pathlib import Path

from specdecode.errors import SpecDecodeError
from specdecode.models.registry import DEFAULT_MODEL

#: Prompt sources that need no download (built from the Python standard library's sources).
DEFAULT_TASKS = "summarize,rag,edit"


def add_train_command(subparsers: argparse._SubParsersAction) -> None:
    train = subparsers.add_parser("train", help="train drafter weights on the target model's own outputs")
    methods = train.add_subparsers(dest="method", required=True)
    kangaroo = methods.add_parser(
        "kangaroo", help="the adapter of the kangaroo drafter (shallow exit + small trained block)"
    )
    kangaroo.add_argument("--model", default=DEFAULT_MODEL, help="registry short name, local dir, .gguf or hub id")
    kangaroo.add_argument("--exit-layer", type=int, help="layers the draft runs (default: a fifth of the depth)")
    kangaroo.add_argument("--prompts", type=int, default=36, help="training prompts, spread over --tasks")
    kangaroo.add_argument("--tasks", default=DEFAULT_TASKS, help="benchmark tasks to take prompts from")
    kangaroo.add_argument("--new-tokens", type=int, default=64, help="tokens the model generates per prompt")
    kangaroo.add_argument("--max-prompt-tokens", type=int, default=256, help="prompts are cut to their last N tokens")
    kangaroo.add_argument("--epochs", type=int, default=4)
    kangaroo.add_argument("--lr", type=float, default=1e-3)
    kangaroo.add_argument("--seed", type=int, default=0)
    kangaroo.add_argument("--out", help="adapter file (default: next to the cached model, where the drafter looks)")
    kangaroo.set_defaults(run=cmd_train_kangaroo)


def _prompt_ids(target, tasks: list[str], n: int, seed: int) -> list[list[int]]:
    from specdecode.bench.tasks import load_task

    per_task = -(-n // len(tasks))
    texts = [p.text for name in tasks for p in load_task(name, per_task, seed).prompts][:n]
    tokenizer = target.tokenizer
    if getattr(tokenizer, "chat_template", None):
        return [
            tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True)
            for t in texts
        ]
    return [tokenizer(t, add_special_tokens=True)["input_ids"] for t in texts]


def cmd_train_kangaroo(args: argparse.Namespace) -> int:
    from specdecode.drafters.kangaroo import default_adapter_path
    from specdecode.models.loading import load_model
    from specdecode.train.kangaroo import TrainConfig, train_adapter

    for flag in ("prompts", "new_tokens", "max_prompt_tokens", "epochs"):
        if getattr(args, flag) <= 0:
            raise SpecDecodeError(f"--{flag.replace('_', '-')} must be positive")
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise SpecDecodeError("--tasks names no task")
    out = Path(args.out).expanduser() if args.out else default_adapter_path(args.model)
    if out is None:
        raise SpecDecodeError(f"no default place to save an adapter for {args.model!r}; pass --out PATH")
    target = load_model(args.model)
    config = TrainConfig(
        exit_layer=args.exit_layer, new_tokens=args.new_tokens, max_prompt_tokens=args.max_prompt_tokens,
        epochs=args.epochs, lr=args.lr, seed=args.seed,
    )
    result = train_adapter(target, _prompt_ids(target, tasks, args.prompts, args.seed), config, progress=True)
    result.adapter.save(out, target.backend)
    print(
        f"kangaroo adapter for {args.model}: exit after {result.adapter.exit_layer}/{target.backend.num_layers} "
        f"layers, {result.positions} positions; held-out KL {result.before.kl:.3f} -> {result.after.kl:.3f}, "
        f"top-1 agreement with the full model {result.before.top1:.1%} -> {result.after.top1:.1%}"
    )
    print(f"saved {out}")
    hint = "" if not args.out else f" --drafter-option adapter={out}"
    print(f"use it: specdecode generate \"...\" --model {args.model} --drafter kangaroo{hint}")
    return 0
