"""Ceiling: LoRA trained offline on requests [0, split) for several epochs, evaluated (teacher-forced
simulated mean accepted) on [split, n) against the frozen drafter."""

import argparse
import json
import random
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

import specdecode.drafters.adapt as A
import specdecode.drafters.adapt_data as D
from specdecode.models.loading import load_model

ap = argparse.ArgumentParser()
ap.add_argument("data")
ap.add_argument("--k", type=int, default=8)
ap.add_argument("--lr", type=float, default=3e-4)
ap.add_argument("--epochs", type=int, default=3)
ap.add_argument("--layers", type=int, default=8)
ap.add_argument("--rank", type=int, default=16)
ap.add_argument("--split", type=int, default=40)
ap.add_argument("--n", type=int, default=50)
ap.add_argument("--answer-only", action="store_true")
a = ap.parse_args()
A.LORA_LAYERS, A.LORA_RANK, A.LORA_ALPHA = a.layers, a.rank, 2 * a.rank
qt = AutoTokenizer.from_pretrained("/root/.cache/specdecode/models/qwen2.5-coder-1.5b/hf")
draft = load_model("smollm2-135m")
dt = draft.tokenizer
adapter = A.OnlineAdapter(draft, A.AdaptOptions(train=True, budget=1e9, steps=1, learning_rate=a.lr))
model = adapter.draft.backend.model
seqs = []
for r in json.loads(Path(a.data).read_text())[: a.n]:
    prompt = qt.decode(r["prompt_ids"])
    answer = qt.decode(r["token_ids"])
    enc = dt(prompt + answer, return_offsets_mapping=True, add_special_tokens=False)
    ids = enc["input_ids"][-512:]
    off = enc["offset_mapping"][-512:]
    a0 = next(j for j, (s, e) in enumerate(off) if e > len(prompt))
    seqs.append((ids, a0))


def evaluate(rng):
    out = []
    for ids, a0 in [seqs[i] for i in rng]:
        x = torch.tensor(ids)
        with torch.no_grad():
            pred = model(input_ids=x[None], use_cache=False).logits[0].argmax(-1)
        match = [bool(pred[j - 1] == x[j]) for j in range(len(ids))]
        p, runs = a0, []
        while p < len(ids):
            run = 0
            while run < a.k and p + run < len(ids) and match[p + run]:
                run += 1
            runs.append(run + 1)
            p += run + 1
        out.append((sum(runs) / len(runs), sum(match[a0:]) / (len(ids) - a0)))
    return [round(sum(v[i] for v in out) / len(out), 3) for i in (0, 1)]


held = range(a.split, a.n)
print("frozen held-out", evaluate(held), "train", evaluate(range(a.split)), flush=True)
t0 = time.time()
for epoch in range(a.epochs):
    order = list(range(a.split))
    random.Random(epoch).shuffle(order)
    for i in order:
        ids, a0 = seqs[i]
        start = 1 if not a.answer_only else a0 - 1
        rows = list(range(start, len(ids) - 1))
        adapter._step(D.Example.build(ids, rows, [1.0] * len(rows), {}))
    print(
        "epoch",
        epoch,
        "held-out",
        evaluate(held),
        "train",
        evaluate(range(a.split)),
        round(time.time() - t0),
        flush=True,
    )
