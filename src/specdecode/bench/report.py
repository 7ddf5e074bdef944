"""The ``bench`` report: ``results.md`` (environment, speed-ups, per-task table, peers, acceptance by
position, draft length, goals) and the plots, built from the cells of ``cells.py``.

Everything here reads only the results JSON written by ``runner.py``, so a report can be rebuilt without
measuring again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from specdecode.bench.cells import ALL_TASKS, CellResult, PromptSpeedup, prompt_speedups, slowest_prompts, task_order
from specdecode.bench.metrics import median_wall_s, ratio
from specdecode.bench.plots import plot_draft_length, plot_speedup
from specdecode.bench.reporting import fmt, table
from specdecode.data.corpus import BENCH_PROMPTS_SKIPPED
from specdecode.data.long_context import context_tokens_of
from specdecode.data.tasks import GROUNDED_TASKS
from specdecode.models.cost import cost_at

#: The verification widths the long-context section prices (a chain of 1, 4 and 8 drafted tokens, plus one).
VERIFY_WIDTHS = (2, 5, 9)

# --------------------------------------------------------------------------------------------------------
# Markdown


def _environment_lines(results: Mapping[str, Any]) -> list[str]:
    env = results.get("environment", {})
    s = results["settings"]
    load = env.get("load_average_start"), env.get("load_average_end")
    return [
        f"- Machine: {env.get('cpu')} ({env.get('cpu_capability', 'vector width not recorded')}), "
        f"{env.get('cores')} cores, {env.get('threads')} torch threads; "
        f"load average (1/5/15 min) at start {load[0]}, at end {load[1]} "
        "(anything near or above the core count means other processes shared the CPU).",
        f"- Software: Python {env.get('python')}, torch {env.get('torch')}, transformers {env.get('transformers')}, "
        f"specdecode {env.get('specdecode')}; {env.get('platform')}.",
        f"- Settings: model `{s['model']}` ({_precision(s, env)}), {_prompt_source(s)}, "
        f"{s['max_new_tokens']} new tokens per prompt (greedy, EOS ignored), median of {s['repeats']} "
        f"interleaved repeat(s) after a warm-up ({_INTERLEAVE[s.get('interleave', 'request')]}), "
        f"chat template {'on' if results.get('chat_template') else 'off'}; "
        f"{results.get('measure_s', 0) / 60:.1f} min of measuring.",
        _DRAFTER_STATE[s.get("drafter_state", "request")],
    ]


def _precision(settings: Mapping[str, Any], environment: Mapping[str, Any]) -> str:
    """Our weights: fp32, or weight-only quantized (activations bf16) — peers keep their own; for ``auto``, the format
    it chose on the machine of the run."""
    quantize = settings.get("quantize", "none")
    draft = settings.get("quantize_draft") or quantize
    ours = _weights(quantize)
    if quantize == "auto":
        ours = f"auto: {_weights(environment.get('quantize', 'not recorded'))}"
    return ours if draft == quantize else f"{ours}, draft models {_weights(draft)}"


def _weights(quantize: str) -> str:
    return "fp32" if quantize == "none" else f"{quantize} weights"


def _prompt_source(settings: Mapping[str, Any]) -> str:
    if settings.get("prompts_file"):
        return (
            f"prompts from `{Path(settings['prompts_file']).name}` (SHA-256 {settings['prompts_sha256'][:12]}…), "
            f"at most {settings['prompts_per_task']} per task"
        )
    source = f"{settings['prompts_per_task']} prompt(s) per task (seed {settings['seed']})"
    if settings["seed"] == 0 and settings["prompts_per_task"] > BENCH_PROMPTS_SKIPPED:
        source += (
            f"; the prompts after the first {BENCH_PROMPTS_SKIPPED} of a task may be in `specdecode train`'s data, "
            "so a trained drafter's figures are not held out on them"
        )
    return source


_INTERLEAVE = {
    "step": "our methods decode each prompt in turns, a step at a time, each timed over its own turns; peers a "
    "request at a time",
    "request": "one request after another",
}

_DRAFTER_STATE = {
    "request": "- Drafter state: reset before every prompt (cold), except within a session task (`multi-edit`), "
    "whose requests run in order on one drafter, reset before each repeat of the session.",
    "task": "- Drafter state: reset once per task and repeat; kept across the task's prompts in order (warm).",
}


def markdown(results: Mapping[str, Any], cells: Sequence[CellResult]) -> str:
    s = results["settings"]
    tasks = task_order(cells)
    by_key = {(c.method, c.task): c for c in cells}
    title = f"# specdecode benchmark: suite `{s['suite']}`, model `{s['model']}`"
    lines = [title, "", *_environment_lines(results), ""]

    lines += [
        "## Speed-up over our plain decoding",
        "",
        f"Tokens/s divided by that of `{s['baseline']}` on the same prompts; peers (`hf-*`: transformers "
        "`generate()` on the same checkpoint; `llamacpp-*`, `ov-*`: see Against peers) in the same run.",
        "",
    ]
    main = [name for name in [*s["methods"], *s["peers"]] if any((name, t) in by_key for t in tasks)]
    lines += table(
        ["method", *tasks],
        (
            [f"`{name}`", *(fmt(by_key[name, t].speedup if (name, t) in by_key else None, ".2f", "x") for t in tasks)]
            for name in main
        ),
    )

    lines += ["", *_interval_lines(cells, tasks[-1])]
    lines += _context_length_lines(results, cells, main)

    lines += [
        "",
        "## Per task",
        "",
        "Drafting and engine overhead are shares of our generation time; the rest is target forwards.",
        "",
    ]
    lines += table(
        [
            "method",
            "task",
            "prompts",
            "mean accepted tokens",
            "acceptance rate",
            "tokens/s",
            "speed-up",
            "identical to plain",
            "drafting",
            "engine overhead",
        ],
        (
            [
                f"`{c.method}`",
                c.task,
                str(c.prompts),
                fmt(c.mean_accepted_tokens),
                fmt(c.acceptance_rate, ".1%"),
                fmt(c.tokens_per_s, ".1f"),
                fmt(c.speedup, ".2f", "x"),
                fmt(c.equal_to_plain_pct, ".0f", "%"),
                fmt(c.draft_share, ".1%"),
                fmt(c.overhead_share, ".1%"),
            ]
            for c in cells
            if c.kind != "sweep"
        ),
    )

    peer_cells = [c for c in cells if c.kind == "peer"]
    if peer_cells:
        lines += [
            "",
            "## Against peers",
            "",
            "Our tokens/s divided by the peer's for the matching configuration (above 1: we are faster). "
            "`hf-*`: transformers `generate()` on our fp32 checkpoint; `llamacpp-*`: llama.cpp on the GGUF our "
            "checkpoint was de-quantized from; `ov-int8-*` / `ov-int4-*`: OpenVINO GenAI on exports made by its "
            "own tooling. Only transformers computes in our precision, so only it can match our tokens; a "
            "speculative peer is exact when it matches its own plain decoding.",
            "",
        ]
        header = [
            "task",
            "ours",
            "tokens/s",
            "peer",
            "tokens/s",
            "ours / theirs",
            "same as ours",
            "same as its own plain",
            "verdict",
        ]
        lines += table(header, (_peer_row(c, by_key[c.matches, c.task]) for c in peer_cells))

    drafting = [c for c in cells if c.kind == "ours" and c.task == tasks[-1] and c.acceptance_by_position]
    if drafting:
        lines += ["", f"## Acceptance by draft position (task `{tasks[-1]}`)", ""]
        width = max(len(c.acceptance_by_position) for c in drafting)
        lines += table(
            ["method", *(str(i + 1) for i in range(width))],
            (
                [
                    f"`{c.method}`",
                    *(fmt(x, ".0%") for x in c.acceptance_by_position),
                    *("–" for _ in range(width - len(c.acceptance_by_position))),
                ]
                for c in drafting
            ),
        )

    sweep = _sweep_cells(results, cells)
    if sweep:
        lines += ["", "## Draft length", ""]
        header = ["varied method", "task", "k", "mean accepted tokens", "acceptance rate", "tokens/s", "speed-up"]
        lines += table(
            header,
            (
                [
                    f"`{base}`",
                    c.task,
                    str(k),
                    fmt(c.mean_accepted_tokens),
                    fmt(c.acceptance_rate, ".1%"),
                    fmt(c.tokens_per_s, ".1f"),
                    fmt(c.speedup, ".2f", "x"),
                ]
                for (base, _), points in sweep.items()
                for k, c in points
            ),
        )

    lines += ["", "## Goals", "", *_goal_lines(cells), *_never_slower_lines(prompt_speedups(results)), ""]
    return "\n".join(lines)


def _context_length_lines(results: Mapping[str, Any], cells: Sequence[CellResult], methods: list[str]) -> list[str]:
    """Speed-up per method against the long-context tasks' prompt lengths (``longctx-N``), each column headed by
    the mean length its prompts had in the target's tokens (cut to the model's context where it is shorter): end
    to end, then of the decoding after the prompt is read, beside the verification cost curve at that length."""
    lengths = sorted(
        (tokens, task)
        for task, prompts in results["prompts"].items()
        if prompts and (tokens := context_tokens_of(task)) is not None
    )
    if not lengths:
        return []
    by_key = {(c.method, c.task): c for c in cells}
    header = ["method"]
    for tokens, task in lengths:
        measured = [p["prompt_tokens"] for p in results["prompts"][task]]
        header.append(f"{tokens} ({sum(measured) / len(measured):.0f} tokens)")
    end_to_end = [
        [f"`{name}`", *(fmt(by_key[name, t].speedup if (name, t) in by_key else None, ".2f", "x") for _, t in lengths)]
        for name in methods
    ]
    baseline = results["settings"]["baseline"]
    decoding = [
        [f"`{name}`", *(fmt(_decoding_speedup(results, name, baseline, t), ".2f", "x") for _, t in lengths)]
        for name in methods
    ]
    curves = results.get("cost_curves", {})
    for width in VERIFY_WIDTHS:
        decoding.append(
            [
                f"*verifying {width} inputs, x one*",
                *(fmt(cost_at(curves[t], width) if curves.get(t) else None, ".2f", "x") for _, t in lengths),
            ]
        )
    return [
        "",
        "## Speed-up against context length",
        "",
        "The `longctx` task at each requested length; the mean prompt length in the target's tokens in parentheses. "
        "End to end, reading the prompt included (the same work for every method):",
        "",
        *table(header, end_to_end),
        "",
        "Decoding after the prompt is read (each request's time less its prefill), and the target's forward over that "
        "many new tokens against one after that many cached tokens (the verification cost curve at that length, "
        "measured on this machine):",
        "",
        *table(header, decoding),
    ]


def _decoding_speedup(results: Mapping[str, Any], method: str, baseline: str | None, task: str) -> float | None:
    """Tokens per second of ``method`` over ``baseline``'s on ``task``, each request's time less its prompt's reading
    (the median time less the mean prefill of its repeats); None without the prefill times of both."""
    if baseline is None:
        return None
    runs = results["runs"]
    records, plain = runs.get(method, {}).get(task, {}), runs.get(baseline, {}).get(task, {})
    prompts = [p["id"] for p in results["prompts"][task] if p["id"] in records and p["id"] in plain]
    if not prompts or not all("prefill_s" in chosen[p] for chosen in (records, plain) for p in prompts):
        return None

    def speed(chosen: Mapping[str, Mapping[str, Any]]) -> float | None:
        seconds = sum(median_wall_s(chosen[p]) - chosen[p]["prefill_s"] / len(chosen[p]["wall_s"]) for p in prompts)
        return sum(chosen[p]["new_tokens"] for p in prompts) / seconds if seconds > 0 else None

    return ratio(speed(records), speed(plain))


def _interval_lines(cells: Sequence[CellResult], pooled_task: str) -> list[str]:
    """Per method, the pooled speed-up with its bootstrap interval over the prompts: one prompt per task is
    thin, and the interval says how much the figure rests on which prompts were drawn."""
    pooled = [c for c in cells if c.task == pooled_task and c.kind != "sweep" and c.speedup is not None]
    if not any(c.speedup_ci for c in pooled):
        return []
    lines = [
        f"Over {'all tasks' if pooled_task == ALL_TASKS else pooled_task}, with a 95% paired bootstrap interval "
        "over the prompts (resampled with replacement):",
        "",
    ]
    for c in pooled:
        interval = f"{c.speedup_ci[0]:.2f}–{c.speedup_ci[1]:.2f}x" if c.speedup_ci else "–"
        lines.append(f"- `{c.method}`: {c.speedup:.2f}x (95% interval {interval}, {c.prompts} prompts)")
    return lines


def _peer_row(peer: CellResult, ours: CellResult) -> list[str]:
    if peer.ours_over_theirs is None:
        verdict = "–"
    else:
        verdict = "we are faster" if peer.ours_over_theirs >= 1 else "**we are slower**"
    return [
        peer.task,
        f"`{ours.method}`",
        fmt(ours.tokens_per_s, ".1f"),
        f"`{peer.method}`",
        fmt(peer.tokens_per_s, ".1f"),
        fmt(peer.ours_over_theirs, ".2f", "x"),
        fmt(peer.equal_to_ours_pct, ".0f", "%"),
        fmt(peer.equal_to_own_plain_pct, ".0f", "%"),
        verdict,
    ]


def _sweep_cells(results: Mapping[str, Any], cells: Sequence[CellResult]) -> dict[tuple[str, str], list]:
    """(base method, task) → [(k, cell)] sorted by k, over the sweep tasks."""
    sweep = results["settings"]["sweep"]
    by_key = {(c.method, c.task): c for c in cells}
    curves: dict[tuple[str, str], list] = {}
    for spec, info in sweep.items():
        for task in results["settings"]["sweep_tasks"]:
            if (spec, task) in by_key:
                curves.setdefault((info["base"], task), []).append((info["k"], by_key[spec, task]))
    return {key: sorted(points, key=lambda p: p[0]) for key, points in curves.items()}


def _goal_lines(cells: Sequence[CellResult]) -> list[str]:
    """The goals, stated as measured — never asserted, and misses are said plainly."""
    lines = []
    grounded = [c for c in cells if c.kind == "ours" and c.method.split(":")[0] == "pld" and c.task in GROUNDED_TASKS]
    for c in grounded:
        verdict = "met" if c.speedup is not None and c.speedup >= 2 else "**not met**"
        lines.append(
            f"- `{c.method}` on grounded task {c.task}: {fmt(c.speedup, '.2f', 'x')} over plain "
            f"decoding (goal >= 2x: {verdict})."
        )
    lines += _model_free_goal_lines(cells)
    lines += _native_peer_goal_lines(cells)
    slower = [c for c in cells if c.kind == "peer" and c.ours_over_theirs is not None and c.ours_over_theirs < 1]
    compared = [c for c in cells if c.kind == "peer" and c.ours_over_theirs is not None]
    if compared and not slower:
        lines.append(f"- Our tokens/s >= the peers' in all {len(compared)} matching (configuration, task) pairs.")
    for c in slower:
        lines.append(
            f"- **Slower than a peer**: `{c.matches}` vs `{c.method}` on {c.task}: "
            f"{c.ours_over_theirs:.2f}x their tokens/s."
        )
    unequal = [c for c in cells if c.equal_to_plain_pct is not None and c.equal_to_plain_pct < 100]
    for c in unequal:
        lines.append(
            f"- **Output differs from plain decoding**: `{c.method}` on {c.task}, "
            f"{c.equal_to_plain_pct:.0f}% of prompts identical."
        )
    for c in cells:
        if not c.repeats_identical:
            lines.append(f"- **Repeats disagree**: `{c.method}` on {c.task} generated different tokens across repeats.")
    return lines or ["- No task or peer goal applies to these methods (they need `pld`, or peers, in the run)."]


#: The goal: under the default policy no drafter may be more than 5% slower than plain decoding on any prompt.
NEVER_SLOWER = 0.95


def _never_slower_lines(measured: Sequence[PromptSpeedup]) -> list[str]:
    """Each method's slowest prompt against plain decoding, paired repeat by repeat (``paired_speedups``), and the
    cells that drafted nothing: plain decoding under another name, they show how far host noise moves a cell."""
    slowest = slowest_prompts(measured)
    if not slowest:
        return []
    below = [p for p in slowest if p.median < NEVER_SLOWER]
    verdict = "met" if not below else f"**not met** by {len(below)} of {len(slowest)} methods"
    lines = [
        f"- Every method >= {NEVER_SLOWER}x plain decoding on every prompt, as the median over repeats of the "
        f"speed-up within each repeat: {verdict}. Each method's slowest prompt:"
    ]
    for p in sorted(slowest, key=lambda p: p.median):
        repeats = len(p.by_repeat)
        spread = f"{min(p.by_repeat):.2f}–{max(p.by_repeat):.2f}x over {repeats} repeat{'s' if repeats > 1 else ''}"
        lines.append(f"  - `{p.method}`: {p.median:.3f}x on {p.prompt} ({spread})")
    undrafted = sorted((p for p in measured if p.drafted == 0), key=lambda p: p.median)
    if undrafted:  # the A/A control's, and prompts where a drafter found or chose nothing
        low, high = undrafted[0], undrafted[-1]
        lines.append(
            f"- {len(undrafted)} cells drafted nothing (plain decoding under another name: an A/A control such as "
            f"`none:k=1`, or a drafter that found or chose nothing): they read {low.median:.3f}–{high.median:.3f}x, "
            f"the lowest `{low.method}` on {low.prompt}. That is how low host noise alone puts a method that "
            "loses nothing in this run."
        )
    return lines


def _native_peer_goal_lines(cells: Sequence[CellResult]) -> list[str]:
    """The goals against native engines, over every task pooled: our best lossless method against llama.cpp's
    plain decoding, and against each native engine's best speculative configuration."""
    pooled = task_order(cells)[-1]
    ours = [c for c in cells if c.kind == "ours" and c.task == pooled and c.equal_to_plain_pct == 100.0]
    peers = [c for c in cells if c.kind == "peer" and c.task == pooled and not c.method.startswith("hf-")]
    if not ours or not peers:
        return []
    best = max(ours, key=lambda c: c.tokens_per_s)
    lines = []
    if plain := next((c for c in peers if c.method == "llamacpp-plain"), None):
        over = ratio(best.tokens_per_s, plain.tokens_per_s)
        verdict = "met" if over is not None and over >= 1 else "**not met**"
        lines.append(
            f"- Our best lossless method `{best.method}` ({best.tokens_per_s:.1f} tokens/s) on {pooled}: "
            f"{fmt(over, '.2f', 'x')} llama.cpp's plain decoding (goal >= 1.0x: {verdict})."
        )
    for engine in dict.fromkeys(c.method.rsplit("-", 1)[0] for c in peers):
        speculative = [c for c in peers if c.method.startswith(f"{engine}-") and not c.method.endswith("-plain")]
        if speculative:
            theirs = max(speculative, key=lambda c: c.tokens_per_s)
            over = ratio(best.tokens_per_s, theirs.tokens_per_s)
            verdict = "met" if over is not None and over > 1 else "**not met**"
            lines.append(
                f"- `{best.method}` against {engine}'s best speculative configuration `{theirs.method}` "
                f"({theirs.tokens_per_s:.1f} tokens/s): {fmt(over, '.2f', 'x')} (goal: ahead: {verdict})."
            )
    return lines


