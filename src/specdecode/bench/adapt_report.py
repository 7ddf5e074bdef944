"""``bench adapt``'s summary, results.md and adapt.png, from results.json alone."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from specdecode.bench.markdown import table

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


def summarize(results: Mapping[str, Any]) -> dict[str, Any]:
    """Per arm: the first and last :data:`EDGE` requests (the last only once there are 2 x EDGE); whether
    every adapted output equals the frozen one; what adapting cost."""
    records = results["records"]
    frozen, adapted = records["frozen"], records["adapted"]
    pairs = list(zip(frozen, adapted))
    different = [f["task_id"] for f, a in pairs if f["token_ids"] != a["token_ids"]]
    train_s = adapted[-1]["adapter_train_s"] if adapted else 0.0
    adapted_wall = sum(r["wall_s"] for r in adapted)
    return {
        "arms": {arm: _ends(records[arm]) for arm in ("frozen", "adapted")},
        "compared": len(pairs),
        "identical": len(pairs) - len(different),
        "different": different,
        "adapter_steps": adapted[-1]["adapter_steps"] if adapted else 0,
        "adapter_train_s": train_s,
        "train_share": train_s / adapted_wall if adapted_wall > 0 else None,
    }


def _num(value: float | None, digits: int = 2) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def markdown(results: Mapping[str, Any]) -> str:
    s, settings, env = results["summary"], results["settings"], results["environment"]
    arms = s["arms"]
    rows = [
        [
            arm,
            str(a["requests"]),
            _num(a["first_mean_accepted"]),
            _num(a["last_mean_accepted"]),
            _num(a["last_over_first"], 3),
            _num(a["first_tokens_per_s"]),
            _num(a["last_tokens_per_s"]),
            _num(a["tokens_per_s"]),
        ]
        for arm, a in arms.items()
    ]
    header = ["drafter", "requests", f"mean accepted, first {EDGE}", f"last {EDGE}", "last / first"]
    header += [f"tok/s first {EDGE}", f"tok/s last {EDGE}", "tok/s all"]
    frozen_last, adapted_last = arms["frozen"]["last_mean_accepted"], arms["adapted"]["last_mean_accepted"]
    lossless = (
        f"every adapted output equals the frozen one ({s['identical']} of {s['compared']} requests)"
        if not s["different"]
        else f"**adapted outputs differ from frozen ones** on {', '.join(s['different'])}"
    )
    mapping = settings["vocab_mapping"] or "none"
    lines = [
        "# bench adapt",
        "",
        f"`{settings['draft_model']}` drafting for `{settings['model']}` (vocab_mapping {mapping}), the first "
        f"{settings['requests']} {settings['task']} problems in order, greedy, up to {settings['max_new_tokens']} new "
        f"tokens, draft length {settings['num_draft_tokens']}; adapted: adapt_budget {settings['adapt_budget']}, "
        f"at most {settings['adapt_steps']} steps per request. Tokens/s count the whole call, training included.",
        "",
        *table(header, rows),
        "",
        f"- Lossless: {lossless}.",
        f"- Adapted over frozen, last {EDGE} requests: "
        + (_num(adapted_last / frozen_last, 3) + "x mean accepted tokens" if frozen_last and adapted_last else "–"),
        f"- Adaptation: {s['adapter_steps']} optimizer steps, {_num(s['adapter_train_s'], 1)} s of training, "
        f"{_num(100 * s['train_share'] if s['train_share'] is not None else None, 1)}% of the adapted drafter's "
        "wall time.",
        f"- Machine: {env.get('cpu')}, {env.get('cores')} cores, threads {env.get('threads')}; load average "
        f"{env.get('load_average_start')} at the start, {env.get('load_average_end')} at the end.",
        "",
    ]
    return "\n".join(lines)


def plot(results: Mapping[str, Any], path: Path) -> None:
    from specdecode.bench.common import pyplot, save_figure

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for arm, style in (("frozen", "o-"), ("adapted", "s-")):
        values = [r["mean_accepted_tokens"] for r in results["records"][arm]]
        ax.plot(range(1, len(values) + 1), values, style, markersize=3, linewidth=1, label=arm)
    settings = results["settings"]
    ax.set_xlabel(f"request ({settings['task']}, in order)")
    ax.set_ylabel("mean accepted tokens per step")
    ax.set_title(f"{settings['draft_model']} → {settings['model']}: online adaptation")
    ax.grid(alpha=0.3)
    ax.legend()
    save_figure(fig, path)


def write_report(results: Mapping[str, Any], out: Path) -> None:
    from specdecode.bench.common import write_markdown_and_plot

    write_markdown_and_plot(results, out, markdown, plot, "adapt.png")
