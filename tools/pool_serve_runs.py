"""Pool the inter-token latencies of several ``specdecode bench serve`` runs, per method at one concurrency.

One run's p95 moves by several percent from run to run on a 2-core machine
(``docs/results/serve-uvloop-bf16-smollm2-135m``), more than the difference being judged.  Every run keeps each
request's chunk gaps and token counts, so the samples of several runs can be put together and their percentiles read
once:

    python tools/pool_serve_runs.py --concurrency 8 docs/results/serve-uvloop-bf16-smollm2-135m/c8-rep*/results.json

ITL is counted as ``bench serve`` counts it: each later content chunk's gap divided by its tokens, once per
token.  Prints one line per run (each method's p95 and tokens/s over the first method's) and the pooled
percentiles.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from specdecode.bench.serve_report import itl_samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", type=Path, help="results.json files of bench serve runs")
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    pooled: dict[str, list[float]] = {}
    for path in args.results:
        cells = [c for c in json.loads(path.read_text())["cells"] if c["concurrency"] == args.concurrency]
        if not cells:
            continue
        base = cells[0]
        parts = []
        for cell in cells:
            latencies = [itl for request in cell["per_request"] for itl in itl_samples(request)]
            pooled.setdefault(cell["method"], []).extend(latencies)
            p95_ratio = cell["itl_p95_s"] / base["itl_p95_s"]
            speed = cell["tokens_per_s"] / base["tokens_per_s"]
            p95 = np.percentile(latencies, 95) * 1e3
            parts.append(f"{cell['method']} p95 {p95:.1f} ms ({p95_ratio:.3f}x), {speed:.2f}x tok/s")
        print(f"{path}: " + "; ".join(parts))
    first = next(iter(pooled.values()))
    for method, latencies in pooled.items():
        p50, p90, p95, p99 = (np.percentile(latencies, q) * 1e3 for q in (50, 90, 95, 99))
        ratio = np.percentile(latencies, 95) / np.percentile(first, 95)
        print(
            f"pooled {method}: {len(latencies)} tokens, ITL p50 {p50:.1f} p90 {p90:.1f} p95 {p95:.1f} p99 {p99:.1f} ms"
            f" (p95 {ratio:.3f}x)"
        )


if __name__ == "__main__":
    main()
