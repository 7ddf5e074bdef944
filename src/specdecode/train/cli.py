"""``specdecode train kangaroo --model M``: fit a Kangaroo adapter and save it where the drafter looks."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from specdecode.drafters._self_draft import DEFAULT_DRAFT_VOCAB
from specdecode.errors import SpecDecodeError
from specdecode.models.registry import DEFAULT_MODEL

#: Prompt sources: chat, code and conversation sets (cached wheels) and the stdlib-grounded tasks.
DEFAULT_TASKS = "mt-bench,humaneval,sharegpt,champ,summarize,rag,edit"
#: The first prompts of each task (seed 0) are the ones ``specdecode bench`` measures; training skips them.
BENCH_PROMPTS_SKIPPED = 8


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


def _prompt_ids(target, tasks: list[str], n: int, seed: int) -> list[list[int]]:
    """Up to ``n`` prompts spread over ``tasks``, after the ones the benchmark uses; a task whose data
    cannot be loaded (e.g. offline without its cached wheel) is left out with a warning."""
    from specdecode.bench.tasks import load_task

    per_task = -(-n // len(tasks))
    by_task = []
    for name in tasks:
        try:
            prompts = load_task(name, BENCH_PROMPTS_SKIPPED + per_task, seed).prompts[BENCH_PROMPTS_SKIPPED:]
        except SpecDecodeError as exc:
            print(f"specdecode: warning: task {name!r} left out: {exc}", file=sys.stderr)
            continue
        by_task.append([p.text for p in prompts])
    texts = [group[i] for i in range(per_task) for group in by_task if i < len(group)][:n]
    if not texts:
        raise SpecDecodeError(f"no training prompts could be loaded from tasks {', '.join(tasks)}")
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
    result = train_adapter(target, _prompt_ids(target, tasks, args.prompts, args.seed), config, progress=True)
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
