"""Plain vs ``pld`` decoding per weight precision on one code-editing prompt.

Run: ``python docs/results/quantize-kernels/decode.py --model smollm2-135m --out docs/results/quantize-smollm2-135m``.
Per precision: load the model once (``load_model(..., quantize=...)``, what ``specdecode generate --quantize``
does), one warm-up generation, then ``--repeats`` greedy generations of 64 tokens each for plain decoding
and prompt lookup (median tokens/s over the whole call as ``--json`` reports it, and after the prefill); it
checks that ``pld`` gives plain's tokens, and says how many of the first tokens agree with the fp32 model's.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
from pathlib import Path

from specdecode.cli import DEMO_CODE, DEMO_PROMPT_INSTRUCTION
from specdecode.generator import SpeculativeGenerator
from specdecode.models.loading import load_model

PROMPT = DEMO_PROMPT_INSTRUCTION + DEMO_CODE  # `specdecode demo`'s code edit


def agreeing_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows, fp32_tokens = [], None
    for quantize in ("none", "int8", "int4"):
        target = load_model(args.model, quantize=quantize)
        tokens = {}
        for drafter in ("none", "pld"):
            generator = SpeculativeGenerator.build(target, drafter)
            params = dict(chat=True, max_new_tokens=args.max_new_tokens, ignore_eos=True)
            generator.generate(PROMPT, **{**params, "max_new_tokens": 8})  # warm-up
            results = [generator.generate(PROMPT, **params) for _ in range(args.repeats)]
            tokens[drafter] = results[0].token_ids
            stats = [r.stats for r in results]
            rows.append(
                {
                    "quantize": quantize,
                    "drafter": drafter,
                    "tokens_per_s": round(statistics.median(s.tokens_per_s for s in stats), 2),
                    "prefill_s": round(statistics.median(s.prefill_s for s in stats), 3),
                    "decode_tokens_per_s": round(
                        statistics.median(s.new_tokens / (s.wall_s - s.prefill_s) for s in stats), 2
                    ),
                    "mean_accepted_tokens": round(stats[0].mean_accepted_tokens, 2),
                    "same_tokens_every_repeat": all(r.token_ids == tokens[drafter] for r in results),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
        fp32_tokens = fp32_tokens or tokens["none"]
        rows[-1]["pld_equals_plain"] = rows[-2]["pld_equals_plain"] = tokens["pld"] == tokens["none"]
        rows[-1]["tokens_agreeing_with_fp32"] = rows[-2]["tokens_agreeing_with_fp32"] = agreeing_prefix(
            tokens["none"], fp32_tokens
        )
        del target, generator
        gc.collect()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode.json").write_text(json.dumps({"model": args.model, "prompt": PROMPT, "rows": rows}, indent=1))
    lines = [
        f"{args.model}, `specdecode demo`'s code edit, {args.max_new_tokens} tokens, greedy, median of {args.repeats}",
        "",
        "| weights | prefill s | plain tok/s | pld tok/s | pld speed-up | after prefill: plain | pld | "
        "pld = plain | tokens equal to fp32's |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for plain, pld in zip(rows[::2], rows[1::2]):
        lines.append(
            f"| {plain['quantize']} | {plain['prefill_s']:.2f} | {plain['tokens_per_s']:.1f} | "
            f"{pld['tokens_per_s']:.1f} | {pld['tokens_per_s'] / plain['tokens_per_s']:.2f}x | "
            f"{plain['decode_tokens_per_s']:.1f} | {pld['decode_tokens_per_s']:.1f} | {pld['pld_equals_plain']} | "
            f"{plain['tokens_agreeing_with_fp32']} of {args.max_new_tokens} |"
        )
    (out / "decode.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
