"""Target greedy outputs for 50 ShareGPT openings that mention python (in dataset order)."""

import json
import re
import sys
import time
from pathlib import Path

from specdecode.data.datasets import sharegpt_prompts, sharegpt_records
from specdecode.generator import SpeculativeGenerator
from specdecode.models.loading import load_model

out = Path(sys.argv[1])
quant = sys.argv[2] if len(sys.argv) > 2 else None
prompts = [p for p in sharegpt_prompts(sharegpt_records()) if re.search(r"\bpython\b", p.text, re.I)]
print(len(prompts), "python prompts", flush=True)
target = load_model("qwen2.5-coder-1.5b", quantize=quant) if quant else load_model("qwen2.5-coder-1.5b")
gen = SpeculativeGenerator.build(target, "none")
done = json.loads(out.read_text()) if out.exists() else []
for p in prompts[len(done) : 60]:
    ids = gen.encode_prompt(p.text, chat=None)
    if len(ids) > 400:
        continue
    t = time.time()
    r = gen.generate(ids, max_new_tokens=128)
    done.append({"id": p.id, "prompt_ids": ids, "token_ids": r.token_ids, "s": time.time() - t})
    out.write_text(json.dumps(done))
    print(len(done), p.id, len(ids), round(time.time() - t, 1), flush=True)
