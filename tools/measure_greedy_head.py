"""Time a model's greedy choices through the greedy head (``models/greedy_head.py``) and through its full fp32 LM head.

In one process, the two alternated: the head alone on the final hidden states of a real text (1 to 128 rows; the
fastest of three rounds' means), how many tokens per row fall within the kernel's bound (computed here in float64 from
the bf16-rounded rows), then the serving workload offline (every ``bench serve`` quick prompt, 2 per task, through a
fresh ``BatchEngine``, C in flight, up to 96 tokens each; tokens per second, two alternated runs each way, every
output compared) for plain decoding and ``pld`` at C = 1 and 8.

    python tools/measure_greedy_head.py --model smollm2-135m --out docs/results/DIR/greedy-head.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from serving_workload import pld_engine, quick_prompts, serve_offline

from specdecode.config import GenerationConfig
from specdecode.models.cpu_kernels import unpack_panels
from specdecode.models.greedy_head import GreedyHead
from specdecode.models.loading import load_model
from specdecode.sampling import argmax_last

ROWS = (1, 4, 8, 16, 32, 64, 128)
WAYS = ("full head", "greedy head")


def call_ms(function, x: torch.Tensor) -> float:
    means = []
    for _ in range(3):
        function(x)
        started = time.perf_counter()
        for _ in range(20):
            function(x)
        means.append((time.perf_counter() - started) / 20 * 1000)
    return round(min(means), 3)


def within_bound(greedy: GreedyHead, hidden: torch.Tensor) -> list[int]:
    """Tokens per row whose bf16 logit's bound reaches the largest lower bound (the ones the kernel recomputes)."""
    weight = unpack_panels(greedy.panels)
    approx = hidden.bfloat16().double() @ weight.bfloat16().double().T
    bound = greedy.scale * hidden.double().norm(dim=1, keepdim=True) * greedy.norms.double()[None]
    lowest = (approx - bound).max(dim=1, keepdim=True).values
    return (approx + bound >= lowest).sum(dim=1).tolist()


def workload(target, encoded: list, drafter: str, concurrency: int, max_new_tokens: int) -> tuple[float, list]:
    """Tokens per second of one pass over every prompt through a fresh engine, and every request's tokens."""
    draft = {} if drafter == "pld" else {"num_draft_tokens": 0}
    config = GenerationConfig(max_new_tokens=max_new_tokens, **draft)
    done = serve_offline(pld_engine(target, 16), encoded, config, concurrency)
    return round(done.tokens_per_s, 1), sorted(done.outputs.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    target = load_model(args.model)
    backend = target.backend
    head = backend.lm_head()
    greedy = backend._greedy_head()
    if greedy is None:
        raise SystemExit("the greedy head does not apply to this model here (fp32 panel head, AVX512_BF16)")

    def use(way: str) -> None:  # the backend's greedy head, or none (every request then reads the full logits)
        backend._greedy = (head, greedy if way == "greedy head" else None)

    text = Path(__file__).resolve().parents[1].joinpath("README.md").read_text()
    ids = target.tokenizer(text, return_tensors="pt").input_ids[0, : max(ROWS)]
    with torch.inference_mode():
        hidden = backend.forward(ids, backend.new_cache(), hidden_layers=(backend.num_layers,)).hidden
        assert greedy(hidden).tolist() == argmax_last(head(hidden))
        calls = {
            rows: {
                "full head": call_ms(lambda x: argmax_last(head(x)), hidden[:rows].contiguous()),
                "greedy head": call_ms(greedy, hidden[:rows].contiguous()),
            }
            for rows in ROWS
        }
        counts = within_bound(greedy, hidden)
    encoded, max_new_tokens = quick_prompts(target, args.model)
    served: dict[str, dict[str, list[float]]] = {}
    identical = True
    for drafter, concurrency in (("none", 1), ("pld", 1), ("none", 8), ("pld", 8)):
        cell, reference = {way: [] for way in WAYS}, None
        for _ in range(2):
            for way in WAYS:
                use(way)
                rate, outputs = workload(target, encoded, drafter, concurrency, max_new_tokens)
                cell[way].append(rate)
                identical = identical and (reference is None or outputs == reference)
                reference = outputs
        served[f"{drafter}, C={concurrency}"] = cell
        print(drafter, concurrency, cell, flush=True)
    use("greedy head")
    record = {
        "model": args.model,
        "threads": torch.get_num_threads(),
        "head_call_ms": calls,
        "tokens_within_bound_per_row": {
            "rows": len(counts),
            "mean": round(sum(counts) / len(counts), 2),
            "max": max(counts),
        },
        "workload_tokens_per_s": served,
        "every_output_identical": identical,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
