"""A command's function named by its module, imported when the command runs.

A command's parser is declared in a light module (argparse and constants), so that ``specdecode --help`` and
``specdecode CMD --help`` answer at once; the function that runs it lives with the code it drives, which
imports torch and transformers (seconds).  ``parser.set_defaults(run=Deferred("package.module:function"))``
joins the two without importing that module until the command runs.
"""

from __future__ import annotations

import argparse
import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Deferred:
    """The command function ``target`` ("package.module:function"), imported when called with the parsed
    arguments."""

    target: str

    def function(self):
        module, _, name = self.target.partition(":")
        return getattr(importlib.import_module(module), name)

    def __call__(self, args: argparse.Namespace) -> int:
        return self.function()(args)
