"""A datastore for ``--drafter rasd``: a model's own greedy answers to ShareGPT prompts no benchmark run draws.

    python tools/write_own_answers.py --model smollm2-135m --answers 3000 --out own-answers.jsonl
    specdecode generate "..." --drafter rasd --drafter-option datastore=own-answers.jsonl

Open chat copies little from its prompt, but a model answers alike across prompts (openings, list formats, the same
explanations): the answers it gave earlier hold what it will write again (REST's datastore, from the model itself).
The prompts are ShareGPT's opening turns from ``--skip`` on, in the benchmark's seeded order (the benchmark takes the
first ones; none of its first 100 equals one of these); answers are decoded 32 at a time with prompt lookup (the same
tokens as plain greedy decoding) and written as JSON Lines of ``{"text": ...}``, each as soon as every earlier one is.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from specdecode.data.tasks import load_task
from specdecode.models.loading import load_model
from specdecode.threads import fixed_threads
from specdecode.train.data import self_distill


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--answers", type=int, default=3000)
    parser.add_argument("--skip", type=int, default=100, help="ShareGPT prompts the benchmark may draw, left out")
    parser.add_argument("--new-tokens", type=int, default=160)
    parser.add_argument("--max-prompt-tokens", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    with fixed_threads(args.threads):
        target = load_model(args.model)
        tokenizer = target.tokenizer
        texts = [p.text for p in load_task("sharegpt", args.skip + args.answers, 0).prompts[args.skip :]]
        prompts = [
            list(
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True
                )
            )
            for t in texts
        ]
        started = time.perf_counter()
        with args.out.open("w") as out:
            for prompt, sequence in zip(
                prompts, self_distill(target, prompts, args.new_tokens, args.max_prompt_tokens)
            ):
                answer = sequence[len(prompt[-args.max_prompt_tokens :]) :]
                out.write(json.dumps({"text": tokenizer.decode(answer, skip_special_tokens=True)}) + "\n")
                out.flush()
    print(f"{len(prompts)} answers in {time.perf_counter() - started:.0f} s: {args.out}")


if __name__ == "__main__":
    main()
