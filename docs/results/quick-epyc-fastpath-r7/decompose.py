"""One quick-suite prompt decoded by several methods interleaved (``METHOD`` or ``METHOD:K``, K a fixed draft
length, else ``auto``): median wall time, the median speed-up paired repeat by repeat, and per-request means of
steps, drafted and accepted tokens and the seconds drafting and inside the target's forwards.

    python decompose.py rag 5 none,kangaroo,kangaroo:1,kangaroo:0
"""

import statistics
import sys
import time

import torch

import specdecode
from specdecode.data.tasks import load_task

torch.set_num_threads(2)
task, repeats, specs = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(",")
prompt = load_task(task, 1, 0).prompts[0].text
generators = {}
for spec in specs:
    drafter, _, k = spec.partition(":")
    generators[spec] = specdecode.load("smollm2-135m", drafter=drafter, num_draft_tokens=int(k) if k else "auto")
for generator in generators.values():
    generator.generate(prompt, chat=True, max_new_tokens=8)
runs: dict[str, list] = {spec: [] for spec in specs}
for repeat in range(repeats):
    shift = repeat % len(specs)
    for spec in specs[shift:] + specs[:shift]:
        generators[spec].drafter.reset()
        start = time.perf_counter()
        result = generators[spec].generate(prompt, chat=True, max_new_tokens=96, ignore_eos=True)
        runs[spec].append((time.perf_counter() - start, result.stats))
for spec, measured in runs.items():
    paired = [plain / mine for (plain, _), (mine, _) in zip(runs[specs[0]], measured)]
    means = {
        field: statistics.mean(getattr(stats, field) for _, stats in measured)
        for field in ("steps", "drafted_tokens", "accepted_tokens", "draft_s", "forward_s")
    }
    print(
        f"{spec:16s} wall {statistics.median(w for w, _ in measured):.3f} s, paired {statistics.median(paired):.3f}x; "
        + ", ".join(f"{field} {value:.3f}" for field, value in means.items())
    )
