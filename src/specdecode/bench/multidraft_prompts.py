"""``specdecode bench multidraft --model M``: the multi-draft verifiers on real prompts, each judged on the same drafts.

The target decodes the quick prompts (one per task) at each ``--temperatures`` value while the EAGLE head drafts
trees of k i.i.d. draws per node, ``--depth`` levels (``eagle:samples=k``, a fixed draft length); recursive
rejection sampling (``exact``, uncoupled) verifies them and so decides the text.  At every step, before the decode
goes on, each verifier — recursive rejection sampling, ``spectr``, ``optimal-md`` — verifies that same draft against
that same target output ``--trials`` times with fresh random draws, and the tokens it would have emitted (accepted +
1) are averaged: its tokens per step on those drafts.  The verifiers differ only in their own decisions; what is left
is the trials' noise, reported as a standard error of the difference to rejection sampling (paired by step).  At
each step's first node the probability that each verifier keeps one of the k drafts is also computed in closed form
from the two distributions, beside alpha*, the most any lossless verifier can keep: how much room there was.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from specdecode.bench import common
from specdecode.bench.methods import parse_int_list
from specdecode.bench.multidraft import VERIFIERS, parse_temperatures, rejection_kept
from specdecode.data.tasks import TASK_NAMES, load_tasks
from specdecode.drafters.base import DraftSession
from specdecode.errors import SpecDecodeError
from specdecode.generator import SpeculativeGenerator
from specdecode.models.loading import load_model
from specdecode.sampling import sampling_probs
from specdecode.sampling_params import SamplingParams
from specdecode.threads import fixed_threads
from specdecode.types import Draft, StepFeedback
from specdecode.verify.base import TargetRows
from specdecode.verify.optimal_md import OptimalOptions, TransportPlan, optimal_acceptance
from specdecode.verify.registry import VerifierChoice
from specdecode.verify.spectr import KSequential

#: How each verifier of :data:`VERIFIERS` is asked for: recursive rejection sampling is ``exact`` without coupling.
CHOICES = {"rejection": "exact", "spectr": "spectr", "optimal-md": "optimal-md"}
#: The quick suite's prompts, whatever the sampling seed.
PROMPT_SEED = 0
DEFAULTS: dict[str, Any] = {
    "model": "smollm2-135m",
    "tasks": TASK_NAMES,
    "prompts_per_task": 1,
    "max_new_tokens": 64,
    "drafts": (4,),
    "temperatures": (0.8,),
    "depth": 3,
    "trials": 32,
    "seed": 0,
    "threads": 2,
    "out": "bench-out/multidraft-prompts",
}


@dataclass(frozen=True)
class PromptMultidraftSettings(common.PromptSettings):
    drafts: tuple[int, ...]
    temperatures: tuple[float, ...]
    depth: int
    trials: int
    threads: int

    def __post_init__(self) -> None:
        super().__post_init__()
        common.check_positive_int_list("--drafts", self.drafts)
        common.check_positive_ints(("--depth", self.depth), ("--trials", self.trials), ("--threads", self.threads))
        if not self.temperatures or not all(common.is_number(t) and t > 0 for t in self.temperatures):
            raise SpecDecodeError(f"--temperatures must be numbers > 0, got {self.temperatures!r}")


def resolve_settings(**overrides: Any) -> PromptMultidraftSettings:
    parsers = {
        "drafts": lambda text: parse_int_list(text, "--drafts"),
        "temperatures": parse_temperatures,
        "tasks": common.split_names,
    }
    values = common.resolve_values(PromptMultidraftSettings, DEFAULTS, overrides, "setting", parsers)
    return PromptMultidraftSettings(**values)


def tree_nodes(k: int, depth: int) -> int:
    """Nodes of a full tree of k children per node, ``depth`` levels deep."""
    return sum(k**level for level in range(1, depth + 1))


def root_acceptance(p: np.ndarray, q: np.ndarray, k: int) -> dict[str, float]:
    """At a node of k i.i.d. drafts from q under target p: the probability that each verifier keeps one of them
    (in expectation over the draws, closed form) and alpha*, the most any lossless verifier can.  ``optimal-md`` as
    the verifier runs it: its programme over the tokens it can afford, or K-SEQ where that keeps more."""
    spectr = KSequential.solve(p, q, k).acceptance
    plan = TransportPlan.solve(p, q, k, OptimalOptions().max_multisets)
    optimal = plan.acceptance if plan.complete else max(plan.acceptance, spectr)
    return {
        "rejection": float(rejection_kept(p, q, k).sum()),
        "spectr": spectr,
        "optimal-md": optimal,
        "optimum": optimal_acceptance(p, q, k),
    }


class TokensPerStep:
    """Each verifier's tokens per step on the drafts of one decode: ``trials`` verifications of every step; and at
    each step's first node, the closed-form acceptances of :func:`root_acceptance`."""

    def __init__(self, sampling: SamplingParams, trials: int, seed: int) -> None:
        self.sampling = sampling
        self.trials = trials
        self.generator = torch.Generator().manual_seed(seed)
        self.choices = {name: VerifierChoice(CHOICES[name]) for name in VERIFIERS}
        self.steps: dict[str, list[float]] = {name: [] for name in VERIFIERS}
        self.roots: dict[str, list[float]] = {name: [] for name in (*VERIFIERS, "optimum")}

    def judge(self, draft: Draft, target_logits: torch.Tensor) -> None:
        rows = TargetRows(target_logits, self.sampling, generator=self.generator)
        for name, choice in self.choices.items():
            emitted = [len(choice.verify(rows, draft).path) + 1 for _ in range(self.trials)]
            self.steps[name].append(float(np.mean(emitted)))
        first = [node for node, parent in enumerate(draft.parent_list) if parent == -1]
        p = sampling_probs(rows.processed_logits[0].float(), self.sampling).double().numpy()
        q = draft.probs[first[0]].double().numpy()
        for name, value in root_acceptance(p / p.sum(), q / q.sum(), len(first)).items():
            self.roots[name].append(value)


