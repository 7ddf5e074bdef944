"""Per drafting step of one cold request: step index, depth, accepted, draft ms, probe?, policy estimates."""

import sys

import torch

import specdecode
from specdecode.data.tasks import load_task
from specdecode.draft_length.cost_model import CostModelLength

torch.set_num_threads(2)
model, drafter, task = sys.argv[1], sys.argv[2], sys.argv[3]
extra = {"quantize": sys.argv[4]} if len(sys.argv) > 4 else {}
prompt = load_task(task, 1, 0).prompts[0].text
gen = specdecode.load(model, drafter=drafter, **extra)
gen.generate(prompt, chat=True, max_new_tokens=8)
log = []
original = CostModelLength.observe


def observe(self, step):
    log.append(
        (
            len(log),
            step.depth,
            step.accepted,
            round(step.draft_s * 1e3, 1),
            round(step.verify_s * 1e3, 1),
            self.probing,
            round(self.draft_cost(1) * 1e3, 1) if self.draft_cost.count else None,
        )
    )
    original(self, step)


CostModelLength.observe = observe
for rep in range(2):
    gen.reset_drafter()
    log.clear()
    res = gen.generate(prompt, chat=True, max_new_tokens=96, ignore_eos=True)
    print("request", rep, "steps", len(log))
    for row in log:
        if row[1]:
            step, depth, accepted, draft_ms, verify_ms, probe, fit1 = row
            print(
                f"  step {step} depth {depth} accepted {accepted} draft {draft_ms:.1f} ms verify {verify_ms:.1f} ms"
                f" probe={probe} fit1={fit1}"
            )
