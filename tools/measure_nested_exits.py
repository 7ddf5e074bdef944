"""What nested drafts (S2D: exits at several depths of one small draft model) could gain on this CPU, measured.

    python tools/measure_nested_exits.py --out docs/results/s2d-exits-qwen2.5-coder-1.5b

For the Qwen pair (target ``qwen2.5-coder-1.5b``, draft ``qwen2.5-coder-0.5b``, both in ``--quantize`` weights):

1. **Acceptance of each exit**: the target's greedy answers to held-out benchmark prompts (MT-Bench, ShareGPT,
   HumanEval, CHAMP), then one forward of the draft over each prompt + answer; at every answer position, each exit
   (the draft's hidden state after layer d, through its final norm and LM head: S2D's exit before its sorted
   fine-tuning) is right when its top-1 token is the target's next one.  Teacher-forced top-1 agreement: the
   per-token acceptance of greedy drafting from that exit.
2. **Cost of each exit**: one-token forwards of the draft's body cut to d layers after a 128-token context, plus its
   LM head (the whole forward less the whole body), against the target's forwards of 1..9 new tokens after the same
   context (the verification curve), all through transformers' forward with the same weights, median of
   ``--repeats``.  ``draft-model`` drafts through a VocabTrim'd head of 32,768 rows (of 151,936): priced here at the
   full head's time scaled by its rows (a matrix-vector product's time is linear in its rows).
3. **What each exit would give**: the expected tokens per unit of time of greedy drafting k deep from that exit,
   E[tokens](k) / (k * c_d + V(k + 1)) with a_d its acceptance, c_d its token's cost and V the verification curve,
   the best k, over plain decoding (1 / V(1)); and the acceptance an exit would need (what S2D's training would have
   to reach) to beat the full draft.

Writes ``results.json`` and ``results.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from specdecode.bench import common
from specdecode.data.tasks import load_tasks
from specdecode.models.loading import load_model
from specdecode.threads import fixed_threads

TASKS = ("mt-bench", "sharegpt", "humaneval", "champ")
CONTEXT = 128
MAX_DEPTH = 8
#: ``draft-model``'s VocabTrim head rows (``DEFAULT_DRAFT_MODEL_VOCAB``) and the vocabulary's.
TRIMMED_ROWS, VOCAB_ROWS = 32768, 151936


def answers(target, prompts: list[str], tokens: int) -> list[tuple[list[int], int]]:
    """(prompt + the target's greedy answer, the prompt's length) per prompt."""
    model, tokenizer = target.backend.model, target.tokenizer
    out = []
    for text in prompts:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        with torch.inference_mode():
            generated = model.generate(torch.tensor([ids]), max_new_tokens=tokens, do_sample=False)
        out.append((generated[0].tolist(), len(ids)))
    return out


@torch.inference_mode()
def exit_agreement(draft, sequences: list[tuple[list[int], int]], exits: list[int]) -> dict[int, float]:
    """Per exit depth: how often its top-1 at an answer position is the token the target wrote next."""
    model = draft.backend.model
    right = dict.fromkeys(exits, 0)
    count = 0
    for ids, prompt_length in sequences:
        hidden = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
        truth = torch.tensor(ids[prompt_length:])
        rows = slice(prompt_length - 1, len(ids) - 1)  # the rows that predict the answer's tokens
        for depth in exits:
            state = hidden[depth][0, rows]
            if depth < len(hidden) - 1:  # the last entry has the final norm applied already
                state = model.model.norm(state)
            right[depth] += int((model.lm_head(state).argmax(-1) == truth).sum())
        count += len(truth)
    return {depth: right[depth] / count for depth in exits}


@torch.inference_mode()
def forward_seconds(loaded, width: int, repeats: int, depth: int | None = None, head: bool = True) -> float:
    """Seconds of a forward over ``width`` new tokens after ``CONTEXT`` cached ones, through the first ``depth``
    layers (all by default) and the final norm, and the LM head unless ``head`` is False."""
    model = loaded.backend.model
    run = model if head else model.model
    layers = model.model.layers
    if depth is not None:
        model.model.layers = layers[:depth]
    try:
        context = torch.randint(100, 1000, (1, CONTEXT))
        new = torch.randint(100, 1000, (1, width))

        def once() -> float:
            cache = run(context, use_cache=True).past_key_values
            tick = time.perf_counter()
            run(new, past_key_values=cache, use_cache=True)
            return time.perf_counter() - tick

        return statistics.median([once() for _ in range(repeats + 1)][1:])
    finally:
        model.model.layers = layers


def expected_rate(acceptance: float, k: int, token_cost: float, curve: list[float]) -> float:
    """Tokens per unit of time drafting k deep (units: one target forward over one token)."""
    tokens = sum(acceptance**i for i in range(k + 1))
    return tokens / (k * token_cost + curve[k])


def best(acceptance: float, token_cost: float, curve: list[float]) -> tuple[int, float]:
    """The best depth 0..MAX_DEPTH and its speed over plain decoding."""
    rates = [expected_rate(acceptance, k, token_cost, curve) for k in range(MAX_DEPTH + 1)]
    k = max(range(len(rates)), key=rates.__getitem__)
    return k, rates[k] / rates[0]


def needed(target_speed: float, token_cost: float, curve: list[float]) -> float | None:
    """The least acceptance (to 0.001) at which drafting at ``token_cost`` reaches ``target_speed``; None: never."""
    for step in range(1001):
        if best(step / 1000, token_cost, curve)[1] >= target_speed:
            return step / 1000
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--quantize", default="w4a8")
    parser.add_argument("--prompts-per-task", type=int, default=3)
    parser.add_argument("--answer-tokens", type=int, default=64)
    parser.add_argument("--exits", default="6,12,18,24")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    exits = [int(x) for x in args.exits.split(",")]
    started = time.perf_counter()
    with fixed_threads(torch.get_num_threads()):
        target = load_model(args.target, quantize=args.quantize)
        draft = load_model(args.draft, quantize=args.quantize)
        prompts = [p.text for task in load_tasks(TASKS, args.prompts_per_task, seed=1) for p in task.prompts]
        sequences = answers(target, prompts, args.answer_tokens)
        agreement = exit_agreement(draft, sequences, exits)
        one = forward_seconds(target, 1, args.repeats)
        curve = [forward_seconds(target, width, args.repeats) / one for width in range(1, MAX_DEPTH + 2)]
        body = {depth: forward_seconds(draft, 1, args.repeats, depth, head=False) for depth in exits}
        head = forward_seconds(draft, 1, args.repeats) - body[exits[-1]]
    rows = []
    for head_rows in (VOCAB_ROWS, TRIMMED_ROWS):
        costs = {depth: (body[depth] + head * head_rows / VOCAB_ROWS) / one for depth in exits}
        full_speed = best(agreement[exits[-1]], costs[exits[-1]], curve)[1]
        for depth in exits:
            k, speed = best(agreement[depth], costs[depth], curve)
            rows.append(
                {
                    "exit": depth,
                    "head_rows": head_rows,
                    "acceptance": agreement[depth],
                    "token_cost": costs[depth],
                    "best_k": k,
                    "speed_over_plain": speed,
                    "acceptance_to_match_full_draft": needed(full_speed, costs[depth], curve),
                    "speed_with_perfect_acceptance": best(1.0, costs[depth], curve)[1],
                }
            )
    results = {
        "settings": {**{k: str(v) for k, v in vars(args).items()}, "context": CONTEXT, "tasks": list(TASKS)},
        "environment": common.environment(torch.get_num_threads()),
        "prompts": len(sequences),
        "answer_tokens": sum(len(ids) - length for ids, length in sequences),
        "target_forward_s": one,
        "draft_head_s": head,
        "verification_curve": curve,
        "rows": rows,
        "measure_s": round(time.perf_counter() - started, 1),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    common.save_json(args.out / "results.json", results)
    (args.out / "results.md").write_text(markdown(results))
    print(markdown(results))
    return 0


def markdown(results: dict) -> str:
    curve = ", ".join(f"{c:.2f}" for c in results["verification_curve"])
    lines = [
        f"# Nested exits of `{results['settings']['draft']}` drafting for `{results['settings']['target']}` "
        f"({results['settings']['quantize']})",
        "",
        f"{results['prompts']} held-out prompts, {results['answer_tokens']} answer tokens of the target's greedy "
        f"answers. Target forward of 1 token after {CONTEXT}: {1000 * results['target_forward_s']:.1f} ms; of "
        f"1..{MAX_DEPTH + 1} tokens, relative to one: {curve}.",
        "",
        f"The draft's full LM head: {1000 * results['draft_head_s']:.1f} ms a token.",
        "",
        "| exit (layers) | LM head rows | acceptance (top-1 agreement) | token cost (target forwards) | best k | "
        "expected speed over plain | acceptance needed to match the full draft | speed at acceptance 1 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        need = row["acceptance_to_match_full_draft"]
        lines.append(
            f"| {row['exit']} | {row['head_rows']:,} | {100 * row['acceptance']:.1f}% | {row['token_cost']:.3f} | "
            f"{row['best_k']} | "
            f"{row['speed_over_plain']:.2f}x | {'never' if need is None else f'{100 * need:.1f}%'} | "
            f"{row['speed_with_perfect_acceptance']:.2f}x |"
        )
    lines += ["", f"Measured in {results['measure_s'] / 60:.1f} min.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
