"""Seconds per distillation batch of the 0.5B draft (LoRA rank 16): fp32 matmuls against bf16 autocast.

One 400-token sequence whose last 96 rows are answer rows, with a random teacher; each batch is a forward, a backward
and an AdamW step, four batches per precision, the two precisions twice in turn."""

import time

import torch

from specdecode.models.loading import load_model
from specdecode.train.draft import TEACHER_TOP, Sequence, divergence, draft_logits, trainable

torch.manual_seed(0)
draft = load_model("qwen2.5-coder-0.5b", fast_path=False)
model, parameters = trainable(draft.backend.model, 16)
optimizer = torch.optim.AdamW(list(parameters.values()), lr=1e-4)
sequence = Sequence(
    torch.randint(0, 150000, (400,)),
    304,
    torch.randint(0, 150000, (96, TEACHER_TOP), dtype=torch.int32),
    torch.log_softmax(torch.randn(96, TEACHER_TOP), -1) - 0.1,
)
for precision in ("fp32", "bf16", "fp32", "bf16"):
    seconds = []
    for _ in range(4):
        started = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = divergence("fkl", sequence, draft_logits(model, sequence)).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        seconds.append(time.perf_counter() - started)
    print(precision, [round(s, 2) for s in seconds], flush=True)
