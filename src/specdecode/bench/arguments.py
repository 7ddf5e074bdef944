"""The flags of ``specdecode bench`` and its sub-commands: the ones they share are spelled, typed and explained
once here, and a sub-command declares its flags as ``{setting name: help text or Flag}``.

A sub-command's flags default to "not given" (``argparse.SUPPRESS``): a flag given to ``bench`` before the
sub-command (``bench --model M throughput``) is kept unless it is repeated after it.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

QUANTIZE_MODES = "{none,int8,int4,bf16,w4a8,auto}"
THREADS_HELP = "torch threads (default: SPECDECODE_THREADS, else the number of cores)"
#: ``--tasks`` of the benchmarks that send every prompt as a request of its own.
REQUESTS_TASKS_HELP = (
    "comma-separated tasks (default: all); every prompt, multi-edit's requests too, is an independent request"
)


class Flag:
    """One flag: ``option`` (default ``--`` and the setting's name with dashes), ``dest`` (default the setting's
    name) and the rest of ``argparse``'s ``add_argument`` keywords."""

    def __init__(self, option: str | None = None, *, dest: str | None = None, **options: Any) -> None:
        self.option = option
        self.dest = dest
        self.options = options

    def with_help(self, text: str) -> Flag:
        return Flag(self.option, dest=self.dest, **{**self.options, "help": text})


#: The flags several commands take, by setting name: each command gives its own help text (its defaults differ).
SHARED: dict[str, Flag] = {
    "model": Flag(),
    "methods": Flag(),
    "tasks": Flag(),
    "prompts_per_task": Flag(type=int, metavar="N"),
    "max_new_tokens": Flag(type=int, metavar="N"),
    "repeats": Flag(type=int, metavar="N"),
    "seed": Flag(type=int),
    "out": Flag(),
    "threads": Flag(type=int),
    "quantize": Flag(metavar=QUANTIZE_MODES),
    "quantize_draft": Flag(metavar=QUANTIZE_MODES),
    "progress": Flag("--no-progress", action="store_false"),
    "servers": Flag("--url", metavar="[LABEL=]URL,..."),  # other OpenAI-compatible servers measured beside ours
    "served_model": Flag(metavar="NAME"),
}


Arguments = Mapping[str, "str | Flag"]


def add_flags(parser: argparse.ArgumentParser, arguments: Arguments, keep_given: bool) -> list[str]:
    """Add ``arguments`` to ``parser`` in their order: a name of :data:`SHARED` with its help text, or any name
    with its :class:`Flag` (``help`` among its options).  ``keep_given``: a sub-command's flag defaults to
    "not given" (see the module's docstring) unless its Flag says otherwise.  Returns the destinations."""
    dests = []
    for name, spec in arguments.items():
        if isinstance(spec, str):
            spec = SHARED[name].with_help(spec)
        dest = spec.dest or name
        options = {"dest": dest, **spec.options}
        if keep_given:
            options.setdefault("default", argparse.SUPPRESS)
        parser.add_argument(spec.option or "--" + name.replace("_", "-"), **options)
        dests.append(dest)
    return list(dict.fromkeys(dests))
