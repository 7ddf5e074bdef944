"""Input-grounded tasks built from the Python standard library's own source, which every machine has (no
download): ``summarize``, ``rag``, ``edit`` and the session task ``multi-edit``; and ``complete``, whose answers
copy from a code base the prompt does not contain.  They depend on the
interpreter's stdlib version, so compare runs on the same Python."""

from __future__ import annotations

import ast
import functools
import os
import re
import sysconfig
import textwrap
import zlib
from dataclasses import dataclass
from pathlib import Path

from specdecode.data.prompts import Prompt

# Grounded prompts stay under ~1500 tokens of a typical BPE tokenizer.
MAX_GROUNDED_CHARS = 5000

# --------------------------------------------------------------------------------------------------------
# Input-grounded tasks from the Python standard library's source

# Test suites, bundled third-party code, GUI demos and generated tables are not representative documents.
_SKIP_DIRS = frozenset(
    {
        "site-packages",
        "dist-packages",
        "test",
        "tests",
        "idle_test",
        "idlelib",
        "turtledemo",
        "lib2to3",
        "ensurepip",
        "encodings",
        "pydoc_data",
        "__pycache__",
    }
)


@dataclass(frozen=True)
class Definition:
    """A module, class or function of the stdlib, with the text the grounded tasks need."""

    module: str
    qualname: str  # "" for the module itself
    kind: str  # "module", "class" or "function"
    docstring: str
    source: str  # dedented source including decorators ("" for modules)
    context: str  # source of the definition and its neighbours in the same body, for RAG documents
    params: tuple[str, ...] = ()
    annotated: bool = False
    raises: bool = False  # has an explicit ``raise SomeError`` statement

    @property
    def name(self) -> str:
        return f"{self.module}.{self.qualname}" if self.qualname else self.module


