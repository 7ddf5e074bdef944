"""``specdecode bench``: the suite (:mod:`specdecode.bench.commands.suite`) and every registered sub-command
(:mod:`specdecode.bench.benchmark`)."""

from __future__ import annotations

import argparse

from specdecode.bench.benchmark import benchmarks
from specdecode.bench.commands.suite import BenchSuite


def add_bench_command(subparsers: argparse._SubParsersAction) -> None:
    """Add ``bench`` and its sub-commands to the top-level parser."""
    suite = BenchSuite()
    bench = subparsers.add_parser("bench", help=suite.help, description=suite.description)
    suite.add_to(bench, keep_given=False)
    commands = bench.add_subparsers(dest="bench_command", required=False)  # argparse lists every sub-command
    for name, benchmark in benchmarks().items():
        parser = commands.add_parser(name, help=benchmark.help, description=benchmark.description or None)
        benchmark().add_to(parser)