def _model_free_goal_lines(cells: Sequence[CellResult]) -> list[str]:
    """The goals of the model-free drafters: ``suffix`` >= 1.3x the tokens/s of ``pld`` on grounded tasks;
    ``recycling`` above ``pld`` in mean accepted tokens on mt-bench.  Every ``suffix`` / ``recycling`` method is
    compared with the first listed ``pld`` method."""
    ours = [c for c in cells if c.kind == "ours"]
    pld: dict[str, CellResult] = {}
    for c in ours:
        if c.method.split(":")[0] == "pld":
            pld.setdefault(c.task, c)
    lines = []
    for c in ours:
        drafter = c.method.split(":")[0]
        if drafter == "suffix" and c.task in GROUNDED_TASKS and c.task in pld:
            over = ratio(c.tokens_per_s, pld[c.task].tokens_per_s)
            verdict = "met" if over is not None and over >= 1.3 else "**not met**"
            lines.append(
                f"- `{c.method}` on {c.task}: {fmt(over, '.2f', 'x')} the tokens/s of "
                f"`{pld[c.task].method}` (goal >= 1.3x: {verdict})."
            )
        if drafter == "recycling" and c.task == "mt-bench" and c.task in pld:
            reference = pld[c.task]
            above = (c.mean_accepted_tokens or 0) > (reference.mean_accepted_tokens or 0)
            lines.append(
                f"- `{c.method}` on mt-bench: {fmt(c.mean_accepted_tokens)} mean accepted tokens vs "
                f"{fmt(reference.mean_accepted_tokens)} for `{reference.method}` "
                f"(goal: above: {'met' if above else '**not met**'})."
            )
    return lines


def write_report(results: Mapping[str, Any], cells: Sequence[CellResult], out: Path) -> list[Path]:
    """``results.md``, ``speedup.png`` and (with a sweep) ``draft_length.png`` in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    model = results["settings"]["model"]
    written = [out / "results.md"]
    written[0].write_text(markdown(results, cells))
    if any(c.speedup is not None for c in cells):
        title = f"{Path(model).name}: speed-up per task"
        plot_speedup(cells, out / "speedup.png", title, results["settings"]["baseline"])
        written.append(out / "speedup.png")
    if curves := _sweep_cells(results, cells):
        plot_draft_length(curves, out / "draft_length.png", f"{Path(model).name}: draft length")
        written.append(out / "draft_length.png")
    return written
