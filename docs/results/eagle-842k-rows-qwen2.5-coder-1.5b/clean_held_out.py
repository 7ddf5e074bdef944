"""Held-out top-1 acceptance of two EAGLE heads on the held-out sequences neither trained on (index >= 920)."""

import argparse
import sys
from pathlib import Path

import torch

from specdecode.heads.eagle import default_aux_layers
from specdecode.heads.storage import load_eagle
from specdecode.models.loading import load_model
from specdecode.train.cli import DEFAULT_TASKS
from specdecode.train.common import target_views, trainable_embed
from specdecode.train.eagle import held_out_acceptance, make_windows
from specdecode.train.features import target_features, work_dir

M = Path.home() / ".cache/specdecode/models/qwen2.5-coder-1.5b"
target = load_model("qwen2.5-coder-1.5b")
args = argparse.Namespace(prompts=320, new_tokens=128, conversations=1600, max_tokens=512, seed=0)
writer = load_model("qwen2.5-coder-1.5b", dtype=torch.bfloat16)
features = target_features(
    writer,
    args,
    DEFAULT_TASKS.split(","),
    work_dir(M / "eagle-head-big"),
    default_aux_layers(target.backend.num_layers),
)
del writer
# The split as the trainer of e09ac2a drew it (a seeded permutation; later trainers split by a hash of each sequence).
order = torch.randperm(len(features), generator=torch.Generator().manual_seed(0)).tolist()
held = order[: max(1, round(0.05 * len(order)))]
fresh = [features[i] for i in held if i >= 920]
print(f"held-out sequences {len(held)}, of them new data {len(fresh)} ({sum(f.ids.numel() for f in fresh)} tokens)")
backend, layerwise = target_views(target.backend, "eagle")
windows = make_windows(fresh, 256, 3)
embed = trainable_embed(backend)
for name in sys.argv[1:]:
    head = load_eagle(M / name, backend.num_layers)
    head.eval()
    acc = held_out_acceptance(head, layerwise, embed, windows, 8)
    print(name, " ".join(f"{a:.1%}" for a in acc), flush=True)
