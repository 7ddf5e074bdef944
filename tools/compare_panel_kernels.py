"""Time a model's whole forwards with a base commit's panel products and attention kernel against this tree's, in one
process, alternated.

The kernels: ``kernels/panel_linear.cpp`` (fp32), ``kernels/bf16_panel_linear.cpp``, ``kernels/ragged_attention.cpp``
(the attention of decoding and verification) and the headers they include.

The base commit's sources are built as a second extension whose operators take other names; each forward then calls
this tree's or the base's, which must give the same bits (checked on the logits first), so only the time differs.  A
model is loaded with ``--quantize``, ``--context`` tokens cached, and forwards of each row count in ``--rows`` are
timed (10 a round, the cache cropped back after each) in ``--rounds`` rounds that alternate the two builds, each first
in every other round; the median round of each.

    python tools/compare_panel_kernels.py --base HEAD~1 --model smollm2-135m --quantize bf16 \\
        --out docs/results/DIR/forwards.json
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from forward_timing import add_forward_arguments, pin_threads, write_record
from torch.utils.cpp_extension import load

from specdecode.models import cpu_kernels
from specdecode.models.loading import load_model

KERNELS = "src/specdecode/models/kernels"
#: What the base build is made of: each kernel's source, its namespace, and the headers they include.
PRODUCTS = {
    "bf16_panel_linear.cpp": "specdecode_bf16",
    "panel_linear.cpp": "specdecode_linear",
    "ragged_attention.cpp": "specdecode_attention",
}
HEADERS = ("panel_tile.h", "bf16_panel_tile.h", "vec.h", "vector16.h")
OPERATORS = {
    "specdecode_bf16": "bf16_panel_linear",
    "specdecode_linear": "panel_linear",
    "specdecode_attention": "ragged_attention",
}


def build_base(commit: str, directory: Path) -> None:
    """The base commit's kernels as an extension whose namespaces are prefixed ``base_``."""
    root = Path(subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True).stdout.strip())
    for name in (*PRODUCTS, *HEADERS):
        text = subprocess.run(
            ["git", "show", f"{commit}:{KERNELS}/{name}"], cwd=root, capture_output=True, text=True, check=True
        ).stdout
        for namespace in PRODUCTS.values():
            text = text.replace(f"TORCH_LIBRARY({namespace},", f"TORCH_LIBRARY(base_{namespace},")
        (directory / name).write_text(text)
    isa = str(torch.backends.cpu.get_cpu_capability())
    load(
        name=f"base_kernels_{isa.lower()}",
        sources=[str(directory / name) for name in PRODUCTS],
        extra_cflags=cpu_kernels.compile_flags(isa),
        extra_ldflags=["-fopenmp"],
        extra_include_paths=[str(directory)],
        build_directory=str(directory),
        is_python_module=False,
    )


class Builds:
    """Routes the kernels' operators to this tree's build or the base's."""

    def __init__(self) -> None:
        self.base = False
        for namespace, operator in OPERATORS.items():
            ours = getattr(getattr(torch.ops, namespace), operator)
            theirs = getattr(getattr(torch.ops, f"base_{namespace}"), operator)
            setattr(getattr(torch.ops, namespace), operator, self._route(ours, theirs))

    def _route(self, ours, theirs):
        # A base built before an operator took a trailing argument gets the arguments it takes.
        taken = len(theirs.default._schema.arguments)
        return lambda *args: theirs(*args[:taken]) if self.base else ours(*args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the commit whose kernels to compare against")
    add_forward_arguments(parser, rows="1,4,6,8,9,10,11,12,14,16", rounds=8)
    args = parser.parse_args()
    pin_threads()
    if not cpu_kernels.cpu_kernels_built():
        raise SystemExit("the CPU kernels are not built here: nothing to compare")
    rows_list = [int(rows) for rows in args.rows.split(",")]
    with tempfile.TemporaryDirectory() as directory:
        build_base(args.base, Path(directory))
        builds = Builds()
        target = load_model(args.model, quantize=args.quantize)
        backend = target.backend
        ids = torch.randint(100, 1000, (args.context + max(rows_list),), generator=torch.Generator().manual_seed(0))
        cache = backend.new_cache()
        backend.forward(ids[: args.context], cache)
        widest = ids[args.context : args.context + max(rows_list)]
        logits = {}
        for base in (False, True):
            builds.base = base
            logits[base] = backend.forward(widest, cache).logits
            cache.crop(args.context)
        if not torch.equal(logits[False], logits[True]):
            raise SystemExit("the two builds' logits differ: their kernels do not sum alike")
        times: dict[tuple[int, bool], list[float]] = {}
        for round_index in range(args.rounds):
            for rows in rows_list:
                # Each build goes first in every other round: the first of a pair ran slower by a few percent.
                for base in (False, True) if round_index % 2 == 0 else (True, False):
                    builds.base = base
                    new = ids[args.context : args.context + rows]
                    backend.forward(new, cache)
                    cache.crop(args.context)
                    started = time.perf_counter()
                    for _ in range(10):
                        backend.forward(new, cache)
                        cache.crop(args.context)
                    times.setdefault((rows, base), []).append((time.perf_counter() - started) / 10 * 1000)
    median = {key: statistics.median(values) for key, values in times.items()}
    measured = []
    for rows in rows_list:
        base_ms, ours_ms = median[(rows, True)], median[(rows, False)]
        measured.append(
            {
                "rows": rows,
                "base_ms": round(base_ms, 3),
                "ours_ms": round(ours_ms, 3),
                "base_relative": round(base_ms / median[(rows_list[0], True)], 3),
                "ours_relative": round(ours_ms / median[(rows_list[0], False)], 3),
                "ours_over_base": round(ours_ms / base_ms, 3),
            }
        )
        print(measured[-1], flush=True)
    settings = {"model": args.model, "quantize": args.quantize, "base": args.base, "context_tokens": args.context}
    write_record(args.out, {**settings, "rounds": args.rounds, "logits_equal": True}, measured)


if __name__ == "__main__":
    main()
