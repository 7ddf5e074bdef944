"""``bench quality``'s rows, results.md and quality.png, from the records of results.json alone (a resumed or
partial run reports what it holds)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specdecode.bench.metrics import pooled_counts, tokens_per_step
from specdecode.bench.reporting import closing_line, fmt, pyplot, save_figure, table
from specdecode.data.corpus import BENCH_PROMPTS_SKIPPED

REFERENCE = ("none", "exact")  # plain decoding: the lossless output


def _pooled(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    total = pooled_counts(records)
    wall_s = sum(r["wall_s"] for r in records)
    # The tokens returned: a speculative step may have decoded past a stop string (results from before the
    # stats stopped counting those) and plain decoding, which stops at once, would not have.
    returned = sum(len(r["token_ids"]) for r in records)
    return {
        **total,
        "returned_tokens": returned,
        "wall_s": round(wall_s, 4),
        "tokens_per_s": returned / wall_s if wall_s > 0 else 0.0,
        "mean_accepted_tokens": tokens_per_step(total),
    }


def summarize(results: dict[str, Any], methods: Sequence[str], verifiers: Sequence[str]) -> list[dict[str, Any]]:
    """One row per (method, verifier) with records: pass@1, equality with the lossless output, speed and
    speed-ups over the same method's ``exact`` and over plain decoding, on the problems both have."""
    records = results["records"]
    problems = results["fingerprint"]["problems"]

    def of(method: str, verifier: str) -> dict[str, dict]:
        found = (records.get(f"{method}|{verifier}|{task_id}") for task_id in problems)
        return {r["task_id"]: r for r in found if r is not None}

    plain = of(*REFERENCE)
    rows = []
    for method in methods:
        exact = of(method, "exact")
        for verifier in verifiers if method != REFERENCE[0] else verifiers[:1]:
            mine = of(method, verifier)
            if not mine:
                continue
            pooled = _pooled(list(mine.values()))
            row = {
                "method": method,
                "verifier": verifier,
                "lossless": all(r["lossless"] for r in mine.values()),
                "tasks": len(mine),
                # None when the suite grades nothing (chat): equality with the lossless answer is the measure.
                "passed": _graded(mine.values()),
                "pass_at_1": None if _graded(mine.values()) is None else _graded(mine.values()) / len(mine),
                **pooled,
            }
            shared = [t for t in mine if t in plain]
            same = sum(mine[t]["token_ids"] == plain[t]["token_ids"] for t in shared)
            row["same_as_lossless"] = same / len(shared) if shared else None
            for label, reference in (("speedup_vs_exact", exact), ("speedup_vs_plain", plain)):
                shared = [t for t in mine if t in reference]
                base = _pooled([reference[t] for t in shared])["tokens_per_s"] if shared else 0.0
                here = _pooled([mine[t] for t in shared])["tokens_per_s"] if shared else 0.0
                row[label] = here / base if base else None
            # Tokens/s flatters a relaxed verifier whose answers run longer; the time to the same answers does not.
            shared = [t for t in mine if t in exact]
            exact_s = sum(exact[t]["wall_s"] for t in shared)
            mine_s = sum(mine[t]["wall_s"] for t in shared)
            row["answer_time_vs_exact"] = exact_s / mine_s if shared and mine_s > 0 else None
            rows.append(row)
    return rows


def _graded(records: Any) -> int | None:
    passed = [r.get("passed") for r in records]
    return None if any(p is None for p in passed) else sum(passed)


def _suite_text(s: dict[str, Any], n: int) -> tuple[str, str, str]:
    """(title, what was measured and how it was graded, the metric's column name) of the run's suite."""
    suite = s.get("dataset", "humaneval")
    if suite == "champ":
        return (
            "CHAMP math problems",
            f"{n} CHAMP problems with a numeric reference answer (seeded subset, seed {s['seed']}), asked through "
            "the chat template to reason step by step and state the final answer. Answer accuracy: the last number "
            "the model wrote equals one of the reference answer's.",
            "answer accuracy",
        )
    if suite == "chat":
        return (
            "chat prompts",
            f"{n} MT-Bench and ShareGPT openings (seeded subset, seed {s['seed']}), through the chat template; not "
            "graded: equality with the lossless answer is the measure.",
            "graded",
        )
    return (
        "HumanEval",
        f"{n} of HumanEval's 164 problems (seeded subset, seed {s['seed']}; problem ids in results.json). The model "
        "is asked for the function through its chat template, its answer begun with a code fence (without a "
        "template: the problem's code, continued to the Codex stop strings). Every completion ran against the "
        f"problem's tests in a child process ({s['timeout_s']} s, {s['memory_mb']} MB). pass@1: problems whose one "
        "completion passed.",
        "pass@1",
    )


