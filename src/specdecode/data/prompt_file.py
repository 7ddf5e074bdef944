"""The user's own prompts for ``specdecode bench --prompts FILE.jsonl``: a benchmark of their workload.

One JSON object per line, in either of two layouts:

* Spec-Bench's ``question.jsonl``: ``{"question_id": 81, "category": "writing", "turns": ["...", ...]}``.
  Only the first turn is a prompt: a later turn follows the model's own answer to the earlier ones, which
  differs from contestant to contestant (and MT-Bench is measured the same way by ``--tasks mt-bench``).
* ours: ``{"id": "p1", "task": "code", "text": "..."}``; ``id`` and ``task`` are optional (the line number,
  and ``custom``); ``session`` names a session whose requests run in order on one drafter, as in
  ``multi-edit``; ``grounded`` marks a prompt whose answer copies from given text.

The lines' tasks (``category`` / ``task``) become the benchmark's tasks, in order of first appearance.  A
line that is not valid is reported and left out; the others still run.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specdecode.data.prompts import Prompt, Task
from specdecode.errors import SpecDecodeError

DEFAULT_TASK = "custom"


@dataclass(frozen=True)
class PromptFile:
    """The prompts of one file grouped by task, and one message per line left out."""

    path: Path
    sha256: str
    tasks: dict[str, list[Prompt]]
    skipped: list[str] = field(default_factory=list)

    def select(self, names: tuple[str, ...] | None, per_task: int | None) -> list[Task]:
        """The named tasks (all when None), each cut to its first ``per_task`` prompts — or sessions, for a
        task with sessions (all when None).  Unknown names are an error naming the file's tasks."""
        names = names or tuple(self.tasks)
        if unknown := [name for name in names if name not in self.tasks]:
            raise SpecDecodeError(f"task(s) {', '.join(unknown)} not in {self.path}; it has {', '.join(self.tasks)}")
        tasks = []
        for name in names:
            task = Task(name=name, category=name, prompts=self.tasks[name])
            groups = task.sessions()[:per_task] if per_task is not None else task.sessions()
            tasks.append(Task(name=name, category=name, prompts=[p for group in groups for p in group]))
        return tasks

    @property
    def largest_task(self) -> int:
        """Prompts (sessions) in the biggest task: the prompts per task that keeps every prompt."""
        return max(len(Task(name, name, prompts).sessions()) for name, prompts in self.tasks.items())


def read_prompt_file(path: str | Path) -> PromptFile:
    """Parse ``path``; an unreadable file, or one without a single valid line, is an error."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise SpecDecodeError(f"cannot read prompts file {path}: {exc.strerror or exc}") from exc
    tasks: dict[str, list[Prompt]] = {}
    seen: set[str] = set()
    skipped = []
    for number, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            task, prompt = _parse_line(line, number)
            if prompt.id in seen:
                raise SpecDecodeError(f"duplicate id {prompt.id!r}")
        except SpecDecodeError as exc:
            skipped.append(f"{path}:{number}: {exc}; line left out")
            continue
        seen.add(prompt.id)
        tasks.setdefault(task, []).append(prompt)
    if not tasks:
        reason = skipped[0] if skipped else f"{path} holds no prompts"
        raise SpecDecodeError(f"no valid prompt in {path} ({reason})" if skipped else reason)
    return PromptFile(path=path, sha256=hashlib.sha256(data).hexdigest(), tasks=tasks, skipped=skipped)


def _parse_line(line: str, number: int) -> tuple[str, Prompt]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise SpecDecodeError(f"not JSON ({exc.msg})") from None
    if not isinstance(record, dict):
        raise SpecDecodeError("not a JSON object")
    if "turns" in record:  # Spec-Bench
        turns = record["turns"]
        if not isinstance(turns, list) or not turns:
            raise SpecDecodeError('"turns" must be a non-empty list of strings')
        text = turns[0]
        identifier = record.get("question_id", f"line-{number}")
        task = record.get("category", DEFAULT_TASK)
    elif "text" in record:
        text = record["text"]
        identifier = record.get("id", f"line-{number}")
        task = record.get("task", DEFAULT_TASK)
    else:
        raise SpecDecodeError('neither "turns" (Spec-Bench) nor "text" (ours)')
    if not isinstance(text, str) or not text.strip():
        raise SpecDecodeError("the prompt must be a non-empty string")
    _check_scalar("id", identifier, (str, int))
    _check_scalar("task", task, (str,))
    session = record.get("session", "")
    _check_scalar("session", session, (str,))
    grounded = record.get("grounded", False)
    _check_scalar("grounded", grounded, (bool,))
    if not task.strip():
        raise SpecDecodeError("the task must be a non-empty string")
    prompt = Prompt(id=f"{task}/{identifier}", text=text, grounded=grounded, session=session)
    return task, prompt


def _check_scalar(name: str, value: Any, types: tuple[type, ...]) -> None:
    # bool is an int: an id of true is as wrong as an id of [1].
    if not isinstance(value, types) or (bool not in types and isinstance(value, bool)):
        kinds = " or ".join("a boolean" if t is bool else "an integer" if t is int else "a string" for t in types)
        raise SpecDecodeError(f'"{name}" must be {kinds}, got {json.dumps(value)}')
