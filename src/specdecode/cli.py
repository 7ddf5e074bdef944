"""Command line: ``specdecode generate | batch | serve | demo | models | drafters | bench | train``.

Names here are a contract (the benchmark and outside checks call them): keep flags and JSON fields.
User mistakes print one line ``specdecode: error: ...`` and exit 2; no traceback.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import pkgutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from specdecode.bench.cli import add_bench_command
from specdecode.decode_commands import add_generation_flags, cmd_batch, cmd_demo, cmd_generate
from specdecode.errors import SpecDecodeError
from specdecode.heads.cli import add_export_command
from specdecode.server.cli import add_serve_command
from specdecode.verbosity import quiet_third_party
from specdecode.verify.registry import format_verifiers


def cmd_models(args: argparse.Namespace) -> int:
    from specdecode.models import registry

    statuses = registry.list_models()
    if args.json:
        print(json.dumps([{**vars(s)} for s in statuses]))
    else:
        print(registry.format_model_table(statuses))
    return 0


def drafter_summaries() -> dict[str, str]:
    """Registered drafter name → first line of its docstring (else its module's), read from the source of the
    drafters package without importing it: the drafters import torch and transformers, seconds spent for a
    listing.  Finds what ``drafters._discover`` registers: classes decorated ``@register_drafter("name")`` in
    every module but ``base``."""
    spec = importlib.util.find_spec("specdecode.drafters")
    summaries = {}
    for module in pkgutil.iter_modules(spec.submodule_search_locations if spec else []):
        path = Path(module.module_finder.path, f"{module.name}.py")
        if module.name == "base" or not path.is_file():
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in tree.body:
            names = [_registered_name(decorator) for decorator in getattr(node, "decorator_list", [])]
            for name in filter(None, names):
                doc = (ast.get_docstring(node) or ast.get_docstring(tree) or "").strip()
                summaries[name] = doc.splitlines()[0] if doc else ""
    return dict(sorted(summaries.items()))


def _registered_name(decorator: ast.expr) -> str | None:
    """``"name"`` for a ``@register_drafter("name")`` decorator, else None."""
    if isinstance(decorator, ast.Call) and getattr(decorator.func, "id", None) == "register_drafter":
        first = decorator.args[0] if decorator.args else None
        return first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else None
    return None


def cmd_drafters(args: argparse.Namespace) -> int:
    for name, summary in drafter_summaries().items():
        print(f"{name:<14} {summary}")
    return 0


#: ``specdecode train``'s line in ``specdecode --help``, shown without building its parser (see build_parser).
TRAIN_HELP = "train drafter weights on the target model's own outputs"


class OneLineErrors(argparse.ArgumentParser):
    """argparse, except that a usage mistake (an unknown flag, ``--max-new-tokens abc``) ends in one line and exit
    2, as every other mistake does, instead of the whole usage first; ``-h`` still shows it.  Subcommands'
    parsers are of the same class (argparse builds them as their parent's)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} -h)\n")


def build_parser(with_train: bool = True) -> argparse.ArgumentParser:
    """The ``specdecode`` parser.  ``with_train=False`` lists ``train`` by name only: its flags' defaults come
    from the drafters package, which imports torch (seconds), so :func:`main` builds them only to run it."""
    parser = OneLineErrors(prog="specdecode", description="Lossless speculative decoding for LLMs.")
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="generate text from a prompt")
    generate.add_argument("prompt", help="the prompt text, or - to read it from standard input")
    add_generation_flags(generate)
    generate.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    generate.set_defaults(run=cmd_generate)

    batch = commands.add_parser("batch", help="decode the prompts of a JSONL file together (batched)")
    batch.add_argument(
        "prompts", help='JSONL file (or - for standard input): one {"prompt": ...} or {"messages": [...]} per line'
    )
    add_generation_flags(batch)
    batch.add_argument("--batch-size", type=int, default=8, metavar="B", help="sequences decoded together")
    batch.add_argument("--json", action="store_true", help="one JSON object per line, in input order")
    batch.set_defaults(run=cmd_batch)

    demo = commands.add_parser("demo", help="plain vs speculative decoding on one prompt, with the speedup")
    add_generation_flags(demo)
    demo.set_defaults(run=cmd_demo)

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
    if with_train:
        from specdecode.train.cli import add_train_command

        add_train_command(commands)
    else:
        commands.add_parser("train", help=TRAIN_HELP, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(with_train=argv[:1] == ["train"])
    args = parser.parse_args(argv)
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
