"""``specdecode train draft``: a draft model distilled into its target, saved as a model directory."""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict
from pathlib import Path

from specdecode.errors import SpecDecodeError
from specdecode.models.artifacts import trained_artifact_path
from specdecode.models.loading import load_model
from specdecode.train.common import check_positive, task_names
from specdecode.train.data import prompt_ids
from specdecode.train.draft import DistillConfig, distill, save_draft
from specdecode.train.features import settings_digest, training_in_bf16, work_dir


def default_out(target: str, draft: str) -> Path | None:
    """``distilled-<draft>`` next to the cached target."""
    return trained_artifact_path(target, f"distilled-{Path(draft).name}")


def data_name(args: argparse.Namespace, tasks: list[str]) -> str:
    """Names the decoded sequences by what they are made from, so a cache is only read by a run of the same data."""
    key = {
        "target": args.model,
        "quantize": args.quantize,
        "writer": args.draft if args.data == "draft" else "target",
        "tasks": tasks,
        "prompts": args.prompts,
        "new_tokens": args.new_tokens,
        "max_prompt_tokens": args.max_prompt_tokens,
        "seed": args.seed,
    }
    return f"answers-{settings_digest(key)}.jsonl"


def parse_exits(text: str) -> tuple[int, ...]:
    """``--exits``: comma-separated layer counts."""
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise SpecDecodeError(f"--exits takes comma-separated layer counts, got {text!r}") from None


def run_draft_training(args: argparse.Namespace) -> int:
    check_positive(args, "prompts", "new_tokens", "max_prompt_tokens", "epochs", "lr")
    config = DistillConfig(
        data=args.data,
        divergence=args.divergence,
        lora_rank=args.lora_rank,
        epochs=args.epochs,
        lr=args.lr,
        new_tokens=args.new_tokens,
        max_prompt_tokens=args.max_prompt_tokens,
        seed=args.seed,
        exits=parse_exits(args.exits),
        bf16=training_in_bf16(args.train_dtype),
    )
    tasks = task_names(args.tasks)
    out = Path(args.out).expanduser() if args.out else default_out(args.model, args.draft)
    if out is None:
        raise SpecDecodeError(f"unknown model {args.model!r}: pass --out DIR to say where the trained draft goes")
    started = time.perf_counter()
    target = load_model(args.model, quantize=args.quantize)
    draft = load_model(args.draft, fast_path=False)  # plain linear layers: the packed kernel has no gradient
    prompts = prompt_ids(target, tasks, args.prompts, args.seed)
    work = work_dir(out)
    work.mkdir(parents=True, exist_ok=True)
    model, result = distill(
        target,
        draft,
        prompts,
        config,
        checkpoint=work / "checkpoint.pt",
        answers_cache=work / data_name(args, tasks),
    )
    seconds = time.perf_counter() - started
    facts = {
        "target": args.model,
        "target_quantize": args.quantize,
        "draft": args.draft,
        "config": asdict(config),
        "tasks": tasks,
        "prompts": len(prompts),
        "train_sequences": result.train_sequences,
        "held_out_sequences": result.held_out_sequences,
        "answer_tokens": result.answer_tokens,
        "held_out_before": asdict(result.before),
        "held_out_after": asdict(result.after),
        "epoch_losses": result.epoch_losses,
        "seconds": round(seconds),
    }
    save_draft(model, draft, out, facts)
    print(
        f"draft {args.draft} distilled into {args.model} ({config.divergence}, {config.data} data, "
        f"{'full fine-tuning' if not config.lora_rank else f'LoRA rank {config.lora_rank}'}): {result.train_sequences} "
        f"sequences, {result.answer_tokens} answer tokens; held-out ({result.held_out_sequences} sequences) top-1 "
        f"agreement {result.before.top1:.1%} -> {result.after.top1:.1%}, 1 - TVD {result.before.one_minus_tvd:.1%} "
        f"-> {result.after.one_minus_tvd:.1%}"
    )
    for depth, after in result.after.exits.items():
        before = result.before.exits[depth]
        print(
            f"exit after {depth} layers: held-out top-1 agreement {before.top1:.1%} -> {after.top1:.1%}, "
            f"1 - TVD {before.one_minus_tvd:.1%} -> {after.one_minus_tvd:.1%}"
        )
    print(f"losses per epoch {', '.join(f'{loss:.4f}' for loss in result.epoch_losses)}; {seconds:.0f} s")
    print(f"saved {out}")
    print(f'use it: specdecode generate "..." --model {args.model} --drafter draft-model --draft-model {out}')
    return 0
