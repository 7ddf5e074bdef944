"""Seconds per distillation batch of the 0.5B draft (LoRA 16), fp32 against bf16 autocast."""

import time, torch
from specdecode.models.loading import load_model
from specdecode.train.draft import trainable, Sequence, divergence, draft_logits, TEACHER_TOP

torch.manual_seed(0)
draft = load_model("qwen2.5-coder-0.5b", fast_path=False)
model, params = trainable(draft.backend.model, 16)
opt = torch.optim.AdamW(list(params.values()), lr=1e-4)
ids = torch.randint(0, 150000, (400,))
seq = Sequence(
    ids,
    304,
    torch.randint(0, 150000, (96, TEACHER_TOP), dtype=torch.int32),
    torch.log_softmax(torch.randn(96, TEACHER_TOP), -1) - 0.1,
)
for mode in ("fp32", "bf16", "fp32", "bf16"):
    times = []
    for _ in range(4):
        t = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "bf16"):
            loss = divergence("fkl", seq, draft_logits(model, seq)).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t)
    print(mode, [round(x, 2) for x in times], flush=True)
