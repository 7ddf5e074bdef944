"""The cells of ``specdecode bench serve`` (one JSON object per method and concurrency) and, from the results
JSON alone, its ``results.md`` and ``serve.png``."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from specdecode.bench.report import _fmt, _table, ratio
from specdecode.bench.throughput_report import percentile


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


def _rows(results: Mapping[str, Any]) -> tuple[list[str], list[int], dict[tuple[str, int], Mapping[str, Any]]]:
    cells = {(c["method"], c["concurrency"]): c for c in results["cells"]}
    names = list(dict.fromkeys(c["method"] for c in results["cells"]))
    return names, sorted({c for _, c in cells}), cells


def markdown(results: Mapping[str, Any]) -> str:
    s = results["settings"]
    env = results.get("environment", {})
    names, levels, cells = _rows(results)

    def get(name: str, c: int, key: str) -> Any:
        cell = cells.get((name, c))
        return None if cell is None else cell.get(key)

    def ms(key: str) -> Callable[[str, int], str]:
        return lambda n, c: _fmt(None if get(n, c, key) is None else 1000 * get(n, c, key), ".1f")

    def over_none(key: str) -> Callable[[str, int], str]:
        return lambda n, c: _fmt(ratio(get(n, c, key), get("none", c, key)), ".2f", "x")

    requests = len(results.get("prompts", [])) or next((c["requests"] for c in results["cells"]), 0)
    load = env.get("load_average_start"), env.get("load_average_end")
    endpoint = results.get("endpoint", "/v1/chat/completions")
    lines = [
        f"# specdecode server under load: model `{s['model']}`",
        "",
        f"One run on one machine: {env.get('cpu')} with CPU capability **{env.get('cpu_capability')}**, "
        f"{env.get('cores')} cores, {env.get('threads')} torch threads, fast path "
        f"{'on' if env.get('fast_path') else 'off'}; load average (1/5/15 min) at start {load[0]}, at end {load[1]}. "
        f"torch {env.get('torch')}, transformers {env.get('transformers')}, openai {env.get('openai')}, uvicorn "
        f"{env.get('uvicorn')}, specdecode {env.get('specdecode')}. **The server and its client share this CPU**: "
        "the client threads' HTTP and JSON work is taken from the decoding.",
        "",
        f"One real uvicorn server in-process (`{endpoint}`, max batch size {s['max_batch_size']}) serving every "
        f"method; {requests} requests ({', '.join(s['tasks'])}; {s['prompts_per_task']} prompt(s) per task, seed "
        f"{s['seed']}) replayed per cell by C closed-loop client threads of the official `openai` client (each "
        f"sends its next request when its previous one finished), streamed, greedy, `max_tokens` "
        f"{s['max_new_tokens']} (requests may end at EOS; tokens are the usage chunk's `completion_tokens`). Every "
        "cell starts with cold drafters after one untimed warm-up request per method. Client-side timing: wall "
        "time from the first send to the last finish; TTFT from a request's send to its first content chunk; ITL "
        "is each later content chunk's gap from the previous one divided by the tokens it carried (its delta "
        "re-encoded with the model's tokenizer), counted once per token. "
        f"{results.get('measure_s', 0) / 60:.1f} min of measuring.",
    ]
    tables = [
        ("Tokens/s (all requests)", lambda n, c: _fmt(get(n, c, "tokens_per_s"), ".1f")),
        ("Tokens/s over `none` at the same C", over_none("tokens_per_s")),
        ("Time to first token p50 (ms)", ms("ttft_p50_s")),
        ("Time to first token p95 (ms)", ms("ttft_p95_s")),
        ("Inter-token latency p50 (ms)", ms("itl_p50_s")),
        ("Inter-token latency p95 (ms)", ms("itl_p95_s")),
        ("Inter-token latency p95 over `none` at the same C (below 1: smoother)", over_none("itl_p95_s")),
        ("Request latency p95 (s)", lambda n, c: _fmt(get(n, c, "latency_p95_s"), ".2f")),
        ("Mean acceptance length (tokens per step, server-reported)", lambda n, c: _fmt(
            get(n, c, "mean_acceptance_length"), ".2f")),
        ("Wall time (s)", lambda n, c: _fmt(get(n, c, "wall_s"), ".2f")),
        ("Outputs identical to `none` at C=1", lambda n, c: _fmt(
            None if get(n, c, "equal_to_none_c1") is None else 100 * get(n, c, "equal_to_none_c1"), ".0f", "%")),
    ]  # fmt: skip
    for title, value in tables:
        rows = ([f"`{n}`", *(value(n, c) for c in levels)] for n in names)
        lines += ["", f"## {title}", "", *_table(["method", *(f"C={c}" for c in levels)], rows)]
    return "\n".join(lines) + "\n"


def plot_serve(results: Mapping[str, Any], path: Path) -> None:
    """Tokens/s and p95 inter-token latency against concurrency, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names, levels, cells = _rows(results)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    for name in names:
        points = sorted((c, cell) for (n, c), cell in cells.items() if n == name)
        left.plot([c for c, _ in points], [cell["tokens_per_s"] for _, cell in points], marker="o", label=name)
        itl = [(c, cell["itl_p95_s"]) for c, cell in points if cell.get("itl_p95_s") is not None]
        right.plot([c for c, _ in itl], [1000 * v for _, v in itl], marker="o", label=name)
    for ax, label in ((left, "tokens/s (all requests)"), (right, "p95 inter-token latency (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_xlabel("concurrency C (closed-loop clients)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    env = results.get("environment", {})
    fig.suptitle(f"{Path(results['settings']['model']).name}: server under load ({env.get('cpu_capability')})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(results: Mapping[str, Any], out: Path) -> list[Path]:
    """``results.md`` and ``serve.png`` in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text(markdown(results))
    plot_serve(results, out / "serve.png")
    return [out / "results.md", out / "serve.png"]
