"""Training text for drafter weights: prompts and conversations the benchmark never draws.

Two sources, both kept apart from every benchmark prompt (the benchmark takes the first prompts of each
task in a seeded order; training starts after :data:`BENCH_PROMPTS_SKIPPED` of them):
- **self-distillation**: the target's own greedy answers to task prompts, generated losslessly with
  prompt lookup (the same tokens as plain greedy decoding, faster) — exactly what a drafter is asked to
  predict at inference;
- **ShareGPT conversations** (human and assistant turns, rendered with the model's chat template:
  :func:`specdecode.data.corpus.sharegpt_conversations`), which only need a prefill: many more tokens per
  second of a CPU than generating.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm import tqdm

from specdecode.batch_engine import BatchEngine, BatchRequest
from specdecode.config import GenerationConfig
from specdecode.data.corpus import BENCH_PROMPTS_SKIPPED
from specdecode.data.tasks import load_task
from specdecode.draft_length.factory import make_policy
from specdecode.drafters import create_drafter
from specdecode.errors import SpecDecodeError

if TYPE_CHECKING:
    from specdecode.models.loading import LoadedModel


def encode_user_prompt(target: LoadedModel, text: str) -> list[int]:
    tokenizer = target.tokenizer
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": text}]
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
    return tokenizer(text, add_special_tokens=True)["input_ids"]


def prompt_ids(target: LoadedModel, tasks: list[str], n: int, seed: int) -> list[list[int]]:
    """Up to ``n`` prompts spread over ``tasks``, after the ones the benchmark uses, as the model's input
    ids (chat template applied where the model has one); a task whose data cannot be loaded (e.g. offline
    without its cached wheel) is left out with a warning."""
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
    return [encode_user_prompt(target, text) for text in texts]


#: Answers written together: batched greedy decoding writes several times the tokens per second of one prompt at
#: a time (``docs/results/eagle-1m-rows-smollm2-135m/training.md``).
DISTILL_BATCH = 32


def self_distill(
    target: LoadedModel, prompts: list[list[int]], new_tokens: int, max_prompt_tokens: int, skip: int = 0
) -> Iterator[list[int]]:
    """Each prompt (cut to its last ``max_prompt_tokens``) followed by the target's greedy answer, yielded
    in the prompts' order as soon as every earlier one is done (with a progress bar), after ``skip``
    prompts already done.  Up to :data:`DISTILL_BATCH` answers are decoded together."""
    generation = GenerationConfig(max_new_tokens=new_tokens, num_draft_tokens=8)
    engine = BatchEngine(
        target.backend,
        create_drafter("pld", target),
        lambda config, drafter: make_policy(config.num_draft_tokens),
        frozenset(target.backend.eos_token_ids),
        max_batch_size=DISTILL_BATCH,
    )
    for index in range(skip, len(prompts)):
        engine.submit(BatchRequest(prompts[index][-max_prompt_tokens:], generation, tag=index))
    answers: dict[int, list[int]] = {}
    finished: set[int] = set()
    following = skip
    with tqdm(desc="self-distilling", unit="prompt", initial=skip, total=len(prompts)) as bar:
        for event in engine.run():
            answers.setdefault(event.tag, []).extend(event.new_tokens)
            if not event.finished:
                continue
            finished.add(event.tag)
            bar.update()
            while following in finished:
                yield prompts[following][-max_prompt_tokens:] + answers.pop(following)
                following += 1


def kept_sequences(path: Path | None, decode: Callable[..., Iterable[list[int]]]) -> list[list[int]]:
    """The token sequences kept in the JSON Lines file ``path``, then those ``decode(skip=n)`` writes after the first
    ``n`` (each appended to the file as it comes): an interrupted run resumes where it stopped, and a run on the same
    data decodes nothing.  A last line an interrupted write left unfinished is cut off the file first.  Without a
    ``path``: all of ``decode(skip=0)``."""
    if path is None:
        return list(decode(skip=0))
    done: list[list[int]] = []
    if path.is_file():
        text = path.read_text()
        complete = text[: text.rfind("\n") + 1]
        if complete != text:
            path.write_text(complete)
        done = [json.loads(line) for line in complete.splitlines()]
    with path.open("a") as sink:
        for sequence in decode(skip=len(done)):
            sink.write(json.dumps(sequence) + "\n")
            sink.flush()
            done.append(sequence)
    return done
