"""A self-drafter's acceptance before its first draft, measured rather than assumed.

``auto`` needs an acceptance to weigh a cold request's first drafts with.  A fixed guess (one half) is far off
for a self-drafter: on SmolLM2-135M an exit after 15 of 30 layers agrees with the full model on 11% of next
tokens, and such a drafter drafted on every cold request and had none of 201 tokens accepted.  So each
self-drafter measures, once per loaded drafter, how often its greedy guess of the next token equals the target's
on a built-in chat exchange, teacher-forced (both read the true text: one forward each, no generation).  That
is the chance that a greedy draft's first token is accepted; on the target's own answers acceptance runs
higher (SmolLM2 with its Kangaroo adapter: 19% here, 33% of drafted tokens accepted over the quick suite), so
the measure errs towards not drafting, which costs a drafter that pays a few steps before probes find it out.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from specdecode.drafters._vocab import DraftHead
from specdecode.models.base import ForwardOutput, KVCache, LayerwiseExecution
from specdecode.models.loading import LoadedModel

#: The exchange the measure reads: an answer of the kind assistants give (prose, a list, a little code).
CALIBRATION_QUESTION = "How do I read a CSV file in Python and compute the average of one column?"
CALIBRATION_ANSWER = """Use the standard library's `csv` module: a `csv.DictReader` gives each row as a dictionary \
keyed by the header, so you can convert the column's values to numbers and average them.

```python
import csv

def column_average(path, column):
    with open(path, newline="") as f:
        values = [float(row[column]) for row in csv.DictReader(f) if row[column].strip()]
    return sum(values) / len(values)
```

With pandas, `pd.read_csv(path)[column].mean()` does the same in one line."""


def calibration_text(target: LoadedModel) -> tuple[torch.Tensor, int] | None:
    """The exchange as the target reads it (its chat template, else question and answer as plain text) and
    where the answer starts; None for a model without a tokenizer."""
    tokenizer = target.tokenizer
    if tokenizer is None:
        return None
    question = [{"role": "user", "content": CALIBRATION_QUESTION}]
    if getattr(tokenizer, "chat_template", None):
        prompt = list(tokenizer.apply_chat_template(question, tokenize=True, add_generation_prompt=True))
        whole = question + [{"role": "assistant", "content": CALIBRATION_ANSWER}]
        ids = list(tokenizer.apply_chat_template(whole, tokenize=True))
    else:
        prompt = tokenizer(CALIBRATION_QUESTION + "\n\n", add_special_tokens=True)["input_ids"]
        ids = tokenizer(CALIBRATION_QUESTION + "\n\n" + CALIBRATION_ANSWER, add_special_tokens=True)["input_ids"]
    ids = [token for token in ids if token < target.backend.vocab_size][: target.backend.max_context]
    if len(ids) - len(prompt) < 2:
        return None
    return torch.tensor(ids, dtype=torch.long), len(prompt)


@torch.inference_mode()
def teacher_forced_agreement(
    target: LoadedModel,
    backend: LayerwiseExecution,
    head: DraftHead,
    skip_sets: Sequence[frozenset[int]],
    adapter: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> list[float] | None:
    """For each skip set: the share of the answer's next tokens that the target with those layers left out
    (``adapter`` on its last state, then the draft ``head``) predicts as the full target does, both reading the
    true text; None where no text can be made (:func:`calibration_text`)."""
    text = calibration_text(target)
    if text is None:
        return None
    tokens, start = text
    rows = torch.arange(start - 1, len(tokens) - 1)  # positions whose next token is in the answer
    head_rows = head.for_prompt(tokens.tolist())
    wanted = _run(target, lambda cache: target.backend.forward(tokens, cache, logits_rows=rows, invariant=False))
    shares = []
    for skipped in skip_sets:
        out = _run(
            target,
            lambda cache, skipped=skipped: backend.forward_layers(
                tokens,
                cache,
                skip_layers=skipped,
                exit_layer=backend.num_layers,
                output_hidden=True,
                logits_rows=rows[:0],
            ),
        )
        hidden = out.hidden[rows]
        guessed = backend.exit_logits(adapter(hidden) if adapter else hidden, head_rows).argmax(-1)
        if head_rows.ids is not None:
            guessed = head_rows.ids[guessed]
        shares.append(float((guessed == wanted.logits.argmax(-1)).float().mean()))
    return shares


def _run(target: LoadedModel, forward: Callable[[KVCache], ForwardOutput]) -> ForwardOutput:
    """One forward on a cache of its own, released after."""
    cache = target.backend.new_cache()
    try:
        return forward(cache)
    finally:
        cache.release()
