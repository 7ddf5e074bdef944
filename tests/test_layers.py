"""The package's imports point one way: down the layers declared here, with no circle between its parts.

Every ``specdecode`` import of every module under ``src/specdecode`` counts, wherever it is written: at
module level, inside a function (imported when it runs) and under ``if TYPE_CHECKING:`` (a type is a
dependency too), and so does a command's function named for :class:`specdecode.deferred.Deferred`, which the
command line imports when that command runs.  A *part* is a sub-package (``models``, ``drafters``, ...) or a
top-level module (``config``, ``engine``, ...); the package's own ``__init__`` is the part ``specdecode``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

import pytest

PACKAGE = "specdecode"
SOURCE = Path(__file__).resolve().parents[1] / "src" / PACKAGE

#: The parts, lowest layer first.  A part may import from its own layer or any layer below, never above.
LAYERS: tuple[tuple[str, frozenset[str]], ...] = (
    # What everything may use: errors, plain types, clocks, the machine's description, thread control, and the
    # helper that names a command's function without importing it; the sampling settings and the typed value of a
    # ``KEY=VALUE`` option.
    (
        "base",
        frozenset(
            {"errors", "types", "clock", "machine", "verbosity", "estimators", "threads", "deferred"}
            | {"sampling_params", "options", "declarations", "constraints"}
        ),
    ),
    ("models", frozenset({"models"})),  # loading and running the target and draft models
    ("heads", frozenset({"heads"})),  # trained draft heads' networks and files
    # Logits to the distribution a token is drawn from, a constraint's grammar masking them.
    ("sampling", frozenset({"sampling", "logits_processing", "grammar"})),
    ("verification", frozenset({"verify"})),  # which drafted tokens to accept
    ("settings", frozenset({"config"})),  # what a generation asks for, its verifier parsed by the registry
    ("draft length", frozenset({"draft_length"})),  # how many tokens to draft: the policies for config's value
    ("data", frozenset({"data"})),  # prompt sets, data sets and corpora
    ("drafters", frozenset({"drafters"})),
    # Our drafters inside other serving engines (vLLM's custom proposer): only those engines import it.
    ("integrations", frozenset({"integrations"})),
    # The decoding loop, single and batched, its statistics and the Python API over it.
    (
        "engine",
        frozenset({"engine", "batch_plan", "prefix_cache", "batch_engine", "stats", "generator", "api", PACKAGE})
        | {"remote_target"},
    ),
    # The command line: each command's flags and what runs it.
    ("commands", frozenset({"decode_flags", "decode_commands", "train"})),
    ("server", frozenset({"server"})),  # `specdecode serve` loads models as `generate` does
    ("benchmark", frozenset({"bench"})),  # `bench serve` measures the server
    ("entry", frozenset({"cli", "__main__"})),
)

#: The one import of the benchmark from outside it: the command line adds the ``bench`` command's parser.
BENCH_ENTRY = ("specdecode.cli", "specdecode.bench.cli")

#: Parts that the library below the command line must never import.
COMMAND_PARTS = frozenset({"server", "bench", "train", "cli", "decode_commands", "decode_flags"})
LIBRARY_PARTS = frozenset({"models", "verify", "drafters", "data", "integrations"})


def module_name(path: Path, source: Path = SOURCE) -> str:
    parts = [source.name, *path.relative_to(source).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def part_of(module: str) -> str:
    """``specdecode.models.hf`` -> ``models``; ``specdecode.config`` -> ``config``; ``specdecode`` -> itself."""
    names = module.split(".")
    return names[1] if len(names) > 1 else names[0]


def imported_modules(tree: ast.Module, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The ``specdecode`` modules ``tree`` (the source of ``module``) imports anywhere in its body, relative
    imports resolved; ``from package import name`` counts as importing ``package.name`` when that is a module."""
    found = set()
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            found.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names)
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Deferred" and node.args:
            target = node.args[0]
            if isinstance(target, ast.Constant) and isinstance(target.value, str):
                found.add(target.value.partition(":")[0])
    return {name for name in found if name == PACKAGE or name.startswith(PACKAGE + ".")}


def import_graph(source: Path = SOURCE) -> set[tuple[str, str]]:
    """Every (importer, imported) pair of modules of the package under ``source``."""
    paths = sorted(source.rglob("*.py"))
    known = {module_name(path, source) for path in paths}
    arrows = set()
    for path in paths:
        module = module_name(path, source)
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for imported in imported_modules(tree, module, path.name == "__init__.py", known):
            if imported != module:
                arrows.add((module, imported))
    return arrows


