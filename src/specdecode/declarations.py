"""What a registry's classes declare, read from their source without importing it.

``specdecode drafters`` and ``specdecode verifiers`` list what registers itself with a decorator
(``@register_drafter("pld")``, ``@register_verifier("fly", lossless=False)``), but the modules that hold those
classes import torch and transformers: seconds spent for a listing.  So the listings read the decorators' constant
arguments and the classes' docstrings from the files, the same declarations the registries import.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Declaration:
    """One class decorated ``@DECORATOR(args..., keyword=...)``: the decorator's constant arguments and the first line
    of the class's docstring (``summary``) and of its module's (``module_summary``), each "" where there is none."""

    args: tuple[Any, ...]
    keywords: dict[str, Any]
    summary: str
    module_summary: str


def declarations(paths: Iterable[Path], decorator: str) -> list[Declaration]:
    """Every top-level class of the files ``paths`` decorated with a call of ``decorator`` whose arguments are all
    constants, in file order."""
    found = []
    for path in paths:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in tree.body:
            for call in getattr(node, "decorator_list", []):
                if not isinstance(call, ast.Call) or getattr(call.func, "id", None) != decorator:
                    continue
                values = [*call.args, *(keyword.value for keyword in call.keywords)]
                if all(isinstance(value, ast.Constant) for value in values):
                    found.append(
                        Declaration(
                            tuple(arg.value for arg in call.args),  # type: ignore[attr-defined]
                            {keyword.arg: keyword.value.value for keyword in call.keywords if keyword.arg},  # type: ignore[attr-defined]
                            _first_line(ast.get_docstring(node)),
                            _first_line(ast.get_docstring(tree)),
                        )
                    )
    return found


def _first_line(doc: str | None) -> str:
    doc = (doc or "").strip()
    return doc.splitlines()[0] if doc else ""
