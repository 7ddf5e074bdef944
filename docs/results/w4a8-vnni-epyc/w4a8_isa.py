"""w4a8 kernel per instruction set: the same bits, and the time of Qwen2.5-1.5B-shaped layers at 1-8 rows."""

import sys
import time

import torch
from torch import nn

from specdecode.models import w4a8
from specdecode.models.quantized_layers import int4_levels

torch.manual_seed(0)
torch.set_num_threads(2)
isas = ["avx2", "avx512vnni"]
mods = {isa: w4a8.kernel(isa) for isa in isas}
shapes = [(1536, 8960), (8960, 1536), (1536, 1536)]
timing = "time" in sys.argv
for k, n in shapes:
    blocks = w4a8.pack_blocks(*int4_levels(nn.Linear(k, n).weight.detach(), 64))
    for m in (1, 2, 3, 4, 5, 8, 16):
        x = torch.randn(m, k)
        outs = {isa: mods[isa].w4a8_mm(x, blocks) for isa in isas}
        same = torch.equal(outs["avx2"], outs["avx512vnni"])
        line = f"{k}x{n} m={m:2d} same={same}"
        if timing:
            # weights cold as in decoding: cycle over 8 copies (> cache)
            copies = [blocks.clone() for _ in range(8)]
            for isa in isas:
                best = []
                for _rep in range(5):
                    t = time.perf_counter()
                    for c in copies:
                        mods[isa].w4a8_mm(x, c)
                    best.append((time.perf_counter() - t) / len(copies))
                line += f"  {isa} {min(best) * 1e3:.3f} ms"
        print(line, flush=True)
