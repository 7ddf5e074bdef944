"""``bench adapt``'s summary, results.md and adapt.png, from results.json alone."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from specdecode.bench.reporting import fmt, pyplot, save_figure, table, write_markdown_and_plot

#: Requests at each end of the run that are compared (first N against last N).
EDGE = 10


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _pooled_speed(records: Sequence[Mapping[str, Any]]) -> float | None:
    """Total tokens over total time (adaptation included): one request's speed does not outweigh another's."""
    wall = sum(r["wall_s"] for r in records)
    return sum(r["new_tokens"] for r in records) / wall if wall > 0 else None


def _ends(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    first, last = records[:EDGE], records[-EDGE:] if len(records) >= 2 * EDGE else []
    first_mat = _mean([r["mean_accepted_tokens"] for r in first])
    last_mat = _mean([r["mean_accepted_tokens"] for r in last])
    return {
        "requests": len(records),
        "first_mean_accepted": first_mat,
        "last_mean_accepted": last_mat,
        "last_over_first": last_mat / first_mat if first_mat and last_mat else None,
        "first_tokens_per_s": _pooled_speed(first),
        "last_tokens_per_s": _pooled_speed(last) if last else None,
        "tokens_per_s": _pooled_speed(records),
        "mean_accepted": _mean([r["mean_accepted_tokens"] for r in records]),
    }


def paired_ratios(records: Mapping[str, Sequence[Mapping[str, Any]]]) -> list[float]:
    """Adapted over frozen mean accepted tokens, request by request: the problems' own difficulty cancels out."""
    pairs = zip(records["frozen"], records["adapted"])
    return [a["mean_accepted_tokens"] / f["mean_accepted_tokens"] for f, a in pairs]


def summarize(results: Mapping[str, Any]) -> dict[str, Any]:
    """Per arm: the first and last :data:`EDGE` requests (the last only once there are 2 x EDGE); whether
    every adapted output equals the frozen one; what adapting cost."""
    records = results["records"]
    frozen, adapted = records["frozen"], records["adapted"]
    pairs = list(zip(frozen, adapted))
    different = [f["task_id"] for f, a in pairs if f["token_ids"] != a["token_ids"]]
    train_s = adapted[-1]["adapter_train_s"] if adapted else 0.0
    adapted_wall = sum(r["wall_s"] for r in adapted)
    ratios = paired_ratios(records)
    return {
        "arms": {arm: _ends(records[arm]) for arm in ("frozen", "adapted")},
        "paired_ratio_first": _mean(ratios[:EDGE]),
        "paired_ratio_last": _mean(ratios[-EDGE:]) if len(ratios) >= 2 * EDGE else None,
        "paired_ratio": _mean(ratios),
        "compared": len(pairs),
        "identical": len(pairs) - len(different),
        "different": different,
        "adapter_steps": adapted[-1]["adapter_steps"] if adapted else 0,
        # Requests the adapter drafted, the base weights the rest (the prequential check); None in older results.
        "adapter_drafted": sum(r["adapter_drafted"] for r in adapted)
        if all("adapter_drafted" in r for r in adapted)
        else None,
        "adapter_train_s": train_s,
        "train_share": train_s / adapted_wall if adapted_wall > 0 else None,
    }


def domain(settings: Mapping[str, Any]) -> str:
    """The requests' domain in words: "humaneval problems", or "ShareGPT openings on 'python'"."""
    if settings["task"] == "sharegpt":
        return f"ShareGPT openings on {settings.get('topic', 'python')!r}"
    return f"{settings['task']} problems"


def markdown(results: Mapping[str, Any]) -> str:
    s, settings, env = results["summary"], results["settings"], results["environment"]
    arms = s["arms"]
    rows = [
        [
            arm,
            str(a["requests"]),
            fmt(a["first_mean_accepted"]),
            fmt(a["last_mean_accepted"]),
            fmt(a["last_over_first"], ".3f"),
            fmt(a["first_tokens_per_s"]),
            fmt(a["last_tokens_per_s"]),
            fmt(a["tokens_per_s"]),
        ]
        for arm, a in arms.items()
    ]
    header = ["drafter", "requests", f"mean accepted, first {EDGE}", f"last {EDGE}", "last / first"]
    header += [f"tok/s first {EDGE}", f"tok/s last {EDGE}", "tok/s all"]
    lossless = (
        f"every adapted output equals the frozen one ({s['identical']} of {s['compared']} requests)"
        if not s["different"]
        else f"**adapted outputs differ from frozen ones** on {', '.join(s['different'])}"
    )
    mapping = settings["vocab_mapping"] or "none"
    drafted = (
        f"; the adapter drafted {s['adapter_drafted']} of {s['compared']} requests, the base weights the rest"
        if s.get("adapter_drafted") is not None
        else ""
    )
    target, draft = (
        f"{settings[name]} ({'fp32' if settings.get(flag, 'none') == 'none' else settings[flag]} weights)"
        for name, flag in (("model", "quantize"), ("draft_model", "quantize_draft"))
    )
    lines = [
        "# bench adapt",
        "",
        f"`{draft}` drafting for `{target}` (vocab_mapping {mapping}), the first "
        f"{settings['requests']} {domain(settings)} in order, greedy, up to {settings['max_new_tokens']} new "
        f"tokens, draft length {settings['num_draft_tokens']}; adapted: adapt_budget {settings['adapt_budget']}, "
        f"at most {settings['adapt_steps']} steps per request, learning rate {settings['adapt_lr'] or 1e-3}. Tokens/s "
        "count the whole call, training included.",
        "",
        *table(header, rows),
        "",
        f"- Lossless: {lossless}.",
        "- Adapted over frozen, mean accepted tokens, the mean of per-request ratios: "
        f"first {EDGE} {fmt(s['paired_ratio_first'], '.3f')}x, last {EDGE} {fmt(s['paired_ratio_last'], '.3f')}x, "
        f"all {fmt(s['paired_ratio'], '.3f')}x.",
        f"- Adaptation: {s['adapter_steps']} optimizer steps, {fmt(s['adapter_train_s'], '.1f')} s of training, "
        f"{fmt(100 * s['train_share'] if s['train_share'] is not None else None, '.1f')}% of the adapted drafter's "
        f"wall time{drafted}.",
        f"- Machine: {env.get('cpu')}, {env.get('cores')} cores, threads {env.get('threads') or 'governed'}; "
        f"load average {env.get('load_average_start')} at the start, {env.get('load_average_end')} at the end.",
        "",
    ]
    return "\n".join(lines)


def plot(results: Mapping[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, (ax, below) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True, height_ratios=(2, 1))
    records = results["records"]
    for arm, style in (("frozen", "o-"), ("adapted", "s-")):
        values = [r["mean_accepted_tokens"] for r in records[arm]]
        ax.plot(range(1, len(values) + 1), values, style, markersize=3, linewidth=1, label=arm)
    ratios = paired_ratios(records)
    below.plot(range(1, len(ratios) + 1), ratios, "k.-", markersize=3, linewidth=0.8)
    below.axhline(1.0, color="grey", linewidth=0.8)
    settings = results["settings"]
    below.set_xlabel(f"request ({domain(settings)}, in order)")
    ax.set_ylabel("mean accepted tokens per step")
    below.set_ylabel("adapted / frozen")
    ax.set_title(f"{settings['draft_model']} → {settings['model']}: online adaptation")
    for axis in (ax, below):
        axis.grid(alpha=0.3)
    ax.legend()
    save_figure(fig, path)


def write_report(results: Mapping[str, Any], out: Path) -> None:
    write_markdown_and_plot(results, out, markdown, plot, "adapt.png")
