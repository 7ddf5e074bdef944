"""Time the CPU fast path's two fp32 layouts on one decoder layer's products: oneDNN's prepacked product against our
panel kernel (``kernels/panel_linear.cpp``), at 1 to 256 rows.

The layer's seven products (query, key, value, output; gate, up, down) for a model's sizes, each weight drawn 30
times (a 30-layer model's worth of distinct weights, so that they come from memory as in a forward, not from the
cache); per row count, the mean time of the seven calls over 100 passes (10 from 32 rows on), both layouts in the
same process, alternated.

    python tools/measure_panel_linear.py --hidden 576 --intermediate 1536 --heads 9 --kv-heads 3 \\
        --out docs/results/DIR/products.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from specdecode.models.cpu_kernels import cpu_kernels_built, pack_panels, panel_linear

LAYERS = 30
ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def layer_shapes(hidden: int, intermediate: int, heads: int, kv_heads: int) -> list[tuple[int, int]]:
    """[out, in] of a Llama-shaped layer's seven products."""
    kv = hidden // heads * kv_heads
    return (
        [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden)]
        + [(intermediate, hidden)] * 2
        + [(hidden, intermediate)]
    )


def mean_us(call, passes: int) -> float:
    call(0)
    started = time.perf_counter()
    for index in range(passes):
        call(index)
    return (time.perf_counter() - started) / passes * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if not cpu_kernels_built():
        raise SystemExit("the CPU kernels are not built here: nothing to compare")
    shapes = layer_shapes(args.hidden, args.intermediate, args.heads, args.kv_heads)
    generator = torch.Generator().manual_seed(0)
    weights = [[torch.randn(*shape, generator=generator) for shape in shapes] for _ in range(LAYERS)]
    onednn = [[torch.ops.mkldnn._reorder_linear_weight(w, None) for w in layer] for layer in weights]
    panels = [[pack_panels(w) for w in layer] for layer in weights]
    layer_bytes = sum(out * inner * 4 for out, inner in shapes)
    rows_measured = []
    for rows in ROWS:
        inputs = {inner: torch.randn(rows, inner, generator=generator) for _, inner in shapes}

        def by_onednn(index: int, inputs: dict[int, torch.Tensor] = inputs) -> None:
            for (_, inner), weight in zip(shapes, onednn[index % LAYERS]):
                torch.ops.mkldnn._linear_pointwise(inputs[inner], weight, None, "none", [], "")

        def by_panels(index: int, inputs: dict[int, torch.Tensor] = inputs) -> None:
            for (_, inner), weight in zip(shapes, panels[index % LAYERS]):
                panel_linear(inputs[inner], weight, None)

        passes = 100 if rows < 32 else 10
        onednn_us = min(mean_us(by_onednn, passes) for _ in range(2))
        panels_us = min(mean_us(by_panels, passes) for _ in range(2))
        flops = 2 * rows * layer_bytes / 4
        rows_measured.append(
            {
                "rows": rows,
                "onednn_us": round(onednn_us, 1),
                "panels_us": round(panels_us, 1),
                "speedup": round(onednn_us / panels_us, 3),
                "onednn_gb_per_s": round(layer_bytes / onednn_us / 1e3, 1),
                "panels_gb_per_s": round(layer_bytes / panels_us / 1e3, 1),
                "onednn_gflops": round(flops / onednn_us / 1e3, 1),
                "panels_gflops": round(flops / panels_us / 1e3, 1),
            }
        )
        print(rows_measured[-1])
    record = {
        "shapes": shapes,
        "layers": LAYERS,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "capability": str(torch.backends.cpu.get_cpu_capability()),
        "rows": rows_measured,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
