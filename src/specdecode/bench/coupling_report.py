"""``bench coupling``'s rows and results.md, from its per-prompt records and results JSON alone."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from specdecode.bench.metrics import pooled_counts, tokens_per_step
from specdecode.bench.reporting import closing_line, fmt, table

REFERENCE = "none"  # plain decoding: its coupled outputs are what every coupled output must equal


def summarize_row(method: str, verifier: str, keys: Sequence[str], records: Sequence[dict], reference: dict) -> dict:
    """One (method, verifier) row: pooled acceptance and speed, and equality with plain coupled decoding."""
    total = pooled_counts(records)
    wall_s = sum(r["wall_s"] for r in records)
    same = [reference[key] == r["token_ids"] for key, r in zip(keys, records)]
    return {
        "method": method,
        "verifier": verifier,
        **total,
        "wall_s": round(wall_s, 4),
        "mean_accepted_tokens": tokens_per_step(total),
        "acceptance_rate": total["accepted_tokens"] / total["drafted_tokens"] if total["drafted_tokens"] else None,
        "tokens_per_s": total["new_tokens"] / wall_s if wall_s > 0 else 0.0,
        "equal_to_plain_coupled": sum(same) / len(same),
        "per_prompt": [
            {"prompt": key, **{k: v for k, v in r.items() if k != "token_ids"}, "equal_to_plain_coupled": s}
            for key, r, s in zip(keys, records, same)
        ],
    }


def markdown(results: dict[str, Any]) -> str:
    """results.md, from the results JSON alone."""
    s = results["settings"]
    rows = results["rows"]
    plain = {r["verifier"]: r["tokens_per_s"] for r in rows if r["method"] == REFERENCE}
    lines = [
        f"# Coupled vs rejection sampling: `{s['model']}`",
        "",
        f"{len(results['prompts'])} prompts ({', '.join(s['tasks'])}), temperature {s['temperature']}, "
        f"top-p {s.get('top_p', 1.0)}, seed "
        f"{s['seed']}, up to {s['max_new_tokens']} new tokens (EOS ends a decode), default draft lengths unless "
        "a method says `k=`. Every method decodes every prompt twice from a cold drafter with the same seed: "
        "Gumbel-max coupled (the default for seeded sampling, drafter-invariant) and rejection sampling "
        "(`--no-coupled`). Mean accepted tokens count the target's own token per step (plain decoding: 1.00).",
        "",
        *table(
            [
                "method",
                "verifier",
                "mean accepted tokens / step",
                "draft acceptance rate",
                "tokens/s",
                "over plain (same verifier)",
                "same tokens as plain coupled",
            ],
            (
                [
                    f"`{r['method']}`",
                    r["verifier"],
                    fmt(r["mean_accepted_tokens"]),
                    fmt(None if r["acceptance_rate"] is None else 100 * r["acceptance_rate"], ".1f", "%"),
                    fmt(r["tokens_per_s"], ".1f"),
                    fmt(r["tokens_per_s"] / plain[r["verifier"]] if plain.get(r["verifier"]) else None, ".2f", "x"),
                    f"{round(r['equal_to_plain_coupled'] * len(r['per_prompt']))}/{len(r['per_prompt'])}",
                ]
                for r in rows
            ),
        ),
        "",
        "Coupled rows must equal plain coupled decoding on every prompt (drafter invariance); rejection "
        "sampling draws other (equally exact) samples, so its text differs.",
        "",
        closing_line(results),
        "",
    ]
    return "\n".join(lines)
