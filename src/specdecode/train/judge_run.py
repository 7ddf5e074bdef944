"""``specdecode train judge --model M``: the judge of ``--verifier judge``, saved where that verifier looks."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from specdecode.errors import SpecDecodeError
from specdecode.models.artifacts import trained_artifact_path
from specdecode.models.loading import load_model
from specdecode.train.common import check_positive, task_names
from specdecode.train.data import prompt_ids, self_distill
from specdecode.train.judge import train_judge
from specdecode.verify.judge import JUDGE_ARTIFACT, JudgeOptions


def run_judge_training(args: argparse.Namespace) -> int:
    check_positive(args, "prompts", "new_tokens", "max_prompt_tokens", "positions", "window")
    if not 0 < args.precision <= 1:
        raise SpecDecodeError(f"--precision must be in (0, 1], got {args.precision}")
    params = JudgeOptions(top_k=args.top_k, min_prob=args.min_prob)  # validates both
    tasks = task_names(args.tasks)
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