def _weights(settings: dict[str, Any]) -> str:
    """`` (bf16 weights)`` and the like for a quantized target (older results have no ``quantize``)."""
    quantize = settings.get("quantize", "none")
    return "" if quantize == "none" else f" ({quantize} weights)"


def markdown(results: dict[str, Any]) -> str:
    """results.md: the trade-off table, what it measured, and on what."""
    s, rows = results["settings"], results.get("rows", [])
    n = len(results["fingerprint"]["problems"])
    sampling = "greedy" if not s["temperature"] else f"temperature {s['temperature']} (seed {s['seed']})"
    title, graded, metric = _suite_text(s, n)
    lines = [
        f"# Relaxed verification: speed against quality on {title}, `{s['model']}`{_weights(s)}",
        "",
        f"{graded} {sampling.capitalize()}, up to {s['max_new_tokens']} new tokens. Same as lossless: answers token "
        "for token equal to plain decoding's (every `exact` row must show all). Speed-ups are of pooled tokens/s on "
        "the same problems; answer time vs exact is the same drafter's summed seconds under `exact` over this "
        "row's, on the same problems (a verifier whose answers run longer gains tokens/s, not time); mean accepted "
        "tokens count the target's own token per step. The problems are drawn from the whole set: a drafter "
        "trained with `specdecode train` may have trained on some (it draws each task's prompts after the "
        f"benchmark's first {BENCH_PROMPTS_SKIPPED}).",
        "",
        *table(
            [
                "drafter",
                "verifier",
                "lossless",
                metric,
                "same as lossless",
                "tokens/s",
                "vs exact (same drafter)",
                "answer time vs exact",
                "vs plain",
                "mean accepted tokens / step",
            ],
            (
                [
                    f"`{r['method']}`",
                    f"`{r['verifier']}`",
                    "yes" if r["lossless"] else "**no**",
                    "–" if r["pass_at_1"] is None else f"{100 * r['pass_at_1']:.1f}% ({r['passed']}/{r['tasks']})",
                    fmt(None if r["same_as_lossless"] is None else 100 * r["same_as_lossless"], ".0f", "%"),
                    fmt(r["tokens_per_s"], ".1f"),
                    fmt(r["speedup_vs_exact"], ".2f", "x"),
                    fmt(r.get("answer_time_vs_exact"), ".2f", "x"),
                    fmt(r["speedup_vs_plain"], ".2f", "x"),
                    fmt(r["mean_accepted_tokens"]),
                ]
                for r in rows
            ),
        ),
        "",
        "Relaxed verifiers (`lossless` no) keep some draft tokens the target would not have produced: their "
        f"{metric} and equality columns are what that costs. Verifier options are in the spec (see "
        "`specdecode verifiers` and each verifier's options class in `specdecode/verify/`).",
        "",
        closing_line(results),
        "",
    ]
    return "\n".join(lines)


def plot_tradeoff(rows: Sequence[dict[str, Any]], path: Path, title: str, metric: str = "HumanEval pass@1") -> None:
    """Speed-up over plain decoding against pass@1 (left) and against equality with the lossless output (right):
    one colour per drafter, each point named by its verifier."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    colours = {m: plt.get_cmap("tab10")(i % 10) for i, m in enumerate(methods)}
    for ax, key, label in (
        (axes[0], "pass_at_1", metric),
        (axes[1], "same_as_lossless", "same as lossless"),
    ):
        for r in rows:
            if r.get("speedup_vs_plain") is None or r.get(key) is None:
                continue
            x, y = r["speedup_vs_plain"], 100 * r[key]
            ax.scatter([x], [y], color=colours[r["method"]], marker="o" if r["lossless"] else "^")
            ax.annotate(f"{r['method']} {r['verifier']}", (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
        ax.axvline(1.0, color="black", linewidth=0.6)
        ax.set_ylim(-3, 103)
        ax.set_xlabel("speed-up over plain decoding (tokens/s)")
        ax.set_ylabel(f"{label} (%)")
    axes[0].set_title("circles: exact (lossless), triangles: relaxed (lossy)", fontsize=8)
    fig.suptitle(title)
    save_figure(fig, path)


def write_report(results: dict[str, Any], out: Path) -> None:
    (out / "results.md").write_text(markdown(results))
    if results.get("rows"):
        name, _, metric = _suite_text(results["settings"], len(results["fingerprint"]["problems"]))
        title = f"Relaxed verification on {name}: {results['settings']['model']}{_weights(results['settings'])}"
        plot_tradeoff(results["rows"], out / "quality.png", title, metric)