class JudgedSession(DraftSession):
    """A drafting session whose every verified draft is judged by :class:`TokensPerStep` as well."""

    reads_target_logits = True

    def __init__(self, inner: DraftSession, judge: TokensPerStep) -> None:
        self.inner = inner
        self.judge = judge
        self.hidden_layers = inner.hidden_layers
        self.proposes_first = inner.proposes_first

    def observe_prompt(self, hidden: torch.Tensor) -> None:
        self.inner.observe_prompt(hidden)

    def propose(self, context: list[int], max_tokens: int) -> Draft:
        return self.inner.propose(context, max_tokens)

    def observe(self, context: list[int], feedback: StepFeedback) -> None:
        if feedback.asked and feedback.draft.tokens:
            self.judge.judge(feedback.draft, feedback.target_logits.float().cpu())
        self.inner.observe(context, feedback)

    def finish(self, context: list[int]) -> None:
        self.inner.finish(context)


def measure_cell(target: Any, prompts: list[list[int]], settings: PromptMultidraftSettings, k: int, t: float, bar):
    generator = SpeculativeGenerator.build(target, "eagle", samples=k, tree_nodes=tree_nodes(k, settings.depth))
    sampling = SamplingParams(temperature=t, coupled=False)
    judge = TokensPerStep(sampling, settings.trials, settings.seed)
    drafter = generator.drafter
    open_session = drafter.session
    drafter.session = lambda request: JudgedSession(open_session(request), judge)  # every request's drafts judged
    tokens = 0
    for index, ids in enumerate(prompts):
        result = generator.generate(
            ids,
            max_new_tokens=settings.max_new_tokens,
            num_draft_tokens=settings.depth,
            temperature=t,
            seed=settings.seed + index,
            coupled=False,
        )
        tokens += len(result.token_ids)
        bar.update()
    steps = {name: np.array(values) for name, values in judge.steps.items()}
    cell: dict[str, Any] = {"drafts": k, "temperature": t, "steps": len(steps["rejection"]), "tokens": tokens}
    cell["root_acceptance"] = {name: float(np.mean(values)) for name, values in judge.roots.items()}
    for name in VERIFIERS:
        gain = steps[name] - steps["rejection"]
        cell[name] = {
            "tokens_per_step": float(steps[name].mean()),
            "gain_over_rejection": float(steps[name].mean() / steps["rejection"].mean() - 1.0),
            "gain_standard_error": float(gain.std(ddof=1) / np.sqrt(len(gain)) / steps["rejection"].mean())
            if len(gain) > 1
            else 0.0,
        }
    return cell


