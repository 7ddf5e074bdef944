"""An EAGLE head's acceptance on prompts no training drew, as ``train eagle`` reports it and as the engine meets it.

    python tools/measure_head_acceptance.py --out docs/results/eagle-own-tokens-smollm2-135m

1. **Teacher-forced** (``train.eagle.held_out_acceptance``, what ``train eagle`` prints at its end): the target's greedy
   answers to the benchmark's first prompts of each task (the prompts training skips), one target forward over each
   prompt + answer, the head unrolled ``--steps`` deep from every row; per drafting step, the share right given the
   earlier steps right — over every row (prompt and chat template included) and over the rows read as drafting reads
   them (each fed token the target's own greedy choice).
2. **In the engine**: the same prompts decoded with ``eagle`` drafting chains of ``--steps`` (``tree_nodes=0``, the
   lookup branch off, a fixed draft length, so every step drafts): per position, the steps that accepted it over
   those that drafted it and accepted every position before (``GenerationStats.accepted_at``, ``drafted_at``).  Every
   output is checked against plain decoding's.

Writes ``results.json`` and ``results.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from specdecode.bench import common
from specdecode.data.corpus import BENCH_PROMPTS_SKIPPED
from specdecode.data.tasks import load_tasks
from specdecode.drafters import create_drafter
from specdecode.generator import SpeculativeGenerator
from specdecode.models.loading import load_model
from specdecode.stats import GenerationStats
from specdecode.threads import fixed_threads
from specdecode.train.common import chain_tokens, target_views
from specdecode.train.eagle import compute_features, held_out_acceptance, make_windows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--head", default=None, help="a head directory (default: the one --drafter eagle finds)")
    parser.add_argument("--tasks", default="mt-bench,sharegpt")
    parser.add_argument(
        "--prompts-per-task",
        type=int,
        default=BENCH_PROMPTS_SKIPPED,
        help=f"at most {BENCH_PROMPTS_SKIPPED}: training draws the prompts after those",
    )
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if not 0 < args.prompts_per_task <= BENCH_PROMPTS_SKIPPED:
        parser.error(f"--prompts-per-task must be 1-{BENCH_PROMPTS_SKIPPED}: training draws the prompts after those")
    with fixed_threads(args.threads):
        measure(args)


def measure(args: argparse.Namespace) -> None:
    target = load_model(args.model)
    drafter = create_drafter("eagle", target, head=args.head, tree_nodes=0, lookup=False)
    head = drafter.head
    tokenizer = target.tokenizer
    texts = [p.text for task in load_tasks(args.tasks.split(","), args.prompts_per_task, 0) for p in task.prompts]
    prompts = [
        list(tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True))
        for t in texts
    ]
    plain = SpeculativeGenerator.build(target, "none")
    speculative = SpeculativeGenerator(target, drafter)
    stats, sequences, equal = [], [], 0
    for ids in prompts:
        options = {"max_new_tokens": args.new_tokens, "ignore_eos": True}
        answer = plain.generate(ids, **options).token_ids
        drafted = speculative.generate(ids, num_draft_tokens=args.steps, **options)
        equal += drafted.token_ids == answer
        stats.append(drafted.stats)
        sequences.append(ids + answer)

    backend = target.backend
    features = compute_features(backend, sequences, head.config.aux_layers, progress=False)
    _, layerwise = target_views(backend, "eagle")
    windows = make_windows(features, window=64, steps=args.steps)
    with torch.inference_mode():
        held = held_out_acceptance(head, layerwise, backend.embed, windows, batch_windows=8)
    total = GenerationStats.combined(stats)
    reached = [total.drafted_at[0], *total.accepted_at[: args.steps - 1]]
    engine = [a / min(r, d) for a, r, d in zip(total.accepted_at, reached, total.drafted_at)][: args.steps]
    rows = int(windows.valid[0].sum())
    results = {
        "environment": common.environment(args.threads),
        "settings": {**{k: str(v) for k, v in vars(args).items()}, "prompts": len(prompts)},
        "outputs_equal_to_plain": f"{equal}/{len(prompts)}",
        "teacher_forced_every_row": held.every,
        "teacher_forced_rows": rows,
        "teacher_forced_own_tokens": held.own,
        "own_rows": held.own_rows,
        "engine_by_position": engine,
        "engine_drafted_at": total.drafted_at,
        "engine_accepted_at": total.accepted_at,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    percent = lambda rates: " / ".join(f"{rate:.1%}" for rate in rates)  # noqa: E731
    lines = [
        f"# `{args.model}`'s EAGLE head: teacher-forced acceptance against the engine's",
        "",
        f"{len(prompts)} prompts ({args.tasks}, the benchmark's first {args.prompts_per_task} of each), "
        f"{args.new_tokens} greedy tokens each; chains of {args.steps}; outputs equal to plain decoding: "
        f"{equal}/{len(prompts)}.",
        "",
        "| figure | rows | per drafting step | tokens a chain would average |",
        "|---|---|---|---|",
        f"| teacher-forced, every row | {rows} | {percent(held.every)} | {chain_tokens(held.every):.2f} |",
        f"| teacher-forced, the target's own tokens | {held.own_rows} | {percent(held.own)} "
        f"| {chain_tokens(held.own):.2f} |",
        f"| in the engine (accepted / drafted per position) | – | {percent(engine)} | {chain_tokens(engine):.2f} |",
    ]
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
