"""The ``longctx`` task: prompts of a chosen number of tokens (``longctx-4096``, ``longctx-8192``, ...) — long code
with an edit request, long documentation with a question — where speculation must stay fast as the context grows.

The text is the standard library's, from the parts no other task and no training text draws: IDLE's and lib2to3's
source (the grounded tasks skip those directories, see :data:`specdecode.data.grounded._SKIP_DIRS`) and the
language reference's topics that ``pydoc`` ships (``pydoc_data``).  So a head trained with ``specdecode train`` has
never seen a ``longctx`` document.  Like the grounded tasks, the prompts depend on the interpreter's stdlib version.

Token counts depend on the tokenizer, so a prompt is written longer than asked — :data:`CHARS_PER_TOKEN` characters
of document per token, more than any BPE tokenizer's average on code or English — and :func:`fit_prompt` cuts its
document at a line end to the requested count with the target's own tokenizer (and to the target's window), when
the benchmark encodes it.  What the request asks about lies in the document's first :data:`ASKED_WITHIN_CHARS`
characters, so it survives every cut down to :data:`MIN_CONTEXT_TOKENS`.
"""

from __future__ import annotations

import ast
import re
import sysconfig
import textwrap
import zlib
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path

from specdecode.data.grounded import Definition, edit_instructions, is_clean_source
from specdecode.data.prompts import Prompt
from specdecode.errors import SpecDecodeError

LONG_CONTEXT_TASK = "longctx"
#: The lengths ``longctx`` alone stands for.
DEFAULT_CONTEXT_TOKENS = (4096, 8192)
MIN_CONTEXT_TOKENS = 2048
MAX_CONTEXT_TOKENS = 131072
#: Document characters written per requested token.  SmolLM2's tokenizer averages 3.9 characters per token on
#: IDLE's source and 4.1 on the language reference; 6 leaves room for tokenizers with larger vocabularies, so
#: fitting to the tokenizer only ever cuts.
CHARS_PER_TOKEN = 6
#: The definition or section a prompt asks about ends within the document's first characters: at 2 or more
#: characters per token (BPE tokenizers on code and English) it stays in a prompt cut to MIN_CONTEXT_TOKENS.
ASKED_WITHIN_CHARS = 3500
#: Packages whose modules make up the code documents (those this interpreter has: 3.13 dropped lib2to3).
CODE_PACKAGES = ("idlelib", "lib2to3")
_TASK_NAME = re.compile(rf"{LONG_CONTEXT_TASK}-(\d+)")


def context_tokens_of(task: str) -> int | None:
    """``longctx-4096`` → 4096; None for any other task name.  A length out of range is refused."""
    match = _TASK_NAME.fullmatch(task)
    if match is None:
        return None
    return check_context_tokens(int(match.group(1)), task)


def check_context_tokens(tokens: int, label: str) -> int:
    if not MIN_CONTEXT_TOKENS <= tokens <= MAX_CONTEXT_TOKENS:
        raise SpecDecodeError(
            f"{label}: a long-context prompt takes {MIN_CONTEXT_TOKENS} to {MAX_CONTEXT_TOKENS} tokens, got {tokens}"
        )
    return tokens


def task_name(tokens: int) -> str:
    return f"{LONG_CONTEXT_TASK}-{check_context_tokens(tokens, LONG_CONTEXT_TASK)}"


def expand(names: Iterable[str], context_tokens: Iterable[int] = DEFAULT_CONTEXT_TOKENS) -> tuple[str, ...]:
    """Task names with ``longctx`` replaced by one ``longctx-N`` per length of ``context_tokens``."""
    lengths = tuple(context_tokens)
    expanded = ((task_name(tokens) for tokens in lengths) if name == LONG_CONTEXT_TASK else (name,) for name in names)
    return tuple(dict.fromkeys(name for names_of in expanded for name in names_of))


# --------------------------------------------------------------------------------------------------------
# The sources


def _code_files() -> list[tuple[str, str]]:
    """(path relative to the stdlib, source) of every module of :data:`CODE_PACKAGES`, tests left out, in order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for package in CODE_PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            relative = path.relative_to(root)
            if any(part in {"idle_test", "tests", "__pycache__"} for part in relative.parts):
                continue
            try:
                found.append((relative.as_posix(), path.read_text(encoding="utf-8")))
            except (OSError, UnicodeDecodeError):
                continue
    return found


def _topics() -> list[tuple[str, str]]:
    """(key, text) of the language reference's topics, in key order; none without ``pydoc_data``."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return []
    return sorted((key, text.strip()) for key, text in topics.items() if isinstance(text, str) and text.strip())


def _following(items: list[tuple[str, str]], start: int, separator: Callable[[str], str], chars: int) -> str:
    """Item ``start`` and the ones after it (wrapping around), each after its ``separator``, cut at the last line
    end within ``chars`` characters."""
    parts, used = [], 0
    for offset in range(len(items)):
        name, text = items[(start + offset) % len(items)]
        parts.append(separator(name) + text.rstrip() + "\n")
        used += len(parts[-1]) + 1
        if used >= chars:
            break
    document = "\n".join(parts)
    return document if len(document) <= chars else document[: document.rindex("\n", 0, chars) + 1]