def measure_prompt_multidraft(settings: PromptMultidraftSettings, progress: bool = True) -> dict[str, Any]:
    tasks = load_tasks(settings.tasks, settings.prompts_per_task, PROMPT_SEED)
    target = load_model(settings.model)
    encoded = common.PromptEncoder(target, settings.model, settings.max_new_tokens).encode_tasks(tasks)
    if not encoded:
        raise SpecDecodeError("the selected tasks have no prompts")
    prompts = [e.ids for e in encoded]
    results: dict[str, Any] = {
        "settings": settings.to_json(),
        "prompts": [e.key for e in encoded],
        "environment": common.environment(settings.threads),
        "cells": [],
    }
    started = time.perf_counter()
    cells = [(k, t) for k in settings.drafts for t in settings.temperatures]
    with (
        fixed_threads(settings.threads),
        tqdm(total=len(cells) * len(prompts), unit="decode", desc="bench multidraft", disable=not progress) as bar,
    ):
        for k, t in cells:
            results["cells"].append(measure_cell(target, prompts, settings, k, t, bar))
    results["minutes"] = (time.perf_counter() - started) / 60
    settings.out.mkdir(parents=True, exist_ok=True)
    (settings.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (settings.out / "results.md").write_text(markdown(results))
    return results


def markdown(results: dict[str, Any]) -> str:
    settings, env = results["settings"], results["environment"]
    lines = [
        f"# Multi-draft verifiers on real prompts: `{settings['model']}`",
        "",
        f"{len(results['prompts'])} prompts ({', '.join(settings['tasks'])}), up to {settings['max_new_tokens']} new "
        f"tokens; the `eagle` head drafts k i.i.d. draws per node, {settings['depth']} levels; recursive rejection "
        f"sampling decides the text, and at every step each verifier verifies the same draft against the same target "
        f"output {settings['trials']} times. Tokens per step = accepted + 1; ± one standard error of the paired "
        "difference.",
        "",
        "| k | temperature | steps | tokens per step: rejection / spectr / optimal-md | spectr over rejection "
        "| optimal-md over rejection | first node's acceptance: rejection / spectr / optimal-md / alpha* |",
        "|---|---|---|---|---|---|---|",
    ]
    for cell in results["cells"]:
        per_step = " / ".join(f"{cell[v]['tokens_per_step']:.3f}" for v in VERIFIERS)
        first_node = " / ".join(f"{cell['root_acceptance'][v]:.3f}" for v in (*VERIFIERS, "optimum"))
        gains = [f"{cell[v]['gain_over_rejection']:+.1%} ± {cell[v]['gain_standard_error']:.1%}" for v in VERIFIERS[1:]]
        lines.append(
            f"| {cell['drafts']} | {cell['temperature']:g} | {cell['steps']} | {per_step} | {' | '.join(gains)} "
            f"| {first_node} |"
        )
    lines += [
        "",
        f"One run: {env.get('cpu', '?')}, {settings['threads']} threads; torch {env.get('torch', '?')}; "
        f"{results['minutes']:.1f} min (no timing is reported: the figures are counts).",
    ]
    return "\n".join(lines) + "\n"
