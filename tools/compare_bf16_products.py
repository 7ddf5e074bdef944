"""Time a model's whole forwards with the bf16 panel kernel's two products, AVX512_BF16's dot product (vdpbf16ps) and
the pairs widened to fp32 and multiplied-added (``kernels/bf16_panel_tile.h``), in one process, alternated.

Both products give the same bits (checked on the logits and greedy choices of the widest forward first), so only the
time differs.  The bf16 linear layers and the greedy head's bf16 screen of the LM head (fp32 models too) take the
product chosen; a row count below the widened product's fewest rows runs the dot product either way.  A model is loaded
with ``--quantize``, ``--context`` tokens cached, and a forward over each row count in ``--rows`` is timed per round
(as a greedy verification runs it, the cache cropped back after each) in ``--rounds`` rounds after a warm-up round,
each product first in every other round; the median of each.

    python tools/compare_bf16_products.py --quantize bf16 --out docs/results/DIR/forwards-bf16.json
"""

from __future__ import annotations

import argparse
import statistics

import torch
from forward_timing import add_forward_arguments, pin_threads, write_record

from specdecode.models import cpu_kernels, greedy_head
from specdecode.models.base import SequenceInput
from specdecode.models.cost import prefilled, timed_round
from specdecode.models.loading import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_forward_arguments(parser, rows="1,4,8,12,16", rounds=16)
    args = parser.parse_args()
    pin_threads()
    if not cpu_kernels.bf16_panels_pay():
        raise SystemExit("the bf16 panel kernel does not run here (no AVX512_BF16, AMX, or the kernels not built)")
    widened = {"now": False}
    choose = lambda: widened["now"]  # noqa: E731 - both modules read the choice at every call
    cpu_kernels.bf16_widened_pays = choose
    greedy_head.bf16_widened_pays = choose
    rows_list = [int(rows) for rows in args.rows.split(",")]
    backend = load_model(args.model, quantize=args.quantize).backend
    cache, new = prefilled(backend, args.context, max(rows_list))
    outputs = {}
    for widened["now"] in (False, True):
        length = cache.length
        (logits,) = backend.forward_batch([SequenceInput(new, cache)])
        cache.crop(length)
        (choices,) = backend.forward_batch([SequenceInput(new, cache, choices_only=True)])
        cache.crop(length)
        outputs[widened["now"]] = (logits.logits, choices.choices if choices.choices is not None else choices.logits)
    if not all(torch.equal(a, b) for a, b in zip(outputs[False], outputs[True])):
        raise SystemExit("the two products' logits or greedy choices differ: they do not sum alike here")
    times: dict[bool, dict[int, list[float]]] = {False: {}, True: {}}
    for round_index in range(args.rounds + 1):
        for widened["now"] in (True, False) if round_index % 2 == 0 else (False, True):
            for rows, seconds in zip(rows_list, timed_round(backend, cache, new, rows_list)):
                if round_index:
                    times[widened["now"]].setdefault(rows, []).append(seconds * 1000)
    measured = []
    for rows in rows_list:
        dot, wide = statistics.median(times[False][rows]), statistics.median(times[True][rows])
        measured.append(
            {
                "rows": rows,
                "dot_ms": round(dot, 3),
                "widened_ms": round(wide, 3),
                "dot_relative": round(dot / statistics.median(times[False][rows_list[0]]), 3),
                "widened_relative": round(wide / statistics.median(times[True][rows_list[0]]), 3),
                "widened_over_dot": round(wide / dot, 3),
            }
        )
        print(measured[-1], flush=True)
    settings = {"model": args.model, "quantize": args.quantize, "context_tokens": args.context, "rounds": args.rounds}
    write_record(args.out, {**settings, "outputs_equal": True}, measured)


if __name__ == "__main__":
    main()
