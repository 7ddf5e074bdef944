"""Time bf16 layers: the bf16 panel kernel (``kernels/bf16_panel_linear.cpp``) against oneDNN's bf16 product and our
fp32 panel product, per call and in the serving workload.

- per call: the model's projection shapes and LM head at 1, 8, 32 and 128 rows (the mean of 50-200 calls after five);
- the serving workload offline (``bench serve``'s quick prompts) on the model with ``--quantize bf16``: tokens per
  second of ``pld`` (two passes after an untimed one) and of plain decoding, at C = 1 and 8, and whether every output
  of the two is the same.

    python tools/measure_bf16_layers.py --model smollm2-135m --out docs/results/DIR/bf16-layers.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from serving_workload import pld_engine, quick_prompts, serve_offline

from specdecode.config import GenerationConfig
from specdecode.models.cpu_kernels import bf16_panel_linear, pack_bf16_panels, pack_panels, panel_linear
from specdecode.models.loading import load_model
from specdecode.models.quantized_layers import _packed_bf16_call


def _mean_us(repeats: int, call, *args) -> float:
    for _ in range(5):
        call(*args)
    started = time.perf_counter()
    for _ in range(repeats):
        call(*args)
    return round((time.perf_counter() - started) / repeats * 1e6, 1)


def per_call(shapes: list[tuple[int, int]]) -> list[dict]:
    results = []
    for outputs, inputs in shapes:
        weight = torch.randn(outputs, inputs, generator=torch.Generator().manual_seed(outputs)) * 0.05
        panels, fp32_panels = pack_bf16_panels(weight), pack_panels(weight)
        onednn = torch.ops.mkldnn._reorder_linear_weight(weight.to(torch.bfloat16), None)
        repeats = 50 if outputs > 10_000 else 200
        for rows in (1, 8, 32, 128):
            x = torch.randn(rows, inputs).to(torch.bfloat16)
            wide = x.float()
            results.append(
                {
                    "outputs": outputs,
                    "inputs": inputs,
                    "rows": rows,
                    "kernel_us": _mean_us(repeats, bf16_panel_linear, x, panels),
                    "onednn_bf16_us": _mean_us(repeats, _packed_bf16_call, onednn, x),
                    "fp32_panels_us": _mean_us(repeats, panel_linear, wide, fp32_panels, None),
                }
            )
            print(results[-1], flush=True)
    return results


def workload(model: str) -> list[dict]:
    target = load_model(model, quantize="bf16")
    encoded, max_new_tokens = quick_prompts(target, model)
    results = []
    for concurrency in (1, 8):
        engine = pld_engine(target, 16)
        drafting = GenerationConfig(max_new_tokens=max_new_tokens)
        serve_offline(engine, encoded, drafting, concurrency)  # caches and cost curves warm
        passes = [serve_offline(engine, encoded, drafting, concurrency) for _ in range(2)]
        plain = GenerationConfig(max_new_tokens=max_new_tokens, num_draft_tokens=0)
        undrafted = serve_offline(engine, encoded, plain, concurrency)
        results.append(
            {
                "concurrency": concurrency,
                "pld_tokens_per_s": [round(each.tokens_per_s, 1) for each in passes],
                "plain_tokens_per_s": round(undrafted.tokens_per_s, 1),
                "pld_equals_plain": passes[-1].outputs == undrafted.outputs,
            }
        )
        print(results[-1], flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    config = load_model(args.model).backend.model.config
    hidden, inner, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    record = {
        "model": args.model,
        "threads": torch.get_num_threads(),
        "per_call": per_call([(hidden, hidden), (inner, hidden), (hidden, inner), (vocab, hidden)]),
        "workload": workload(args.model),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
