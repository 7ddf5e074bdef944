"""The ``specdecode`` command line: generate, batch, demo, models, drafters, verifiers, bench, serve, export, train.

Names here are a contract (the benchmark and outside checks call them): keep flags and JSON fields.
User mistakes print one line ``specdecode: error: ...`` and exit 2; no traceback.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pkgutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from specdecode.bench.cli import add_bench_command
from specdecode.declarations import declarations
from specdecode.decode_flags import add_generation_flags, add_remote_flags
from specdecode.deferred import Deferred
from specdecode.errors import SpecDecodeError
from specdecode.models import registry
from specdecode.server.cli import add_serve_command
from specdecode.train.cli import add_export_command, add_train_command
from specdecode.verbosity import quiet_third_party
from specdecode.verify.registry import format_verifiers


def cmd_models(args: argparse.Namespace) -> int:
    statuses = registry.list_models()
    if args.json:
        print(json.dumps([{**vars(s)} for s in statuses]))
    else:
        print(registry.format_model_table(statuses))
    return 0


def drafter_summaries() -> dict[str, str]:
    """Registered drafter name → first line of its docstring (else its module's), read from the source of the
    drafters package without importing it (:mod:`specdecode.declarations`).  Finds what ``drafters._discover``
    registers: classes decorated ``@register_drafter("name")`` in every module but ``base``."""
    spec = importlib.util.find_spec("specdecode.drafters")
    modules = pkgutil.iter_modules(spec.submodule_search_locations if spec else [])
    paths = [Path(m.module_finder.path, f"{m.name}.py") for m in modules if m.name != "base"]
    summaries = {
        declared.args[0]: declared.summary or declared.module_summary
        for declared in declarations([path for path in paths if path.is_file()], "register_drafter")
        if declared.args and isinstance(declared.args[0], str)
    }
    return dict(sorted(summaries.items()))


def cmd_drafters(args: argparse.Namespace) -> int:
    for name, summary in drafter_summaries().items():
        print(f"{name:<14} {summary}")
    return 0


class OneLineErrors(argparse.ArgumentParser):
    """argparse, except that a usage mistake (an unknown flag, ``--max-new-tokens abc``) ends in one line and exit
    2, as every other mistake does, instead of the whole usage first; ``-h`` still shows it.  Subcommands'
    parsers are of the same class (argparse builds them as their parent's)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} -h)\n")


def build_parser() -> argparse.ArgumentParser:
    """The ``specdecode`` parser.  Every command's flags are declared by a light module; the command's own
    module, which imports torch (seconds), is imported only when it runs (:class:`~specdecode.deferred.Deferred`)."""
    parser = OneLineErrors(prog="specdecode", description="Lossless speculative decoding for LLMs.")
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="generate text from a prompt")
    generate.add_argument("prompt", help="the prompt text, or - to read it from standard input")
    add_generation_flags(generate)
    add_remote_flags(generate)
    generate.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    generate.set_defaults(run=Deferred("specdecode.decode_commands:cmd_generate"))

    batch = commands.add_parser("batch", help="decode the prompts of a JSONL file together (batched)")
    batch.add_argument(
        "prompts", help='JSONL file (or - for standard input): one {"prompt": ...} or {"messages": [...]} per line'
    )
    add_generation_flags(batch)
    batch.add_argument("--batch-size", type=int, default=8, metavar="B", help="sequences decoded together")
    batch.add_argument("--json", action="store_true", help="one JSON object per line, in input order")
    batch.set_defaults(run=Deferred("specdecode.decode_commands:cmd_batch"))

    demo = commands.add_parser("demo", help="plain vs speculative decoding on one prompt, with the speedup")
    add_generation_flags(demo)
    demo.set_defaults(run=Deferred("specdecode.decode_commands:cmd_demo"))

    models = commands.add_parser("models", help="list the offline model registry and what is cached")
    models.add_argument("--json", action="store_true")
    models.set_defaults(run=cmd_models)

    drafters = commands.add_parser("drafters", help="list registered drafters")
    drafters.set_defaults(run=cmd_drafters)

    verifiers = commands.add_parser("verifiers", help="list the verifiers (exact is lossless; the others are lossy)")
    verifiers.set_defaults(run=lambda args: print(format_verifiers()) or 0)

    add_bench_command(commands)
    add_serve_command(commands)
    add_export_command(commands)
    add_train_command(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    run: Callable[[argparse.Namespace], int] = args.run
    try:
        with quiet_third_party(quiet=not getattr(args, "verbose", True)):
            return run(args)
    except SpecDecodeError as exc:
        print(f"specdecode: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("specdecode: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
