"""The cells of ``specdecode bench throughput`` (one JSON object per method and batch size) and, from the results
JSON alone, its ``results.md`` and ``throughput.png``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from specdecode.bench import reporting
from specdecode.bench.metrics import percentile, ratio
from specdecode.bench.reporting import fmt


def summarize_cell(
    method: str,
    kind: str,
    batch_size: int,
    keys: Sequence[str],
    tokens: Sequence[list[int]],
    latencies: Sequence[float],
    wall_s: float,
    accepted: Sequence[float] | None,
    reference: dict[str, list[int]] | None,
) -> dict[str, Any]:
    """One cell's JSON: totals, latency percentiles, acceptance, equality, and the per-request records."""
    new_tokens = sum(len(t) for t in tokens)
    same = [reference[key] == t for key, t in zip(keys, tokens)] if reference is not None else [True] * len(keys)
    return {
        "method": method,
        "kind": kind,
        "batch_size": batch_size,
        "requests": len(keys),
        "new_tokens": new_tokens,
        "wall_s": round(wall_s, 5),
        "tokens_per_s": new_tokens / wall_s if wall_s > 0 else 0.0,
        "latency_p50_s": round(percentile(latencies, 50), 5),
        "latency_p95_s": round(percentile(latencies, 95), 5),
        "mean_accepted_tokens": sum(accepted) / len(accepted) if accepted else None,
        "equal_to_solo_plain": sum(same) / len(same),
        "per_request": [
            {
                "prompt": key,
                "latency_s": round(latency, 5),
                "token_ids": t,
                **({"mean_accepted_tokens": accepted[i]} if accepted else {}),
            }
            for i, (key, t, latency) in enumerate(zip(keys, tokens, latencies))
        ],
    }


def _rows(results: Mapping[str, Any]) -> tuple[list[str], list[int], reporting.Cells]:
    """Row names (our methods in order, ``none`` first when only its reference cell exists, the peer last),
    column batch sizes, and the cells by (method, batch size)."""
    cells, sizes = reporting.cells_by(results, "batch_size")
    names = list(
        dict.fromkeys(
            [
                *(c["method"] for c in results["cells"] if c["kind"] == "ours"),
                *(c["method"] for c in results["cells"] if c["kind"] == "peer"),
            ]
        )
    )
    return names, sizes, cells


def markdown(results: Mapping[str, Any]) -> str:
    s = results["settings"]
    names, sizes, cells = _rows(results)
    peer = next((c["method"] for c in results["cells"] if c["kind"] == "peer"), None)
    get = reporting.cell_getter(cells)

    def tps(name: str, b: int) -> float | None:
        return get(name, b, "tokens_per_s")

    requests = reporting.request_count(results)
    lines = [
        f"# specdecode batched throughput: model `{s['model']}`",
        "",
        reporting.machine_line(results.get("environment", {}), ("torch", "transformers", "specdecode")),
        "",
        f"{requests} requests ({', '.join(s['tasks'])}; {s['prompts_per_task']} prompt(s) per task, seed "
        f"{s['seed']}; chat template {'on' if results.get('chat_template') else 'off'}), all submitted at once; "
        f"{s['max_new_tokens']} new tokens each (greedy, EOS ignored). B is the largest number of sequences "
        "decoding together (continuous batching); every cell runs on a fresh generator after an untimed "
        f"warm-up. `{peer or 'hf-plain-batched'}` is transformers' batched `generate()` (plain, left-padded) "
        "on chunks of B prompts, without our fast path. Wall time runs from the submission of all requests to "
        "the last finish (prefill included); latency from submission to a request's own finish. "
        f"{results.get('measure_s', 0) / 60:.1f} min of measuring.",
    ]
    tables = [
        ("Tokens/s (all requests)", lambda n, b: fmt(tps(n, b), ".1f")),
        ("Wall time (s)", lambda n, b: fmt(get(n, b, "wall_s"), ".2f")),
        ("Latency p50 (s)", lambda n, b: fmt(get(n, b, "latency_p50_s"), ".2f")),
        ("Latency p95 (s)", lambda n, b: fmt(get(n, b, "latency_p95_s"), ".2f")),
        ("Mean accepted tokens per step", lambda n, b: fmt(get(n, b, "mean_accepted_tokens"), ".2f")),
        (
            "Identical to solo plain decoding (`none`, B=1)",
            lambda n, b: fmt(
                None if get(n, b, "equal_to_solo_plain") is None else 100 * get(n, b, "equal_to_solo_plain"), ".0f", "%"
            ),
        ),
        ("Tokens/s over our `none` at the same B", lambda n, b: fmt(ratio(tps(n, b), tps("none", b)), ".2f", "x")),
        ("Tokens/s over our `none` at B=1", lambda n, b: fmt(ratio(tps(n, b), tps("none", 1)), ".2f", "x")),
    ]
    if peer is not None:
        tables.append(
            (
                f"Tokens/s over `{peer}` at the same B (above 1: faster than transformers)",
                lambda n, b: fmt(ratio(tps(n, b), tps(peer, b)), ".2f", "x"),
            )
        )
    lines += reporting.metric_sections(tables, names, sizes, "B")
    return "\n".join(lines) + "\n"


def plot_throughput(results: Mapping[str, Any], path: Path) -> None:
    """Tokens/s against batch size, one line per method and the peer."""
    names, sizes, cells = _rows(results)
    fig, ax = reporting.pyplot().subplots(figsize=(7, 4.5))
    for name in names:
        points = sorted((b, c["tokens_per_s"]) for (n, b), c in cells.items() if n == name)
        kind = next(c["kind"] for (n, _), c in cells.items() if n == name)
        style = "--" if kind == "peer" else "-"
        ax.plot([b for b, _ in points], [t for _, t in points], style, marker="o", label=name)
    reporting.log2_axis(ax, sizes, "batch size B (sequences decoding together)", "tokens/s (all requests)")
    env = results.get("environment", {})
    ax.set_title(f"{Path(results['settings']['model']).name}: batched throughput ({env.get('cpu_capability')})")
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    reporting.save_figure(fig, path)


def write_report(results: Mapping[str, Any], out: Path) -> list[Path]:
    """``results.md`` and ``throughput.png`` in ``out``."""
    return reporting.write_markdown_and_plot(results, out, markdown, plot_throughput, "throughput.png")
