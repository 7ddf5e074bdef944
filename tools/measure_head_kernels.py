"""Time a trained head's LM head through each kernel it can draft with (fp32 panels, torch's int8 kernel, our w4a8),
and what each does to its drafts and to decoding.

The shipped Hydra heads of ``--model`` (their 8,192-row LM head), on the benchmark's first 8 prompts of ``mt-bench``
and ``sharegpt`` (no head training draws them), the target in ``--quantize``:

1. each kernel called on 1, 2 and 4 rows of random activations as a drafting step calls it: cold, after a target
   forward has pushed the weights out of the caches (here 64 MB of other memory is written before each call), the
   median of 30 calls;
2. over the target's greedy answers to the prompts (96 tokens each), head 0's guess at every answer token through
   each kernel: how often its top token (and its top 4) is the target's next token, how often it is the fp32 head's,
   and how far its logits are from the fp32 ones;
3. decoding the prompts with ``hydra`` (greedy, 96 tokens, ``auto`` trees, the drafter reset before each prompt) with
   its LM head in each kernel, two alternated rounds: tokens per second and per step, every output checked against
   plain decoding's.

    python tools/measure_head_kernels.py --model smollm2-135m --quantize bf16 --out docs/results/DIR/head-kernels.json
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from specdecode.config import GenerationConfig
from specdecode.data.tasks import load_tasks
from specdecode.generator import SpeculativeGenerator
from specdecode.heads.files import shipped_head
from specdecode.heads.medusa import load_heads
from specdecode.machine import cpu_name
from specdecode.models.base import SequenceInput
from specdecode.models.fastpath import apply_cpu_fast_path
from specdecode.models.loading import load_model
from specdecode.models.quantized_layers import Int8Linear
from specdecode.models.w4a8 import W4A8Linear, best_isa

ROWS = (1, 2, 4)
FLUSH_BYTES = 64 << 20
NEW_TOKENS = 96


def cold_call_us(kernel: nn.Module, rows: torch.Tensor, flush: torch.Tensor) -> float:
    times = []
    for _ in range(30):
        flush.add_(1)
        started = time.perf_counter()
        kernel(rows)
        times.append(time.perf_counter() - started)
    return round(statistics.median(times) * 1e6, 1)


def head_guesses(target, heads, kernels: dict[str, nn.Module], prompts: list[list[int]], answers: list[list[int]]):
    """Part 2: per kernel, the shares of answer tokens where head 0's guesses hold the target's next token."""
    backend = target.backend
    draft_ids = torch.full((backend.vocab_size,), -1, dtype=torch.long)  # a target id's row in the heads' LM head
    draft_ids[heads.token_map] = torch.arange(len(heads.token_map))
    hits = {name: {"top1_is_targets": 0, "top4_has_targets": 0, "top1_is_fp32s": 0} for name in kernels}
    largest_difference = dict.fromkeys(kernels, 0.0)
    for ids, answer in zip(prompts, answers):
        tokens = torch.tensor([*ids, *answer])
        with torch.inference_mode():
            cache = backend.new_cache()
            out = backend.forward_batch([SequenceInput(tokens, cache, hidden_layers=(backend.num_layers,))])[0]
            # Head 0 as drafting calls it at answer token t: the final hidden state of position t - 1 and t's
            # embedding; what it should guess is the target's own next token (its choice at position t).
            first = len(ids)
            hidden = heads.head(0, out.hidden[first - 1 : -1], backend.embed(tokens[first:])[:, None, :])
            wanted = draft_ids[out.logits[first:].argmax(-1)]
            exact = kernels["fp32 panels"](hidden)
            for name, kernel in kernels.items():
                logits = kernel(hidden)
                top4 = logits.topk(4).indices
                hits[name]["top1_is_targets"] += int((top4[:, 0] == wanted).sum())
                hits[name]["top4_has_targets"] += int((top4 == wanted[:, None]).any(-1).sum())
                hits[name]["top1_is_fp32s"] += int((top4[:, 0] == exact.argmax(-1)).sum())
                difference = float((logits - exact).abs().max() / exact.abs().max())
                largest_difference[name] = round(max(largest_difference[name], difference), 4)
    rows = sum(len(answer) for answer in answers)
    return rows, {
        name: {
            **{key: round(count / rows, 4) for key, count in hits[name].items()},
            "max_abs_difference_over_max_logit": d,
        }
        for name, d in largest_difference.items()
    }


def decoding(generator: SpeculativeGenerator, kernels: dict[str, nn.Module], prompts, answers) -> dict[str, list]:
    """Part 3: per kernel, tokens per second and per step of each round."""
    rounds = {name: [] for name in kernels}
    for _ in range(2):
        for name, kernel in kernels.items():
            generator.drafter.heads.lm_head = kernel
            tokens = steps = 0
            started = time.perf_counter()
            for ids, answer in zip(prompts, answers):
                generator.reset_drafter()
                result = generator.generate(ids)
                if result.token_ids != answer:
                    raise SystemExit(f"{name}: an output differs from plain decoding's")
                tokens, steps = tokens + len(answer), steps + result.stats.steps
            elapsed = time.perf_counter() - started
            rounds[name].append(
                {"tokens_per_s": round(tokens / elapsed, 2), "tokens_per_step": round(tokens / steps, 3)}
            )
            print(name, rounds[name][-1], flush=True)
    return rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--quantize", default="bf16", help="the target's weights, as --quantize")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    heads = load_heads(shipped_head(args.model, "hydra-heads"), "hydra").eval()
    linear = heads.lm_head
    packed = nn.Sequential(copy.deepcopy(linear))
    apply_cpu_fast_path(packed)
    kernels = {"fp32 panels": packed[0], "int8": Int8Linear(linear, tied=False), "w4a8": W4A8Linear(linear, tied=False)}
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8)
    generator = torch.Generator().manual_seed(0)
    inputs = {rows: torch.randn(rows, linear.in_features, generator=generator) for rows in ROWS}
    timing = {
        name: {rows: cold_call_us(kernel, inputs[rows], flush) for rows in ROWS} for name, kernel in kernels.items()
    }
    print(timing, flush=True)

    target = load_model(args.model, quantize=args.quantize)
    plain = SpeculativeGenerator.build(target, "none", GenerationConfig(max_new_tokens=NEW_TOKENS))
    tasks = load_tasks(("mt-bench", "sharegpt"), 8)
    prompts = [plain.encode_prompt(prompt.text, chat=True) for task in tasks for prompt in task.prompts]
    answers = [plain.generate(ids).token_ids for ids in prompts]
    rows, guesses = head_guesses(target, heads, kernels, prompts, answers)
    print(guesses, flush=True)
    hydra = SpeculativeGenerator.build(target, "hydra", GenerationConfig(max_new_tokens=NEW_TOKENS))
    record = {
        "model": args.model,
        "quantize": args.quantize,
        "cpu": cpu_name(),
        "capability": str(torch.backends.cpu.get_cpu_capability()),
        "w4a8_isa": best_isa(),
        "threads": torch.get_num_threads(),
        "lm_head": list(linear.weight.shape),
        "cold_call_us": timing,
        "answer_rows": rows,
        "head0_guesses": guesses,
        "hydra_decoding": decoding(hydra, kernels, prompts, answers),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
