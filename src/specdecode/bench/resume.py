"""``results.json``: written after every unit of work, resumed by a rerun with the same settings.

A benchmark's results carry a *fingerprint*: the settings and prompts a rerun must share with the run it
continues (what may grow, such as methods, is left out).  A directory holding results of other settings is
refused in one line, never silently overwritten.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from specdecode.data.tasks import Task
from specdecode.errors import SpecDecodeError

Fingerprint = Mapping[str, Any]


def save_json(path: Path, data: dict[str, Any]) -> None:
    """Write atomically: an interrupted run never leaves a half-written file to resume from."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def read_previous(path: Path) -> dict[str, Any] | None:
    """The results an earlier run left at ``path``, or None if there are none; unreadable ones are an error
    (they are never silently overwritten).  Whether they fit this run is for :func:`resume` to check."""
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SpecDecodeError(f"cannot resume from {path}: {exc}; delete it or choose another --out") from exc


def resume(
    path: Path,
    fingerprint: Fingerprint,
    schema_version: int | None = None,
    refusal: Callable[[Fingerprint], SpecDecodeError] | None = None,
    admit: Callable[[dict[str, Any]], dict[str, Any]] = lambda previous: previous,
) -> dict[str, Any] | None:
    """The results at ``path`` when they were written with ``fingerprint`` (and ``schema_version``, when given);
    None when there are none.  ``admit`` first brings older results up to date (or refuses another benchmark's);
    results of other settings are refused with ``refusal(their fingerprint)`` (default
    :func:`other_settings_error`)."""
    previous = read_previous(path)
    if previous is None:
        return None
    previous = admit(previous)
    schema_differs = schema_version is not None and previous.get("schema_version") != schema_version
    if schema_differs or previous.get("fingerprint") != fingerprint:
        old = previous.get("fingerprint") or {}
        raise refusal(old) if refusal else other_settings_error(path, old, fingerprint)
    return previous


def prompt_fingerprint(tasks: Sequence[Task]) -> list[str]:
    """``task/id#hash`` of every request, in order: what a resumed run must share with the first."""
    return [
        f"{task.name}/{p.id}#{hashlib.sha256(p.text.encode()).hexdigest()[:12]}" for task in tasks for p in task.prompts
    ]


def run_fingerprint(settings: Any, tasks: Sequence[Task], *extra: str) -> dict[str, Any]:
    """What a cell benchmark's rerun must share with the run it resumes: model, ``max_new_tokens``, the
    ``extra`` settings named, and the prompts.  No prompt at all is an error."""
    if not any(task.prompts for task in tasks):
        raise SpecDecodeError("the selected tasks have no prompts")
    return {
        "model": settings.model,
        "max_new_tokens": settings.max_new_tokens,
        **{name: getattr(settings, name) for name in extra},
        "prompts": prompt_fingerprint(tasks),
    }


def other_settings_error(
    path: Path, old: Fingerprint, new: Fingerprint, extra: Sequence[tuple[str, str]] = ()
) -> SpecDecodeError:
    """The one-line refusal to resume a run fingerprinted ``old`` (see :func:`run_fingerprint`) with ``new``;
    ``extra`` names the further settings compared, as (label, fingerprint key)."""
    was = [f"model {old.get('model')!r}", f"max_new_tokens {old.get('max_new_tokens')}"]
    was += [f"{label} {old.get(key)}" for label, key in extra]
    now = [repr(new["model"]), str(new["max_new_tokens"]), *(str(new[key]) for _, key in extra)]
    return SpecDecodeError(
        f"{path} holds results of other settings ({', '.join(was)}, {len(old.get('prompts', []))} prompts; now "
        f"{', '.join(now)}, {len(new['prompts'])}): choose another --out or empty it"
    )
