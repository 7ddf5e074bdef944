"""What a ``specdecode bench`` command is, and the registry of its sub-commands.

A :class:`Benchmark` declares its flags (:mod:`specdecode.bench.arguments`), resolves them into checked
settings, measures (writing its results into ``settings.out``) and reports.  Every module of
:mod:`specdecode.bench.commands` is imported on first use, so a new sub-command is one new file there with a
``@register_benchmark`` class — nothing else changes.

Those modules are imported to build the parser (``specdecode bench --help`` among others), which must not
load torch: a benchmark names the module that measures (``module``), imported only when the command runs.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
import time
from collections.abc import Mapping
from types import ModuleType
from typing import Any, ClassVar

from specdecode.bench.arguments import Arguments, add_flags

_REGISTRY: dict[str, type[Benchmark]] = {}
_DISCOVERED = False


class Benchmark:
    """One command, in four steps: its flags (:meth:`arguments`), :meth:`resolve` them into checked settings,
    :meth:`measure` (leaving ``results.md`` in the settings' ``out`` directory), :meth:`report`.  A subclass
    sets the class attributes, :meth:`arguments` and :meth:`measure`; the default :meth:`resolve` is the
    ``resolve_settings(**given)`` of its ``module``."""

    name: ClassVar[str]  # the sub-command
    help: ClassVar[str]  # its line in ``specdecode bench --help``
    description: ClassVar[str] = ""
    files: ClassVar[str] = "results.json, results.md"  # what it writes, as the closing line says
    module: ClassVar[str] = ""  # the module that measures, imported when the command runs
    #: Settings a sub-command takes from ``bench``'s own flags (given before it) without a flag of its own.
    from_bench: ClassVar[tuple[str, ...]] = ()

    label: ClassVar[str]  # how progress and messages name the command: default "bench NAME"
    entry: ClassVar[str]  # the name of the function a parsed command line runs (``args.run``): default "run_NAME"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        name = getattr(cls, "name", "")
        cls.label = cls.__dict__.get("label", f"bench {name}")
        cls.entry = cls.__dict__.get("entry", "run_" + name.replace("-", "_"))

    def arguments(self) -> Arguments:
        """The flags, by setting name: a help text for a flag of :data:`~specdecode.bench.arguments.SHARED`, else
        a :class:`~specdecode.bench.arguments.Flag`."""
        raise NotImplementedError

    @property
    def implementation(self) -> ModuleType:
        return importlib.import_module(self.module)

    def resolve(self, given: dict[str, Any]) -> Any:
        """The checked settings from the flags ``given`` (None: not given); a bad one is a one-line error."""
        return self.implementation.resolve_settings(**given)

    def measure(self, settings: Any, progress: bool) -> Any:
        """Measure what ``settings.out`` does not hold yet and write the results there; ``progress``: show it."""
        raise NotImplementedError

    def report(self, settings: Any, seconds: float) -> None:
        """Print results.md, and say on stderr what was written and how long it took."""
        print((settings.out / "results.md").read_text())
        print(f"[{self.label}] wrote {settings.out}/ ({self.files}) in {seconds / 60:.1f} min", file=sys.stderr)

    def run(self, given: dict[str, Any], progress: bool) -> int:
        """The command: resolve the flags ``given``, measure, report."""
        settings = self.resolve(given)
        started = time.perf_counter()
        self.measure(settings, progress)
        self.report(settings, time.perf_counter() - started)
        return 0

    def add_to(self, parser: argparse.ArgumentParser, keep_given: bool = True) -> None:
        """Add the flags to ``parser`` and make it run this benchmark (see :func:`add_flags` for ``keep_given``)."""
        names = [*add_flags(parser, self.arguments(), keep_given), *self.from_bench]

        def run(args: argparse.Namespace) -> int:
            given = {name: getattr(args, name, None) for name in names if name != "progress"}
            return self.run(given, getattr(args, "progress", True))

        run.__name__ = run.__qualname__ = self.entry
        parser.set_defaults(run=run)


def register_benchmark(cls: type[Benchmark]) -> type[Benchmark]:
    """Class decorator: make a benchmark a sub-command of ``specdecode bench`` under its ``name``."""
    if _REGISTRY.get(cls.name, cls) is not cls:
        raise ValueError(f"benchmark name {cls.name!r} registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def benchmarks() -> Mapping[str, type[Benchmark]]:
    """Every registered sub-command by name, in name order."""
    global _DISCOVERED
    if not _DISCOVERED:
        package = importlib.import_module("specdecode.bench.commands")
        for module in pkgutil.iter_modules(package.__path__):
            importlib.import_module(f"{package.__name__}.{module.name}")
        _DISCOVERED = True
    return dict(sorted(_REGISTRY.items()))
