"""SmolLM2's forward over 1-8 new tokens after 450 cached, with the fast path's dense MKL copies used for up to
3 rows (the choice before 9b50112) and without them (what tune_fast_path chose on this CPU), interleaved; fastest ms."""

import torch

from specdecode.models.cost import timed_rounds
from specdecode.models.fastpath import DENSE_COPY_MAX, PackedLinear
from specdecode.models.loading import load_model

torch.set_num_threads(2)
backend = load_model("smollm2-135m").backend
layers = [m for m in backend.model.modules() if isinstance(m, PackedLinear)]
for m in layers:  # the copies tuning may have freed
    if not m.tied and m.packed.numel() <= DENSE_COPY_MAX and m.dense is None:
        m.dense = m.packed.to_dense()
fastest: dict[str, dict[int, float]] = {"with copies (<= 3 rows)": {}, "without": {}}
for _ in range(4):
    for name, rows in (("with copies (<= 3 rows)", 3), ("without", 0)):
        for m in layers:
            m.dense_rows = rows if m.dense is not None else 0
        for width, seconds in timed_rounds(backend, 450, 8, 2, 1).items():
            fastest[name][width] = min(fastest[name].get(width, 1.0), *seconds)
for name, by_width in fastest.items():
    print(f"{name:24s} " + " ".join(f"{w}:{s * 1e3:.1f}" for w, s in by_width.items()))
