"""Where a cold request's drafting loss goes: per drafting step its widths and seconds, and the totals against
plain steps' mean (one request after a warm-up, the drafter reset), plus the policy's loss-budget view."""

import statistics
import sys

import torch

import specdecode
from specdecode.data.tasks import load_task
from specdecode.draft_length.cost_model import CostModelLength

torch.set_num_threads(2)
model, drafter, task, quant = sys.argv[1:5]
prompt = load_task(task, 1, 0).prompts[0].text
gen = specdecode.load(model, drafter=drafter, quantize=quant)
gen.generate(prompt, chat=True, max_new_tokens=8)
steps = []
original = CostModelLength.observe


def observe(self, step):
    steps.append(
        (
            step.depth,
            step.nodes,
            step.accepted,
            step.draft_s,
            step.verify_s,
            step.overhead_s,
            self.probing,
            self.net_saved_s,
            self.elapsed_s,
        )
    )
    original(self, step)


CostModelLength.observe = observe
for rep in range(3):
    gen.reset_drafter()
    steps.clear()
    res = gen.generate(prompt, chat=True, max_new_tokens=64, ignore_eos=True)
    plain_v = [s[4] for s in steps if s[0] == 0]
    mean_plain = statistics.mean(plain_v)
    print(
        f"request {rep}: {len(steps)} steps, plain verify mean {mean_plain * 1e3:.1f} ms, wall {res.stats.wall_s:.2f} s"
    )
    extra = 0.0
    for i, (d, n, a, ds, vs, _overhead, probe, saved, el) in enumerate(steps):
        if d:
            cost = ds + vs - (a + 1) * mean_plain
            extra += cost
            print(
                f"  step {i} depth {d} nodes {n} acc {a} draft {ds * 1e3:.1f} verify {vs * 1e3:.1f} ms probe={probe}"
                f" net loss {cost * 1e3:+.1f} ms; budget net_saved {saved * 1e3:+.0f} ms of {el:.2f} s"
            )
    print(f"  drafting steps' net loss {extra * 1e3:+.0f} ms")
