"""The cells of ``specdecode bench serve`` (one JSON object per method and concurrency) and, from the results
JSON alone, its ``results.md`` and ``serve.png``."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from specdecode.bench import reporting
from specdecode.bench.metrics import percentile, ratio
from specdecode.bench.reporting import fmt


def itl_samples(record: Mapping[str, Any]) -> list[float]:
    """One request's inter-token latencies: each gap between content chunks over the tokens of the later chunk,
    once per token (the first chunk's tokens have TTFT instead)."""
    samples: list[float] = []
    for gap, tokens in zip(record["chunk_gaps_s"], record["chunk_tokens"][1:]):
        samples += [gap / tokens] * tokens
    return samples


def request_record(key: str, reply: dict[str, Any], tokenizer: Any) -> dict[str, Any]:
    """A reply as results.json keeps it: text, usage, TTFT, and each content chunk's gap and token count."""
    times, pieces = reply["times"], reply["pieces"]
    chunk_tokens = [max(1, len(tokenizer(p, add_special_tokens=False)["input_ids"])) for p in pieces]
    spec = (reply["metrics"] or {}).get("speculative_decoding") or {}
    return {
        "prompt": key,
        "text": "".join(pieces),
        "completion_tokens": reply["completion_tokens"],
        "finish_reason": reply["finish_reason"],
        "latency_s": round(reply["finished"] - reply["sent"], 5),
        "ttft_s": round(times[0] - reply["sent"], 5) if times else None,
        "chunk_tokens": chunk_tokens,
        "chunk_gaps_s": [round(b - a, 6) for a, b in zip(times, times[1:])],
        "mean_acceptance_length": spec.get("mean_acceptance_length"),
    }


def _p(values: Sequence[float], q: float) -> float | None:
    return round(percentile(values, q), 6) if values else None


def summarize_cell(
    method: str,
    concurrency: int,
    records: Sequence[Mapping[str, Any]],
    wall_s: float,
    reference: Mapping[str, str] | None,
) -> dict[str, Any]:
    """One cell's JSON: totals, client-side TTFT/ITL percentiles, acceptance, equality with ``none`` at C=1."""
    tokens = sum(r["completion_tokens"] for r in records)
    ttft = [r["ttft_s"] for r in records if r["ttft_s"] is not None]
    itl = [x for r in records for x in itl_samples(r)]
    latency = [r["latency_s"] for r in records]
    acceptance = [r["mean_acceptance_length"] for r in records if r["mean_acceptance_length"] is not None]
    same = (
        [reference.get(r["prompt"]) == r["text"] for r in records] if reference is not None else [True] * len(records)
    )
    return {
        "method": method,
        "concurrency": concurrency,
        "requests": len(records),
        "completion_tokens": tokens,
        "wall_s": round(wall_s, 5),
        "tokens_per_s": tokens / wall_s if wall_s > 0 else 0.0,
        "ttft_p50_s": _p(ttft, 50),
        "ttft_p95_s": _p(ttft, 95),
        "itl_p50_s": _p(itl, 50),
        "itl_p95_s": _p(itl, 95),
        "latency_p50_s": _p(latency, 50),
        "latency_p95_s": _p(latency, 95),
        "mean_acceptance_length": sum(acceptance) / len(acceptance) if acceptance else None,
        "equal_to_none_c1": sum(same) / len(same) if same else None,
        # Tokens the ITL counted (the chunks' deltas re-encoded) next to the tokens the server reported.
        "chunk_tokens": sum(sum(r["chunk_tokens"]) for r in records),
        "per_request": list(records),
    }


def _rows(results: Mapping[str, Any]) -> tuple[list[str], list[int], reporting.Cells]:
    cells, levels = reporting.cells_by(results, "concurrency")
    return list(dict.fromkeys(c["method"] for c in results["cells"])), levels, cells


def markdown(results: Mapping[str, Any]) -> str:
    s = results["settings"]
    names, levels, cells = _rows(results)
    get = reporting.cell_getter(cells)

    def ms(key: str) -> Callable[[str, int], str]:
        return lambda n, c: fmt(None if get(n, c, key) is None else 1000 * get(n, c, key), ".1f")

    def over_none(key: str) -> Callable[[str, int], str]:
        return lambda n, c: fmt(ratio(get(n, c, key), get("none", c, key)), ".2f", "x")

    requests = reporting.request_count(results)
    endpoint = results.get("endpoint", "/v1/chat/completions")
    lines = [
        f"# specdecode server under load: model `{s['model']}`"
        + ("" if s.get("quantize", "none") == "none" else f" ({s['quantize']} weights)"),
        "",
        reporting.machine_line(
            results.get("environment", {}),
            ("torch", "transformers", "openai", "uvicorn", "uvloop", "httptools", "specdecode"),
        )
        + " **The server and its clients share this CPU**: the clients run in a process of their own, and their "
        "HTTP and JSON work is taken from the decoding.",
        "",
        f"One real uvicorn server in-process (`{endpoint}`, max batch size {s['max_batch_size']}) serving every "
        f"method; {requests} requests ({', '.join(s['tasks'])}; {s['prompts_per_task']} prompt(s) per task, seed "
        f"{s['seed']}) replayed per cell by C closed-loop client threads of the official `openai` client in a "
        "child process (each sends its next request when its previous one finished), streamed, greedy, `max_tokens` "
        f"{s['max_new_tokens']} (requests may end at EOS; tokens are the usage chunk's `completion_tokens`). Every "
        "cell starts with cold drafters after one untimed warm-up request per method. Client-side timing: wall "
        "time from the first send to the last finish; TTFT from a request's send to its first content chunk; ITL "
        "is each later content chunk's gap from the previous one divided by the tokens it carried (its delta "
        "re-encoded with the model's tokenizer), counted once per token. "
        f"{results.get('measure_s', 0) / 60:.1f} min of measuring.",
    ]
    if servers := results.get("servers"):
        named = ", ".join(f"`{label}` ({s['url']}, model `{s['model']}`)" for label, s in servers.items())
        lines += [
            "",
            f"Other servers, measured by the same client on the same prompts after ours: {named}. They are sent no "
            "`speculative` field and cannot be reset between cells; their acceptance is read from vLLM's "
            "`/metrics` counters where they keep them.",
        ]
    tables = [
        ("Tokens/s (all requests)", lambda n, c: fmt(get(n, c, "tokens_per_s"), ".1f")),
        ("Tokens/s over `none` at the same C", over_none("tokens_per_s")),
        ("Time to first token p50 (ms)", ms("ttft_p50_s")),
        ("Time to first token p95 (ms)", ms("ttft_p95_s")),
        ("Inter-token latency p50 (ms)", ms("itl_p50_s")),
        ("Inter-token latency p95 (ms)", ms("itl_p95_s")),
        ("Inter-token latency p95 over `none` at the same C (below 1: smoother)", over_none("itl_p95_s")),
        ("Request latency p95 (s)", lambda n, c: fmt(get(n, c, "latency_p95_s"), ".2f")),
        ("Mean acceptance length (tokens per step, server-reported)", lambda n, c: fmt(
            get(n, c, "mean_acceptance_length"), ".2f")),
        ("Wall time (s)", lambda n, c: fmt(get(n, c, "wall_s"), ".2f")),
        ("Outputs identical to `none` at C=1", lambda n, c: fmt(
            None if get(n, c, "equal_to_none_c1") is None else 100 * get(n, c, "equal_to_none_c1"), ".0f", "%")),
    ]  # fmt: skip
    lines += reporting.metric_sections(tables, names, levels, "C")
    return "\n".join(lines) + "\n"


def plot_serve(results: Mapping[str, Any], path: Path) -> None:
    """Tokens/s and p95 inter-token latency against concurrency, one line per method."""
    names, levels, cells = _rows(results)
    fig, (left, right) = reporting.pyplot().subplots(1, 2, figsize=(11, 4.5))
    for name in names:
        points = sorted((c, cell) for (n, c), cell in cells.items() if n == name)
        left.plot([c for c, _ in points], [cell["tokens_per_s"] for _, cell in points], marker="o", label=name)
        itl = [(c, cell["itl_p95_s"]) for c, cell in points if cell.get("itl_p95_s") is not None]
        right.plot([c for c, _ in itl], [1000 * v for _, v in itl], marker="o", label=name)
    for ax, label in ((left, "tokens/s (all requests)"), (right, "p95 inter-token latency (ms)")):
        reporting.log2_axis(ax, levels, "concurrency C (closed-loop clients)", label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    env = results.get("environment", {})
    fig.suptitle(f"{Path(results['settings']['model']).name}: server under load ({env.get('cpu_capability')})")
    reporting.save_figure(fig, path)


def write_report(results: Mapping[str, Any], out: Path) -> list[Path]:
    """``results.md`` and ``serve.png`` in ``out``."""
    return reporting.write_markdown_and_plot(results, out, markdown, plot_serve, "serve.png")
