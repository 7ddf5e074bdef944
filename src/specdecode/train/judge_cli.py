"""``specdecode train judge --model M``: the judge of ``--verifier judge``, saved where that verifier looks."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from specdecode.errors import SpecDecodeError
from specdecode.models.registry import DEFAULT_MODEL
from specdecode.train.data import DEFAULT_TASKS


def add_judge_command(methods: argparse._SubParsersAction) -> None:
    judge = methods.add_parser(
        "judge", help="the judge of --verifier judge (LOSSY): which mismatches the target would carry on from"
    )
    judge.add_argument("--model", default=DEFAULT_MODEL, help="registry short name, local dir, .gguf or hub id")
    judge.add_argument("--prompts", type=int, default=48, help="prompts the model answers itself")
    judge.add_argument("--tasks", default=DEFAULT_TASKS, help="benchmark tasks to take those prompts from")
    judge.add_argument("--new-tokens", type=int, default=96, help="tokens the model generates per prompt")
    judge.add_argument("--max-prompt-tokens", type=int, default=384, help="prompts are cut to their last N tokens")
    judge.add_argument("--positions", type=int, default=24, help="answer positions examined per answer")
    judge.add_argument("--window", type=int, default=4, help="harmless: the next N tokens stay the target's")
    judge.add_argument("--top-k", type=int, default=5, help="alternatives: among the target's top K ...")
    judge.add_argument("--min-prob", type=float, default=0.05, help="... with at least this probability")
    judge.add_argument("--precision", type=float, default=0.9, help="held-out precision the threshold must reach")
    judge.add_argument("--seed", type=int, default=0)
    judge.add_argument("--out", help="judge directory (default: next to the cached model, where the verifier looks)")
    judge.set_defaults(run=cmd_train_judge)


def cmd_train_judge(args: argparse.Namespace) -> int:
    from specdecode.models.artifacts import trained_artifact_path
    from specdecode.models.loading import load_model
    from specdecode.train.data import prompt_ids, self_distill
    from specdecode.train.judge import train_judge
    from specdecode.verify.judge import JUDGE_ARTIFACT, JudgeOptions

    for flag in ("prompts", "new_tokens", "max_prompt_tokens", "positions", "window"):
        if getattr(args, flag) <= 0:
            raise SpecDecodeError(f"--{flag.replace('_', '-')} must be positive")
    if not 0 < args.precision <= 1:
        raise SpecDecodeError(f"--precision must be in (0, 1], got {args.precision}")
    params = JudgeOptions(top_k=args.top_k, min_prob=args.min_prob)  # validates both
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise SpecDecodeError("--tasks names no task")
    out = Path(args.out).expanduser() if args.out else trained_artifact_path(args.model, JUDGE_ARTIFACT)
    if out is None:
        raise SpecDecodeError(f"for a hub id like {args.model!r} pass --out DIR to say where the judge goes")
    target = load_model(args.model)
    started = time.perf_counter()
    prompts = [p[-args.max_prompt_tokens :] for p in prompt_ids(target, tasks, args.prompts, args.seed)]
    answers = self_distill(target, prompts, args.new_tokens, args.max_prompt_tokens)
    sequences = [(sequence, len(prompt)) for prompt, sequence in zip(prompts, answers)]
    generated = time.perf_counter() - started
    judge, collecting = train_judge(
        target.backend,
        sequences,
        window=args.window,
        params=params,
        positions=args.positions,
        precision=args.precision,
        seed=args.seed,
        model=args.model,
    )
    judge.report = {**(judge.report or {}), "window": args.window, "top_k": args.top_k, "min_prob": args.min_prob}
    judge.save(out)
    report = judge.report
    print(
        f"judge for {args.model}: {report['examples']} alternatives from {len(sequences)} answers, "
        f"{report['harmless_share']:.0%} harmless (the next {args.window} tokens unchanged); held-out "
        f"({report['held_out']}) at threshold {report['threshold']:.3f}: precision {report['held_out_precision']:.0%}, "
        f"recall {report['held_out_recall']:.0%}"
        + ("" if report["precision_reached"] else f" (precision {args.precision:.0%} not reached: the best F1 instead)")
    )
    print(f"answers {generated:.0f} s, alternatives {collecting:.0f} s; saved {out}")
    hint = "" if not args.out else f" --verifier-option judge={out}"
    print(f'use it (LOSSY): specdecode generate "..." --model {args.model} --verifier judge{hint}')
    return 0
