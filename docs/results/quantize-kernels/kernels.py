"""Per-linear-layer time of torch's CPU weight-only kernels against the fp32 fast path.

Run: ``python docs/results/quantize-kernels/kernels.py [--json out.json]``.  For every layer shape of
smollm2-135m and qwen2.5-coder-1.5b and M = 1, 4, 8 rows, the median time of one call, with the weights
of each variant copied until they fill at least 512 MiB and the calls cycling through the copies: a
forward reads every weight once, from memory rather than cache, and so does this.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

SHAPES = {  # name -> (in_features, out_features)
    "smollm2-135m": {
        "q/o 576x576": (576, 576),
        "k/v 576->192": (576, 192),
        "gate/up 576->1536": (576, 1536),
        "down 1536->576": (1536, 576),
        "lm_head 576->49152": (576, 49152),
    },
    "qwen2.5-coder-1.5b": {
        "q/o 1536x1536": (1536, 1536),
        "k/v 1536->256": (1536, 256),
        "gate/up 1536->8960": (1536, 8960),
        "down 8960->1536": (8960, 1536),
        "lm_head 1536->151936": (1536, 151936),
    },
}
ROWS = (1, 4, 8)
FOOTPRINT = 512 * 2**20


def int8_weights(w: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.abs().amax(1).clamp(min=1e-8) / 127
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale.to(dtype)


def int4_weights(w: torch.Tensor, group: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = w.shape
    grouped = w.reshape(n, k // group, group)
    low, high = grouped.amin(-1), grouped.amax(-1)
    scale = ((high - low) / 15).clamp(min=1e-8)
    q = torch.round((grouped - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).reshape(n, k)
    zero = low + 8 * scale
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    return packed, torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(dtype)


def variants(k: int, n: int) -> dict[str, tuple[Callable[[], tuple], Callable[..., torch.Tensor], torch.dtype]]:
    """name -> (make one copy of the weights, call(x, *weights), activation dtype)."""
    mkldnn = torch.ops.mkldnn

    def dense() -> tuple:
        return (torch.randn(n, k) * 0.02,)

    out: dict = {
        "fp32 MKL (F.linear)": (dense, lambda x, w: F.linear(x, w), torch.float32),
        "fp32 oneDNN packed": (
            lambda: (mkldnn._reorder_linear_weight(dense()[0], None),),
            lambda x, w: mkldnn._linear_pointwise(x, w, None, "none", [], ""),
            torch.float32,
        ),
        "bf16 oneDNN packed (bf16 x)": (
            lambda: (mkldnn._reorder_linear_weight(dense()[0].bfloat16(), None),),
            lambda x, w: mkldnn._linear_pointwise(x, w, None, "none", [], ""),
            torch.bfloat16,
        ),
        "int8 _weight_int8pack_mm (fp32 x)": (
            lambda: int8_weights(dense()[0], torch.float32),
            lambda x, q, s: torch.ops.aten._weight_int8pack_mm(x, q, s),
            torch.float32,
        ),
        "int8 _weight_int8pack_mm (bf16 x)": (
            lambda: int8_weights(dense()[0], torch.bfloat16),
            lambda x, q, s: torch.ops.aten._weight_int8pack_mm(x, q, s),
            torch.bfloat16,
        ),
        "int8 dequantize + F.linear (torchao eager)": (
            lambda: int8_weights(dense()[0], torch.float32),
            lambda x, q, s: F.linear(x, q.to(x.dtype)) * s,
            torch.float32,
        ),
    }
    for group in (32, 64, 128):
        if k % group:
            continue
        for dtype in (torch.bfloat16, torch.float32):
            if dtype == torch.float32 and (group != 64 or k * n > 16 * 2**20):  # slow: shown once, small layers
                continue
            out[f"int4 g{group} _weight_int4pack_mm_for_cpu ({str(dtype)[6:]} x)"] = (
                lambda group=group, dtype=dtype: int4_weights(dense()[0], group, dtype),
                lambda x, p, sz, group=group: torch.ops.aten._weight_int4pack_mm_for_cpu(x, p, group, sz),
                dtype,
            )
    return out


def weight_bytes(weights: tuple) -> int:
    total = 0
    for t in weights:
        total += t.to_dense().nbytes if t.is_mkldnn else t.nbytes
    return total


def time_call(make: Callable[[], tuple], call: Callable[..., torch.Tensor], dtype, k: int) -> dict[int, float]:
    first = make()
    copies = [first] + [make() for _ in range(max(0, min(63, FOOTPRINT // max(1, weight_bytes(first)) - 1)))]
    result = {}
    for m in ROWS:
        x = torch.randn(m, k).to(dtype)
        for weights in copies[:4]:
            call(x, *weights)
        samples = []
        for _ in range(7):
            start = time.perf_counter()
            for weights in copies:
                call(x, *weights)
            samples.append((time.perf_counter() - start) / len(copies))
        result[m] = statistics.median(samples) * 1e3
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", help="write the raw times here")
    parser.add_argument("--models", default=",".join(SHAPES))
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    for model in args.models.split(","):
        for layer, (k, n) in SHAPES[model].items():
            for name, (make, call, dtype) in variants(k, n).items():
                times = time_call(make, call, dtype, k)
                rows.append({"model": model, "layer": layer, "kernel": name, "ms": times})
                print(
                    f"{model:<20} {layer:<22} {name:<46} "
                    + "  ".join(f"M={m}: {t:8.3f} ms" for m, t in times.items())
                    + f"  t(8)/t(1)={times[8] / times[1]:.2f}",
                    flush=True,
                )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"torch": torch.__version__, "threads": torch.get_num_threads(), "rows": rows}, handle, indent=1)


if __name__ == "__main__":
    main()
