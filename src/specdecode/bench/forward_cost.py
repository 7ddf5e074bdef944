"""How a backend's forward time grows with the number of new tokens: the cost curve of verification.

Speculation with k drafted tokens replaces k+1 one-token forwards by one (k+1)-token forward, so its
speed-up is bounded by ``(k+1) * t(1) / t(k+1)``.  This measures ``t(n)`` for n = 1..max_new on top of
a realistic KV cache, with logits for every row (verification reads all of them); the quick relative
curve the cost model uses lives in :mod:`specdecode.models.cost`.
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import dataclass

import torch
from torch.profiler import ProfilerActivity, profile

from specdecode.bench.common import check_positive_ints
from specdecode.bench.methods import parse_int_list
from specdecode.errors import SpecDecodeError
from specdecode.models.base import CausalLM
from specdecode.models.cost import prefilled, timed_rounds
from specdecode.models.loading import load_model
from specdecode.models.quantize import check_quantize
from specdecode.models.registry import DEFAULT_MODEL


@dataclass
class ForwardCost:
    """Median forward time in ms per number of new tokens (keys "1".."max_new")."""

    model: str
    t_ms: dict[str, float]
    ratio_8_1: float

    def to_json(self) -> dict:
        return {
            "model": self.model,
            "t_ms": {n: round(t, 3) for n, t in self.t_ms.items()},
            "ratio_8_1": round(self.ratio_8_1, 3),
        }


def measure_forward_cost(
    backend: CausalLM, context_tokens: int = 256, max_new: int = 16, repeats: int = 5, warmup: int = 2
) -> ForwardCost:
    """Median time of a forward over n = 1..max_new new tokens after ``context_tokens`` cached ones."""
    if max_new < 8:
        raise ValueError("max_new must be at least 8 to report the 8-token / 1-token ratio")
    if repeats < 1 or warmup < 0:
        raise ValueError("repeats must be at least 1 and warmup at least 0")
    samples = timed_rounds(backend, context_tokens, max_new, repeats, warmup)
    t_ms = {str(n): statistics.median(times) * 1e3 for n, times in samples.items()}
    return ForwardCost(model=backend.name, t_ms=t_ms, ratio_8_1=t_ms["8"] / t_ms["1"])


def format_curve(cost: ForwardCost) -> str:
    """A terminal table: tokens, ms, cost relative to one token, and ms per token."""
    t1 = cost.t_ms["1"]
    lines = [f"forward cost of {cost.model}", f"{'tokens':>6}  {'ms':>9}  {'x t(1)':>7}  {'ms/token':>8}"]
    for n, t in cost.t_ms.items():
        lines.append(f"{n:>6}  {t:9.2f}  {t / t1:7.2f}  {t / int(n):8.2f}")
    lines.append(f"ratio t(8)/t(1): {cost.ratio_8_1:.2f}")
    return "\n".join(lines)


def format_contexts(costs: dict[int, ForwardCost]) -> str:
    """The curves of several contexts side by side: t(1) in ms, then t(n) / t(1) per number of new tokens."""
    contexts = list(costs)
    model = next(iter(costs.values())).model
    widths = list(next(iter(costs.values())).t_ms)
    header = f"{'tokens':>6}" + "".join(f"  {f'ctx {c}':>10}" for c in contexts)
    lines = [f"forward cost of {model} against context length (x t(1) of the same context)", header]
    lines.append(f"{'t(1) ms':>6}" + "".join(f"  {costs[c].t_ms['1']:10.2f}" for c in contexts))
    for n in widths:
        lines.append(f"{n:>6}" + "".join(f"  {costs[c].t_ms[n] / costs[c].t_ms['1']:10.2f}" for c in contexts))
    return "\n".join(lines)


def profile_forward(backend: CausalLM, n_new: int, context_tokens: int, repeats: int = 3, row_limit: int = 15) -> str:
    """Per-operator CPU profile of ``repeats`` forwards over ``n_new`` tokens, sorted by self CPU time."""
    cache, new = prefilled(backend, context_tokens, n_new)
    backend.forward(new, cache)  # warm-up: first-call allocations and kernel selection
    cache.crop(context_tokens)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(repeats):
            backend.forward(new, cache)
            cache.crop(context_tokens)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=row_limit)
    header = f"{backend.name}: {repeats} forwards of {n_new} new tokens after {context_tokens} cached"
    return f"{header}\n{table}"


def print_forward_cost(
    model: str | None,
    quantize: str | None,
    threads: int | None,
    context_tokens: int | str,
    max_new: int,
    repeats: int | None,
    as_json: bool,
    with_profiles: bool,
) -> None:
    """``specdecode bench forward-cost``: measure and print the curve after each of ``context_tokens`` (one number
    or several, comma-separated; one JSON object per line with ``as_json``, and a table of the curves side by side
    for several), then with ``with_profiles`` the per-operator profiles of 1- and 8-token forwards after the first."""
    quantize = check_quantize(quantize or "none")
    repeats = 5 if repeats is None else repeats
    contexts = (
        parse_int_list(context_tokens, "--context-tokens") if isinstance(context_tokens, str) else (context_tokens,)
    )
    check_positive_ints(("--repeats", repeats), *([("--threads", threads)] if threads is not None else []))
    if threads is not None:
        torch.set_num_threads(threads)
    loaded = load_model(model or DEFAULT_MODEL, quantize=quantize)
    backend, quantize = loaded.backend, loaded.quantize  # auto: the format it chose
    costs = {}
    for context in contexts:
        try:
            costs[context] = measure_forward_cost(backend, context_tokens=context, max_new=max_new, repeats=repeats)
        except ValueError as exc:  # bad sizes: a user mistake, one line
            raise SpecDecodeError(str(exc)) from exc
        if as_json:
            print(json.dumps({**costs[context].to_json(), "quantize": quantize, "context_tokens": context}))
        else:
            print(
                *([f"after {context} cached tokens:"] if len(contexts) > 1 else []),
                format_curve(costs[context]),
                sep="\n",
            )
    if len(costs) > 1 and not as_json:
        print(format_contexts(costs))
    for n_new in (1, 8) if with_profiles else ():
        print(profile_forward(backend, n_new, contexts[0]), file=sys.stderr if as_json else sys.stdout)