def _function_definitions(path: str, source: str) -> list[tuple[int, Definition]]:
    """(character offset of its end in ``source``, definition) of every function and method of a module."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines = source.split("\n")
    line_ends = [0]
    for line in lines:
        line_ends.append(line_ends[-1] + len(line) + 1)
    module = path.removesuffix(".py").replace("/", ".")
    found = []

    def visit(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                visit(node.body, f"{prefix}{node.name}.")
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                start = min([d.lineno for d in node.decorator_list] + [node.lineno]) - 1
                text = textwrap.dedent("\n".join(lines[start : node.end_lineno])).rstrip()
                arguments = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                definition = Definition(
                    module,
                    prefix + node.name,
                    "function",
                    ast.get_docstring(node) or "",
                    text,
                    "",
                    tuple(a.arg for a in arguments if a.arg not in ("self", "cls")),
                    node.returns is not None or any(a.annotation is not None for a in arguments),
                )
                found.append((line_ends[node.end_lineno or node.lineno], definition))

    visit(tree.body, "")
    return found


# --------------------------------------------------------------------------------------------------------
# The prompts


def _code_prompts(tokens: int) -> list[Prompt]:
    """One per module with a function to edit near its start: that module and the ones after it in its package."""
    files = _code_files()
    prompts = []
    for index, (path, source) in enumerate(files):
        header = f"# File: {path}\n"
        candidates = [
            (definition, options)
            for end, definition in _function_definitions(path, source)
            if len(header) + end <= ASKED_WITHIN_CHARS
            and is_clean_source(definition.source)
            and len(definition.source) >= 200
            and (options := edit_instructions(definition))
        ]
        if not candidates:
            continue
        # The last such function: the longest stretch of the file before it; its edit chosen by a stable hash.
        definition, options = candidates[-1]
        kinds = sorted(options)
        kind = kinds[zlib.crc32(definition.name.encode()) % len(kinds)]
        document = _following(files, index, lambda name: f"# File: {name}\n", tokens * CHARS_PER_TOKEN)
        text = (
            f"Here are modules of the Python standard library, one file after another:\n\n```python\n{document}```\n\n"
            f"In the file `{path}` above, take the function `{definition.qualname}`. {options[kind]} Change "
            "nothing else and reply with the complete edited function in one Python code block."
        )
        prompt_id = f"{task_name(tokens)}/code/{definition.name}#{kind}"
        prompts.append(Prompt(prompt_id, text, True, document, context_tokens=tokens))
    return prompts


_QUESTIONS = {
    "summarize": 'Summarize what the section "{title}" says, in one paragraph.',
    "quote": 'Quote the first paragraph of the section "{title}" word for word, then explain it in one sentence.',
}


def _document_prompts(tokens: int) -> list[Prompt]:
    """One per short topic of the language reference: that topic and the ones after it."""
    topics = _topics()
    prompts = []
    for index, (key, topic) in enumerate(topics):
        title = topic.split("\n", 1)[0].strip()
        if len(topic) + 200 > ASKED_WITHIN_CHARS or not title:
            continue
        kinds = sorted(_QUESTIONS)
        kind = kinds[zlib.crc32(key.encode()) % len(kinds)]
        document = _following(topics, index, lambda name: "", tokens * CHARS_PER_TOKEN)
        text = (
            "Here are sections of the Python language reference:\n\n"
            f"{document}\n\nAnswer from these sections only. {_QUESTIONS[kind].format(title=title)}"
        )
        prompt_id = f"{task_name(tokens)}/document/{key}#{kind}"
        prompts.append(Prompt(prompt_id, text, True, document, context_tokens=tokens))
    return prompts


def long_context_pool(tokens: int) -> dict[str, list[Prompt]]:
    """The prompts of ``longctx-<tokens>`` by kind (code, document), before fitting to a tokenizer."""
    groups = {"code": _code_prompts(tokens), "document": _document_prompts(tokens)}
    groups = {kind: prompts for kind, prompts in groups.items() if prompts}
    if not groups:
        raise SpecDecodeError(
            f"the {LONG_CONTEXT_TASK} task needs the standard library's {' or '.join(CODE_PACKAGES)} or pydoc_data, "
            "which this Python lacks"
        )
    return groups


# --------------------------------------------------------------------------------------------------------
# Fitting to a tokenizer


def fit_prompt(prompt: Prompt, count_tokens: Callable[[str], int], budget: int) -> Prompt:
    """``prompt`` with its document cut after the most lines for which ``count_tokens(text) <= budget`` (binary
    search: token counts grow with the lines kept); unchanged if it fits.  Refused when the cut would leave less
    than :data:`ASKED_WITHIN_CHARS` characters of document (what the request asks about may be gone)."""
    if count_tokens(prompt.text) <= budget:
        return prompt
    head, found, tail = prompt.text.partition(prompt.document)
    if not found:
        raise ValueError(f"prompt {prompt.id}: its text does not contain its document")
    lines = prompt.document.splitlines(keepends=True)

    def text_with(kept: int) -> str:
        return head + "".join(lines[:kept]) + tail

    low, high = 0, len(lines) - 1  # the answer lies in [low, high]: low lines fit (or none do)
    while low < high:
        middle = (low + high + 1) // 2
        if count_tokens(text_with(middle)) <= budget:
            low = middle
        else:
            high = middle - 1
    document = "".join(lines[:low])
    if len(document) < ASKED_WITHIN_CHARS:
        raise SpecDecodeError(
            f"prompt {prompt.id} must be cut to {budget} tokens, too few to keep what it asks about: a long-context "
            f"prompt needs at least {MIN_CONTEXT_TOKENS} tokens of the model's context"
        )
    return replace(prompt, text=text_with(low), document=document)
