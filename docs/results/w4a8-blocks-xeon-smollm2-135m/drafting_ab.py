"""The shipped Hydra heads on open chat with their blocks in fp32, int8 and w4a8 (the LM head in the default kernel in
every variant): drafting time a step (the sessions' ``propose``), tokens a step and wall time against plain decoding,
the variants and plain decoding taking turns over the same 16 prompts, two rounds."""

import collections
import json
import re
import sys
import time

import torch

import specdecode
from specdecode.data.tasks import load_tasks
from specdecode.drafters import medusa
from specdecode.heads import storage
from specdecode.models.quantized_layers import Int8Linear

drafting = collections.Counter()
running = ["plain"]
propose = medusa.HeadsSession.propose


def timed_propose(self, *args, **kwargs):
    started = time.perf_counter()
    draft = propose(self, *args, **kwargs)
    drafting[running[0]] += time.perf_counter() - started
    return draft


medusa.HeadsSession.propose = timed_propose
default_blocks, default_round = storage.BLOCK_LAYERS, storage._round_drafting_layers


def load(blocks: str):
    storage.BLOCK_LAYERS = default_blocks if blocks == "w4a8" else re.compile("(?!)")  # fp32, int8: not rounded here

    def round_layers(head):
        default_round(head)
        for block in getattr(head, "blocks", []) if blocks == "int8" else []:
            block.layers[0] = Int8Linear(block.layers[0], tied=False)

    storage._round_drafting_layers = round_layers
    generator = specdecode.load("smollm2-135m", "hydra", quantize="bf16", max_new_tokens=96)
    storage.BLOCK_LAYERS, storage._round_drafting_layers = default_blocks, default_round
    return generator


generators = {blocks: load(blocks) for blocks in ("fp32", "int8", "w4a8")}
generators["plain"] = specdecode.load("smollm2-135m", "none", quantize="bf16", max_new_tokens=96)
kernels = {
    name: type(g.drafter.heads.blocks[0].layers[0]).__name__ for name, g in generators.items() if name != "plain"
}
first = generators["plain"]
prompts = [
    first.encode_prompt(p.text, chat=True) for task in load_tasks(("mt-bench", "sharegpt"), 8) for p in task.prompts
]
for generator in generators.values():
    generator.generate(prompts[0])  # warm: kernels built, cost curve measured
drafting.clear()
steps, seconds = collections.Counter(), collections.Counter()
for _ in range(2):
    for name, generator in generators.items():
        running[0] = name
        started = time.perf_counter()
        for ids in prompts:
            steps[name] += generator.generate(ids).stats.steps
        seconds[name] += time.perf_counter() - started
tokens = steps["plain"]  # plain decoding's steps are its tokens
rows = {
    name: {
        "blocks": kernels.get(name, "-"),
        "steps": steps[name],
        "tokens_per_step": round(tokens / steps[name], 3),
        "ms_per_step": round(seconds[name] / steps[name] * 1000, 2),
        "drafting_ms_per_step": round(drafting[name] / steps[name] * 1000, 3),
        "speedup": round(seconds["plain"] / seconds[name], 3),
    }
    for name in generators
}
json.dump({"threads": torch.get_num_threads(), "rows": rows}, sys.stdout, indent=1)
print()
