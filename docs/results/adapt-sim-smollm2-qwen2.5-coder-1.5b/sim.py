"""Teacher-forced simulation of online adaptation: per request, the drafter's simulated mean accepted
tokens (greedy chain, k drafter tokens) on the target's verified answer, then training on it."""

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

import specdecode.drafters.adapt as A
import specdecode.drafters.adapt_data as D
from specdecode.models.loading import load_model


def mean_accepted(match: list[bool], start: int, k: int) -> float:
    """Greedy chain drafting of k tokens from ``start`` on: a step accepts the run of right predictions
    (at most k) plus the target's own token."""
    p, runs = start, []
    while p < len(match):
        run = 0
        while run < k and p + run < len(match) and match[p + run]:
            run += 1
        runs.append(run + 1)
        p += run + 1
    return sum(runs) / len(runs)


ap = argparse.ArgumentParser()
ap.add_argument("data")
ap.add_argument("--k", type=int, default=8)
ap.add_argument("--lr", type=float, default=1e-3)
ap.add_argument("--steps", type=int, default=8)
ap.add_argument("--layers", type=int, default=8)
ap.add_argument("--rank", type=int, default=16)
ap.add_argument("--agreed", type=float, default=0.2)
ap.add_argument("--frozen", action="store_true")
ap.add_argument("--n", type=int, default=50)
ap.add_argument("--window", type=int, default=512)
ap.add_argument("--latest", type=int, default=1, help="steps on the newest example before replay")
a = ap.parse_args()
A.LORA_LAYERS, A.LORA_RANK, A.LORA_ALPHA = a.layers, a.rank, 2 * a.rank
D.AGREED_WEIGHT, D.WINDOW = a.agreed, a.window
qt = AutoTokenizer.from_pretrained("/root/.cache/specdecode/models/qwen2.5-coder-1.5b/hf")
draft = load_model("smollm2-135m")
dt = draft.tokenizer
adapter = A.OnlineAdapter(draft, A.AdaptOptions(train=not a.frozen, budget=1e9, steps=a.steps, learning_rate=a.lr))
model = adapter.draft.backend.model
records = json.loads(Path(a.data).read_text())[: a.n]
out = []
t0 = time.time()
for i, r in enumerate(records):
    prompt = qt.decode(r["prompt_ids"])
    answer = qt.decode(r["token_ids"])
    enc = dt(prompt + answer, return_offsets_mapping=True, add_special_tokens=False)
    ids = enc["input_ids"]
    a0 = next(j for j, (s, e) in enumerate(enc["offset_mapping"]) if e > len(prompt))
    x = torch.tensor(ids)
    with torch.no_grad():
        pred = model(input_ids=x[None], use_cache=False).logits[0].argmax(-1)
    match = [bool(pred[j - 1] == x[j]) for j in range(len(ids))]

    acc = sum(match[a0:]) / max(1, len(ids) - a0)
    out.append({"mean_accepted": mean_accepted(match, a0, a.k), "top1": acc, "k16": mean_accepted(match, a0, 16)})
    if not a.frozen:
        rows = list(range(a0 - 1, len(ids) - 1))
        weights = [1.0 if not match[j + 1] else a.agreed for j in rows]
        ex = D.Example.build(ids, rows, weights, {})
        for _ in range(a.latest - 1):
            adapter._step(ex)
        adapter.learn(ex, 1.0)
    print(i, round(out[-1]["mean_accepted"], 2), round(acc, 3), round(time.time() - t0), flush=True)
m = [o["mean_accepted"] for o in out]
t = [o["top1"] for o in out]
first, last = sum(m[:10]) / 10, sum(m[-10:]) / 10
print(
    json.dumps(
        {
            "args": vars(a),
            "first10": round(first, 3),
            "last10": round(last, 3),
            "ratio": round(last / first, 3),
            "top1_first10": round(sum(t[:10]) / 10, 3),
            "k16_ratio": round(sum(o["k16"] for o in out[-10:]) / sum(o["k16"] for o in out[:10]), 3),
            "top1_last10": round(sum(t[-10:]) / 10, 3),
            "per_request": [round(x, 3) for x in m],
        }
    )
)