def _stdlib_files() -> list[tuple[str, Path]]:
    """(module name, path) of the stdlib's Python files, in a file-system-independent order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in _SKIP_DIRS and not d.startswith("config-")]
        for filename in files:
            if filename.endswith(".py"):
                path = Path(directory, filename)
                parts = path.relative_to(root).with_suffix("").parts
                module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
                found.append((module, path))
    return sorted(found)


# Walking every function's AST for ``raise`` costs seconds over the stdlib; a regex costs nothing, and
# counting a nested def's raise is close enough.
_RAISE = re.compile(r"^\s*raise\s+[A-Za-z_]", re.MULTILINE)


def _segment(lines: list[str], node: ast.AST) -> str:
    start = min([d.lineno for d in getattr(node, "decorator_list", [])] + [node.lineno]) - 1
    return textwrap.dedent("\n".join(lines[start : node.end_lineno])).rstrip()


def _neighbourhood(sources: list[str], index: int, budget: int) -> str:
    """The definition at ``index`` plus as many adjacent ones as fit in ``budget`` characters."""
    low = high = index
    used = len(sources[index])
    grew = True
    while grew:
        grew = False
        if low > 0 and used + len(sources[low - 1]) + 2 <= budget:
            low -= 1
            used += len(sources[low]) + 2
            grew = True
        if high + 1 < len(sources) and used + len(sources[high + 1]) + 2 <= budget:
            high += 1
            used += len(sources[high]) + 2
            grew = True
    return "\n\n".join(sources[low : high + 1])


def _definitions_in(module: str, source: str) -> list[Definition]:
    tree = ast.parse(source)
    # Split on "\n" only, as ast counts lines (str.splitlines also splits on form feeds and the like).
    lines = source.split("\n")
    found = [Definition(module, "", "module", ast.get_docstring(tree) or "", "", "")]

    def visit(body: list[ast.stmt], prefix: str) -> None:
        nodes = [n for n in body if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
        sources = [_segment(lines, n) for n in nodes]
        for index, node in enumerate(nodes):
            qualname = prefix + node.name
            docstring = ast.get_docstring(node) or ""
            if isinstance(node, ast.ClassDef):
                found.append(Definition(module, qualname, "class", docstring, sources[index], ""))
                visit(node.body, qualname + ".")
                continue
            arguments = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
            params = tuple(a.arg for a in arguments if a.arg not in ("self", "cls"))
            annotated = node.returns is not None or any(a.annotation is not None for a in arguments)
            context = _neighbourhood(sources, index, MAX_GROUNDED_CHARS - 800)
            found.append(
                Definition(
                    module,
                    qualname,
                    "function",
                    docstring,
                    sources[index],
                    context,
                    params,
                    annotated,
                    _RAISE.search(sources[index]) is not None,
                )
            )

    visit(tree.body, "")
    return found


@functools.cache
def _stdlib_definitions() -> tuple[Definition, ...]:
    found: list[Definition] = []
    seen: set[str] = set()
    for module, path in _stdlib_files():
        try:
            definitions = _definitions_in(module, path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for definition in definitions:
            # Conditional definitions (``if sys.platform ...: def f``) repeat a name: keep the first.
            if definition.name not in seen:
                seen.add(definition.name)
                found.append(definition)
    return tuple(found)


def is_clean_source(source: str) -> bool:
    """Dedented cleanly (a multi-line string at column 0 can block ``textwrap.dedent``)."""
    return bool(source) and not source[0].isspace()


def summarize_pool() -> dict[str, list[Prompt]]:
    groups: dict[str, list[Prompt]] = {}
    for d in _stdlib_definitions():
        if not 1000 <= len(d.docstring) <= MAX_GROUNDED_CHARS - 300:
            continue
        text = (
            f"Summarize the following documentation of the Python {d.kind} `{d.name}` in one short paragraph."
            f"\n\n{d.docstring}"
        )
        groups.setdefault(d.kind, []).append(Prompt(f"summarize/{d.name}", text, True, d.docstring))
    return groups


_RAG_QUESTIONS = {
    "returns": "What does the {what} `{name}` return?",
    "raises": "Which exceptions can the {what} `{name}` raise, and when?",
}


def rag_pool() -> dict[str, list[Prompt]]:
    groups: dict[str, list[Prompt]] = {}
    for d in _stdlib_definitions():
        short_name = d.qualname.rsplit(".", 1)[-1]
        # Questions about private helpers and dunders are not what users ask about a document.
        if d.kind != "function" or short_name.startswith("_") or not is_clean_source(d.context):
            continue
        if not 200 <= len(d.source) <= 3000:
            continue
        kinds = []
        if re.search(r"\breturn", d.docstring, re.IGNORECASE):
            kinds.append("returns")
        if d.raises:
            kinds.append("raises")
        # The excerpt holds the function and its siblings, so a method is named by its class up front.
        owner, _, _ = d.qualname.rpartition(".")
        source = f"the class `{d.module}.{owner}`" if owner else f"the module `{d.module}`"
        what = "method" if owner else "function"
        for kind in kinds:
            question = _RAG_QUESTIONS[kind].format(what=what, name=short_name)
            text = (
                f"Here is an excerpt from {source} of the Python standard library:\n\n"
                f"```python\n{d.context}\n```\n\nAnswer from the excerpt only. {question}"
            )
            groups.setdefault(kind, []).append(Prompt(f"rag/{d.name}#{kind}", text, True, d.context))
    return groups


def edit_instructions(d: Definition) -> dict[str, str]:
    """The edits that make sense for this function, by kind."""
    options = {}
    if not d.docstring:
        options["docstring"] = "Add a docstring to this function that explains its parameters and result."
    if not d.annotated and d.params:
        options["type-hints"] = "Add type hints to the parameters and the return value of this function."
    renamable = [p for p in d.params if len(p) > 1 and len(re.findall(rf"\b{re.escape(p)}\b", d.source)) >= 3]
    if renamable:
        old = renamable[0]
        options["rename"] = f"Rename the parameter `{old}` to `new_{old}` throughout this function."
    return options


def edit_pool() -> dict[str, list[Prompt]]:
    groups: dict[str, list[Prompt]] = {}
    for d in _stdlib_definitions():
        if d.kind != "function" or not is_clean_source(d.source) or not 300 <= len(d.source) <= 3000:
            continue
        options = edit_instructions(d)
        if not options:
            continue
        # One edit per function, chosen by a stable hash so that every function of the pool stays distinct.
        kinds = sorted(options)
        kind = kinds[zlib.crc32(d.name.encode()) % len(kinds)]
        text = (
            f"{options[kind]} Change nothing else and reply with the complete edited function in one Python "
            f"code block.\n\n```python\n{d.source}\n```"
        )
        groups.setdefault(kind, []).append(Prompt(f"edit/{d.name}", text, True, d.source))
    return groups


# Requests of a ``multi-edit`` session, in order.  Each request repeats the earlier instructions and adds
# one — a user refining what they asked for — so each answer repeats most of the previous answer: the
# setting where a drafter that remembers its earlier outputs (``suffix``) should beat prompt lookup.
MULTI_EDIT_STEPS = ("rename", "type-hints", "docstring")
MULTI_EDIT_SOURCE_CHARS = (400, 1400)  # short: 96 new tokens should reach well into the edited body


def multi_edit_pool() -> dict[str, list[Prompt]]:
    low, high = MULTI_EDIT_SOURCE_CHARS
    groups: dict[str, list[Prompt]] = {}
    for d in _stdlib_definitions():
        if d.kind != "function" or not is_clean_source(d.source) or not low <= len(d.source) <= high:
            continue
        options = edit_instructions(d)
        if not set(MULTI_EDIT_STEPS) <= set(options):
            continue
        session = f"multi-edit/{d.name}"
        for step in range(1, len(MULTI_EDIT_STEPS) + 1):
            asked = " ".join(options[kind] for kind in MULTI_EDIT_STEPS[:step])
            text = (
                f"{asked} Change nothing else and reply with the complete edited function in one Python code "
                f"block.\n\n```python\n{d.source}\n```"
            )
            groups.setdefault("", []).append(Prompt(f"{session}#{step}", text, True, d.source, session))
    return groups


# A code-completion task against a code base the prompt does not contain: the answers copy from the corpus
# (``specdecode bench --tasks complete --methods ...,rasd:datastore=<stdlib>/asyncio``), which only a drafter
# that retrieves from it can draft from.
COMPLETE_PACKAGE = "asyncio"
COMPLETE_SOURCE_CHARS = (300, 2000)


def _header(source: str) -> str:
    """A function's decorators, signature and docstring: its source up to the end of the docstring."""
    function = ast.parse(source).body[0]
    docstring = function.body[0]  # type: ignore[attr-defined]
    return "\n".join(source.split("\n")[: docstring.end_lineno])


def complete_pool() -> dict[str, list[Prompt]]:
    low, high = COMPLETE_SOURCE_CHARS
    groups: dict[str, list[Prompt]] = {}
    for d in _stdlib_definitions():
        if d.kind != "function" or not d.docstring or not is_clean_source(d.source) or not low <= len(d.source) <= high:
            continue
        if d.module.split(".")[0] != COMPLETE_PACKAGE:
            continue
        owner, _, _ = d.qualname.rpartition(".")
        where = f"the class `{d.module}.{owner}`" if owner else f"the module `{d.module}`"
        text = (
            f"Complete this function of {where} of the Python standard library: write its body as the standard "
            f"library does. Reply with the complete function in one Python code block.\n\n"
            f"```python\n{_header(d.source)}\n```"
        )
        groups.setdefault("method" if owner else "function", []).append(
            Prompt(f"complete/{d.name}", text, False, d.source)
        )
    return groups
