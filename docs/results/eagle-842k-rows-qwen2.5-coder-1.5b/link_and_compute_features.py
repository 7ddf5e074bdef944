"""Compute the features for the 1600-conversation Qwen EAGLE data, reusing the 600-conversation shards."""

import argparse
import os
import sys
from pathlib import Path

import torch

from specdecode.heads.eagle import default_aux_layers
from specdecode.models.loading import load_model
from specdecode.train.cli import DEFAULT_TASKS
from specdecode.train.features import SHARD, data_digest, target_features

M = Path.home() / ".cache/specdecode/models/qwen2.5-coder-1.5b"
OLD = M / "eagle-head.work"
work = M / "eagle-head-big.work"
args = argparse.Namespace(prompts=320, new_tokens=128, conversations=int(sys.argv[1]), max_tokens=512, seed=0)
tasks = [t for t in DEFAULT_TASKS.split(",")]
writer = load_model("qwen2.5-coder-1.5b", dtype=torch.bfloat16)
aux = default_aux_layers(writer.backend.num_layers)
digest = data_digest(writer, args, tasks, aux)
print("digest", digest, flush=True)
work.mkdir(exist_ok=True)
old_digest = "51e1025a455b4ad7"
dist = work / f"distilled-{digest}.jsonl"
if not dist.exists():
    os.symlink(OLD / f"distilled-{old_digest}.jsonl", dist)
shards = work / f"features-{digest}"
shards.mkdir(exist_ok=True)
full_old = 920 // SHARD  # shards wholly inside the old 920 sequences
for i in range(full_old):
    link = shards / f"{i:05d}.pt"
    if not link.exists():
        os.symlink(OLD / f"features-{old_digest}" / f"{i:05d}.pt", link)
features = target_features(writer, args, tasks, work, aux)
print("sequences", len(features), "rows", sum(f.ids.numel() for f in features), flush=True)
