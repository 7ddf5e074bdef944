"""``specdecode train datastore``: a model's own greedy answers to ShareGPT prompts, for ``--drafter rasd``.

Open chat copies little from its prompt, but a model answers alike across prompts (openings, list layouts, the same
explanations), so the answers it gave earlier hold what it writes next (REST's datastore, written by the model
itself; ``docs/results/rasd-own-answers-smollm2-135m``).  The prompts are ShareGPT's opening turns after the first
``--skip`` in the benchmark's seeded order, leaving out any the benchmark's first ones repeat; answers are decoded
32 at a time with prompt lookup (the same tokens as plain greedy decoding) and appended as JSON Lines of
``{"text": ...}``, each as soon as every earlier one is, so a run cut short resumes after the answers it wrote.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from specdecode.data.tasks import load_task
from specdecode.errors import SpecDecodeError
from specdecode.models.loading import load_model
from specdecode.train.common import check_positive
from specdecode.train.data import encode_user_prompt, self_distill


def run_datastore(args: argparse.Namespace) -> int:
    check_positive(args, "answers", "new_tokens", "max_prompt_tokens")
    if args.skip < 0:
        raise SpecDecodeError("--skip must be zero or more")
    out = Path(args.out).expanduser()
    if out.is_dir() or not out.parent.is_dir():
        raise SpecDecodeError(f"--out: {out} is a directory" if out.is_dir() else f"--out: no directory {out.parent}")
    done = written_answers(out)
    if done >= args.answers:
        print(f"{out} already holds {done} answers")
        return 0
    target = load_model(args.model)
    texts = sharegpt_prompt_texts(args.skip, args.answers)
    if not texts:
        raise SpecDecodeError(f"no ShareGPT prompts after the first {args.skip}")
    prompts = [encode_user_prompt(target, text)[-args.max_prompt_tokens :] for text in texts]
    started = time.perf_counter()
    with out.open("a") as file:
        answers = self_distill(target, prompts, args.new_tokens, args.max_prompt_tokens, skip=done)
        for prompt, sequence in zip(prompts[done:], answers):
            text = target.tokenizer.decode(sequence[len(prompt) :], skip_special_tokens=True)
            file.write(json.dumps({"text": text}) + "\n")
            file.flush()
    print(f"{len(prompts)} answers of {args.model} in {out} ({time.perf_counter() - started:.0f} s)")
    print(f'use it: specdecode generate "..." --model {args.model} --drafter rasd --drafter-option datastore={out}')
    return 0


def sharegpt_prompt_texts(skip: int, count: int) -> list[str]:
    """Up to ``count`` ShareGPT opening turns after the first ``skip`` (seed 0), none equal to one of those."""
    prompts = load_task("sharegpt", skip + count, 0).prompts
    skipped = {prompt.text for prompt in prompts[:skip]}
    return [prompt.text for prompt in prompts[skip:] if prompt.text not in skipped]


def written_answers(path: Path) -> int:
    """The whole lines a run cut short left in ``path`` (a partial last line is cut off, to be written again); a file
    of other lines is refused rather than added to."""
    if not path.exists():
        return 0
    data = path.read_bytes()
    whole = data[: data.rfind(b"\n") + 1]
    for number, line in enumerate(whole.splitlines(), start=1):
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise SpecDecodeError(
                f'--out: {path} line {number} is not a {{"text": ...}} object: not a datastore to resume'
            )
    if len(whole) != len(data):
        path.write_bytes(whole)
    return whole.count(b"\n")
