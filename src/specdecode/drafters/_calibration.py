"""A self-drafter's acceptance before its first draft, measured rather than assumed.

``auto`` needs an acceptance to weigh a cold request's first drafts with.  A fixed guess (one half) is far off
for a self-drafter: on SmolLM2-135M an exit after 15 of 30 layers agrees with the full model on 6% of next tokens,
so under that guess it drafts on every cold request and has next to nothing accepted
(``docs/results/quick-self-prior-epyc-r8``).  So the self-drafters measure, once per loaded drafter, how often their
greedy guess of the next token equals the target's on a built-in chat exchange, teacher-forced (both read the true
text: one forward each, no generation; the target's once per target).  That is the chance that a greedy draft's
first token is accepted; on the target's own answers acceptance often runs higher, so the measure errs towards not
drafting.

Draft models keep the declared prior.  Measured the same way, a draft model's agreement overstates what drafting
earns once it must read the prompt: Qwen2.5-Coder-0.5B agrees with the w4a8 1.5B on 80% of the answer's tokens, and
taken as the prior that made ``auto`` read every prompt and draft, slower over the suite than declining every prompt
at one half (``docs/results/w4a8-draft-prior-epyc-r8``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specdecode.drafters._vocab import DraftHead
from specdecode.models.base import CausalLM, ForwardOutput, KVCache, LayerwiseExecution
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


@dataclass(frozen=True)
class Calibration:
    """The exchange's tokens, the rows whose next token is in the answer, and the target's greedy choice there."""

    tokens: torch.Tensor
    rows: torch.Tensor
    wanted: torch.Tensor


#: Per target backend: its choices are computed once however many drafters measure themselves against them.
_CALIBRATIONS: weakref.WeakKeyDictionary[object, Calibration | None] = weakref.WeakKeyDictionary()


@torch.inference_mode()
def calibration(target: LoadedModel) -> Calibration | None:
    """The target's greedy next token after each row of the answer (one forward, once per target); None where
    no text can be made (:func:`calibration_text`)."""
    backend = target.backend
    if backend not in _CALIBRATIONS:
        text = calibration_text(target)
        if text is None:
            _CALIBRATIONS[backend] = None
        else:
            tokens, start = text
            rows = torch.arange(start - 1, len(tokens) - 1)
            out = _run_on_new_cache(backend, lambda c: backend.forward(tokens, c, logits_rows=rows, invariant=False))
            _CALIBRATIONS[backend] = Calibration(tokens, rows, out.logits.argmax(-1))
    return _CALIBRATIONS[backend]


def self_draft_agreement(
    target: LoadedModel,
    backend: LayerwiseExecution,
    head: DraftHead,
    skipped: frozenset[int],
    adapter: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> float | None:
    """The share of the answer's rows where the target with ``skipped`` layers left out, ``adapter`` on its last
    state, then the draft ``head`` (the self-drafters' draft), reading the true text, guesses the target's choice;
    None where no text can be made (:func:`calibration_text`)."""
    measured = calibration(target)
    if measured is None:
        return None
    tokens, rows = measured.tokens, measured.rows
    with torch.inference_mode():
        out = _run_on_new_cache(
            target.backend,
            lambda c: backend.forward_layers(
                tokens, c, skip_layers=skipped, exit_layer=backend.num_layers, output_hidden=True, logits_rows=rows[:0]
            ),
        )
        head_rows = head.for_prompt(tokens.tolist())
        hidden = out.hidden[rows]
        guessed = backend.exit_logits(adapter(hidden) if adapter else hidden, head_rows).argmax(-1)
    if head_rows.ids is not None:
        guessed = head_rows.ids[guessed]
    return float((guessed == measured.wanted).float().mean())


def _run_on_new_cache(backend: CausalLM, forward: Callable[[KVCache], ForwardOutput]) -> ForwardOutput:
    """One forward on a cache of its own, released after."""
    cache = backend.new_cache()
    try:
        return forward(cache)
    finally:
        cache.release()
