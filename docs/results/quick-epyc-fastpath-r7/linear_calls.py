"""Single fp32 linear calls: MKL on the dense weight against oneDNN on the packed one, 1-8 rows; microseconds
a call, mean of 300 after 20 warm-up calls."""

import time
from collections.abc import Callable
from functools import partial

import torch

torch.set_num_threads(2)


def microseconds(call: Callable[[], object], calls: int = 300) -> float:
    for _ in range(20):
        call()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / calls * 1e6


SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (1536, 1536), (8960, 1536), (49152, 576)]
for out_features, in_features in SHAPES:
    weight = torch.randn(out_features, in_features)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    cells = []
    for rows in (1, 2, 3, 4, 8):
        x = torch.randn(rows, in_features)
        with torch.inference_mode():
            mkl = microseconds(partial(torch.nn.functional.linear, x, weight))
            onednn = microseconds(partial(torch.ops.mkldnn._linear_pointwise, x, packed, None, "none", [], ""))
        cells.append(f"r{rows}: mkl {mkl:7.1f} dnnl {onednn:7.1f}")
    print(f"{out_features}x{in_features}: " + " | ".join(cells))
