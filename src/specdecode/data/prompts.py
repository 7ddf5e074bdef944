"""A benchmark prompt and a task (a named, seeded selection of prompts): the types every task source and
every benchmark share."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Prompt:
    """One user message.  ``document`` is the given text a grounded answer should copy from; ``session``
    names the session a request of a session task belongs to (its requests are listed in order);
    ``context_tokens``, of a long-context prompt, the tokens it is cut to (its document shortened) for a
    tokenizer (:func:`specdecode.data.long_context.fit_prompt`), 0 for a prompt used as written."""

    id: str
    text: str
    grounded: bool = False
    document: str = ""
    session: str = ""
    context_tokens: int = 0


@dataclass(frozen=True)
class Task:
    name: str
    category: str
    prompts: list[Prompt] = field(default_factory=list)

    def sessions(self) -> list[list[Prompt]]:
        """The prompts in groups that must run in order on one drafter: a session task's sessions, or
        one group per prompt."""
        groups: dict[str, list[Prompt]] = {}
        for prompt in self.prompts:
            groups.setdefault(prompt.session or prompt.id, []).append(prompt)
        return list(groups.values())
