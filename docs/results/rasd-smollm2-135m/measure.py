"""Mean accepted tokens per step (tokens per target forward) of pld, suffix and rasd on the `complete` task: greedy,
every output the target's own, so the figure does not depend on the machine's load.

    python docs/results/rasd-smollm2-135m/measure.py > docs/results/rasd-smollm2-135m/acceptance.txt
"""

import sysconfig

from specdecode.data.tasks import load_task
from specdecode.generator import SpeculativeGenerator
from specdecode.models.loading import load_model

model = load_model("smollm2-135m")
prompts = [p.text for p in load_task("complete", 4).prompts]
datastore = sysconfig.get_paths()["stdlib"] + "/asyncio"
methods = [
    ("pld", {}),
    ("suffix", {}),
    ("rasd", {"datastore": datastore}),
    ("rasd", {"datastore": datastore, "with": "suffix"}),
    ("rasd", {"datastore": datastore, "with": "none"}),
]
for name, options in methods:
    generator = SpeculativeGenerator.build(model, name, **options)
    results = [generator.generate(p, chat=True, max_new_tokens=96) for p in prompts]
    steps = sum(r.stats.steps for r in results)
    tokens = sum(r.stats.new_tokens for r in results)
    per_prompt = [round(r.stats.mean_accepted_tokens, 2) for r in results]
    print(name, options.get("with"), "tokens/step", round(tokens / steps, 3), per_prompt, flush=True)
