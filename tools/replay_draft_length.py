"""Compare draft-length policies on the quick suite's prompts by replay (see ``specdecode.bench.replay``).

    python tools/replay_draft_length.py --drafter pld --tokens 96
    python tools/replay_draft_length.py --drafter suffix --tokens 256 --cost cost.json

Plain greedy outputs are generated once with our engine (``--drafter none``) and cached in ``--outputs``;
the cost is ``specdecode bench forward-cost --json`` output (default: a forward of 24.9 ms over one token,
growing linearly to 1.27x at eight).  Prints simulated speed-ups over plain decoding.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specdecode.bench.replay import ReplayResult, StepCosts, replay
from specdecode.data.tasks import TASK_NAMES, load_tasks
from specdecode.draft_length.base import FixedLength, HeuristicLength
from specdecode.draft_length.cost_model import CostModel
from specdecode.drafters import create_drafter
from specdecode.generator import SpeculativeGenerator
from specdecode.models.cost import VerificationCosts, linear_curve
from specdecode.models.loading import load_model


def plain_outputs(path: Path, model: str, prompts: int, tokens: int) -> dict[str, list[dict]]:
    """{task: [{id, prompt_ids, output_ids}]}, generated once per (model, prompts, tokens)."""
    if path.exists():
        cached = json.loads(path.read_text())
        if cached["key"] == [model, prompts, tokens]:
            return cached["tasks"]
    generator = SpeculativeGenerator.build(load_model(model), "none")
    data: dict[str, list[dict]] = {}
    for task in load_tasks(TASK_NAMES, prompts):
        for prompt in task.prompts:
            ids = generator.encode_prompt(prompt.text, chat=True)
            result = generator.generate(ids, max_new_tokens=tokens, num_draft_tokens=0)
            data.setdefault(task.name, []).append({"id": prompt.id, "prompt_ids": ids, "output_ids": result.token_ids})
    path.write_text(json.dumps({"key": [model, prompts, tokens], "tasks": data}))
    return data


def step_costs(cost_json: Path | None, draft_ms: float, overhead_ms: float) -> StepCosts:
    if cost_json is None:
        one, curve = 24.9e-3, linear_curve(1.27)
    else:
        t_ms = json.loads(cost_json.read_text())["t_ms"]
        one = t_ms["1"] / 1e3
        curve = tuple(t_ms[str(w)] / t_ms["1"] for w in range(1, len(t_ms) + 1))
    return StepCosts(one, curve, draft_ms / 1e3, overhead_ms / 1e3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--drafter", default="pld")
    parser.add_argument("--prompts-per-task", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=96, help="replay the first N tokens of each output")
    parser.add_argument("--generate-tokens", type=int, default=256, help="length of the cached plain outputs")
    parser.add_argument("--outputs", type=Path, default=Path("/tmp/specdecode-plain-outputs.json"))
    parser.add_argument("--cost", type=Path, help="JSON of `specdecode bench forward-cost --json`")
    parser.add_argument("--draft-ms", type=float, default=0.3)
    parser.add_argument("--overhead-ms", type=float, default=0.5)
    args = parser.parse_args()

    data = plain_outputs(args.outputs, args.model, args.prompts_per_task, args.generate_tokens)
    costs = step_costs(args.cost, args.draft_ms, args.overhead_ms)
    target = load_model(args.model)
    policies = {f"k={k}": (lambda k=k: FixedLength(k)) for k in range(1, 9)}
    policies["heur"] = HeuristicLength
    policies["auto"] = lambda: CostModel(curve=VerificationCosts.of(costs.curve)).fork()
    print(f"{args.drafter}, {args.tokens} tokens: simulated speed-up over plain decoding")
    print(f"{'task':<11}" + "".join(f"{name:>7}" for name in policies) + "  auto/best  auto/worst")
    for task, items in data.items():
        row = {}
        for name, make in policies.items():
            runs: list[ReplayResult] = []
            for item in items:
                drafter = create_drafter(args.drafter, target)
                runs.append(replay(drafter, make(), item["prompt_ids"], item["output_ids"][: args.tokens], costs))
            row[name] = sum(r.plain_seconds for r in runs) / sum(r.seconds for r in runs)
        fixed = [v for n, v in row.items() if n.startswith("k=")]
        print(
            f"{task:<11}"
            + "".join(f"{v:7.2f}" for v in row.values())
            + f"  {row['auto'] / max(fixed):9.3f}  {row['auto'] / min(fixed):10.3f}"
        )


if __name__ == "__main__":
    main()