def layer_index(layers: Iterable[tuple[str, frozenset[str]]] = LAYERS) -> dict[str, int]:
    return {part: index for index, (_, parts) in enumerate(layers) for part in parts}


def upward_arrows(arrows: Iterable[tuple[str, str]], layers=LAYERS) -> list[str]:
    """Each import from a part to a part of a higher layer, as ``importer -> imported (layer -> layer)``."""
    index = layer_index(layers)
    names = [name for name, _ in layers]
    found = []
    for importer, imported in sorted(arrows):
        low, high = index[part_of(importer)], index[part_of(imported)]
        if high > low:
            found.append(f"{importer} -> {imported} ({names[low]} -> {names[high]})")
    return found


def part_circles(arrows: Iterable[tuple[str, str]]) -> list[list[str]]:
    """The circles between parts: each group of two or more parts that reach one another (Tarjan's strongly
    connected components), sorted."""
    edges: dict[str, set[str]] = {}
    for importer, imported in arrows:
        a, b = part_of(importer), part_of(imported)
        edges.setdefault(a, set())
        edges.setdefault(b, set())
        if a != b:
            edges[a].add(b)
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []

    def visit(node: str) -> None:
        order[node] = low[node] = len(order)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges[node]):
            if nxt not in order:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], order[nxt])
        if low[node] == order[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                circles.append(sorted(group))

    for node in sorted(edges):
        if node not in order:
            visit(node)
    return sorted(circles)


@pytest.fixture(scope="module")
def arrows() -> set[tuple[str, str]]:
    return import_graph()


def test_every_part_has_a_layer(arrows):
    parts = {part_of(module_name(path)) for path in SOURCE.rglob("*.py")}
    assert parts - set(layer_index()) == set(), "declare the new part's layer in LAYERS"


def test_no_import_points_up_a_layer(arrows):
    found = upward_arrows(arrows)
    assert not found, "\n".join(found)


def test_no_circle_between_parts(arrows):
    circles = part_circles(arrows)
    assert not circles, "\n".join(" <-> ".join(circle) for circle in circles)


def test_only_the_command_line_reaches_into_the_benchmark(arrows):
    outside = {
        (importer, imported)
        for importer, imported in arrows - {BENCH_ENTRY}
        if part_of(imported) == "bench" and part_of(importer) != "bench"
    }
    assert outside == set()


def test_nothing_of_ours_imports_the_integrations(arrows):
    """They run inside another engine's process, and what they import must load there (no transformers)."""
    assert {(a, b) for a, b in arrows if part_of(b) == "integrations" and part_of(a) != "integrations"} == set()


def test_the_library_imports_no_command(arrows):
    found = {
        (importer, imported)
        for importer, imported in arrows
        if part_of(importer) in LIBRARY_PARTS and part_of(imported) in COMMAND_PARTS
    }
    assert found == set()


# -- the checks themselves can fail ------------------------------------------------------------------------------


def test_a_function_local_import_an_import_under_type_checking_and_a_deferred_command_all_count(tmp_path):
    package = tmp_path / PACKAGE
    (package / "models").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "models" / "__init__.py").write_text("")
    (package / "models" / "hf.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from specdecode.drafters import Drafter\n"
        "def load():\n"
        "    from ..engine import step\n"
        "    from specdecode import cli\n"
        "    return Deferred('specdecode.bench.cli:run')\n"
    )
    (package / "cli.py").write_text("")
    arrows = import_graph(package)
    assert arrows == {
        ("specdecode.models.hf", "specdecode.drafters"),
        ("specdecode.models.hf", "specdecode.engine"),
        ("specdecode.models.hf", "specdecode.cli"),
        ("specdecode.models.hf", "specdecode.bench.cli"),
    }
    assert len(upward_arrows(arrows)) == 4


def test_an_upward_arrow_and_a_circle_are_reported():
    arrows = {
        ("specdecode.drafters.pld", "specdecode.models.base"),  # down: fine
        ("specdecode.models.hf", "specdecode.drafters.base"),  # up
    }
    assert upward_arrows(arrows) == ["specdecode.models.hf -> specdecode.drafters.base (models -> drafters)"]
    assert part_circles(arrows) == [["drafters", "models"]]
    same_layer = {
        ("specdecode.engine", "specdecode.stats"),
        ("specdecode.stats", "specdecode.engine"),
    }
    assert upward_arrows(same_layer) == [] and part_circles(same_layer) == [["engine", "stats"]]
