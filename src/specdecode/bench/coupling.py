"""``specdecode bench coupling``: what drafter-invariant sampling costs in acceptance, next to rejection sampling.

Seeded sampling is verified by Gumbel-max coupling (:mod:`specdecode.verify.coupled`) so that a seed gives one
text whatever drafts it.  The price is acceptance: a drafted token must now equal one particular draw, where
rejection sampling keeps it with probability min(1, p/q).  This benchmark measures that price on real
prompts: every method decodes every prompt twice with the same seed — coupled, and with rejection sampling
(``coupled=False``) — and reports per method and verifier the mean accepted tokens per step, the draft
acceptance rate and tokens/s, and whether the outputs equal plain (``none``) coupled decoding of the same
seed, which the coupled ones must (drafter invariance).

Every decode starts from a cold drafter (``reset_drafter``): otherwise a drafter that learns from earlier
outputs (``suffix``, ``recycling``) would favour whichever verifier ran second on a prompt.  EOS ends a
decode as it would for a user.  One short untimed decode per method first: first-call allocations and the
cost curve ``auto`` measures once are not decoding.  Not resumable: a run takes minutes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from specdecode.bench import common
from specdecode.bench.coupling_report import REFERENCE, markdown, summarize_row
from specdecode.bench.methods import MethodSpec, parse_methods
from specdecode.bench.metrics import decode_record
from specdecode.data.tasks import TASK_NAMES, Task, load_tasks
from specdecode.errors import SpecDecodeError
from specdecode.generator import SpeculativeGenerator
from specdecode.models.loading import fast_path_default, load_model
from specdecode.models.quantize import check_quantize
from specdecode.threads import fixed_threads

VERIFIERS = ("coupled", "rejection")
WARMUP_TOKENS = 8
#: Prompt selection: the quick suite's prompts (``bench --suite quick``), whatever the sampling seed.
PROMPT_SEED = 0
DEFAULTS: dict[str, Any] = {
    "model": "smollm2-135m",
    # The drafters that run on smollm2-135m out of the box: no registered model shares its vocabulary
    # (so no draft-model), and the head drafters need training.  stand is the one that samples its drafts.
    "methods": "pld,suffix,recycling,stand",
    "tasks": TASK_NAMES,
    "prompts_per_task": 1,
    "max_new_tokens": 64,
    "temperature": 0.8,
    # What OpenAI-style clients often send (0.9-0.95): the nucleus is cut over every verified row.
    "top_p": 1.0,
    "seed": 0,
    "quantize": "none",
    "out": "bench-out/coupling",
}


@dataclass(frozen=True)
class CouplingSettings(common.PromptSettings):
    methods: tuple[MethodSpec, ...]
    temperature: float
    top_p: float
    quantize: str
    threads: int

    def __post_init__(self) -> None:
        super().__post_init__()
        common.check_positive_ints(("--threads", self.threads))
        if not common.is_number(self.temperature):
            raise SpecDecodeError(f"--temperature must be a number, got {self.temperature!r}")
        if self.temperature <= 0:  # greedy decoding samples nothing: there is no verifier to compare
            raise SpecDecodeError(f"--temperature must be > 0 (coupling is for sampling), got {self.temperature}")
        if not common.is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise SpecDecodeError(f"--top-p must be in (0, 1], got {self.top_p!r}")
        check_quantize(self.quantize)


def resolve_settings(**overrides: Any) -> CouplingSettings:
    """The defaults, overridden by every given (non-None) value; strings are parsed as on the command line.
    ``none`` is always measured (first), so it is dropped from ``methods``."""
    parsers = {"methods": parse_methods, "tasks": common.split_names}
    values = common.resolve_values(CouplingSettings, DEFAULTS, overrides, "coupling setting", parsers)
    return CouplingSettings(**{**values, "methods": tuple(m for m in values["methods"] if m.spec != REFERENCE)})


def decode(
    generator: SpeculativeGenerator, method: MethodSpec, ids: list[int], settings: CouplingSettings, coupled: bool
) -> dict[str, Any]:
    """One seeded decode from a cold drafter → its per-prompt record (token ids and the stats' counts)."""
    generator.reset_drafter()
    result = generator.generate(
        ids,
        max_new_tokens=settings.max_new_tokens,
        num_draft_tokens=method.k,
        temperature=settings.temperature,
        top_p=settings.top_p,
        seed=settings.seed,
        coupled=coupled,
    )
    return {"token_ids": result.token_ids, **decode_record(result.stats)}


def measure_coupling(
    settings: CouplingSettings, tasks: Sequence[Task] | None = None, progress: bool = True
) -> dict[str, Any]:
    """Decode every prompt with every method (``none`` first) and both verifiers; write results.json and
    results.md to ``settings.out`` and return the results.  ``tasks`` replaces the real prompts (tests)."""
    tasks = list(tasks) if tasks is not None else load_tasks(settings.tasks, settings.prompts_per_task, PROMPT_SEED)
    target = load_model(settings.model, quantize=settings.quantize)
    draft_names = sorted({m.draft_model for m in settings.methods} - {None})
    drafts = {name: load_model(name, quantize=settings.quantize) for name in draft_names}
    encoded = common.PromptEncoder(target, settings.model, settings.max_new_tokens).encode_tasks(tasks)
    if not encoded:
        raise SpecDecodeError("the selected tasks have no prompts")
    keys = [e.key for e in encoded]
    methods = [MethodSpec(REFERENCE, spec=REFERENCE), *settings.methods]
    results: dict[str, Any] = {
        "settings": settings.to_json(),
        "prompts": [{"prompt": e.key, "prompt_tokens": len(e.ids)} for e in encoded],
        "environment": {**common.environment(settings.threads), "fast_path": fast_path_default()},
        "rows": [],
    }
    reference: dict[str, list[int]] = {}
    started = time.perf_counter()
    with (
        fixed_threads(settings.threads),
        tqdm(total=len(methods) * 2 * len(encoded), unit="decode", desc="bench coupling", disable=not progress) as bar,
    ):
        for method in methods:
            generator = SpeculativeGenerator.build(target, method.drafter, **common.drafter_options(method, drafts))
            warmup = dict(max_new_tokens=WARMUP_TOKENS, temperature=settings.temperature, top_p=settings.top_p)
            generator.generate(encoded[0].ids, **warmup)
            records: dict[str, list[dict]] = {verifier: [] for verifier in VERIFIERS}
            for prompt in encoded:  # both verifiers on a prompt back to back: a drift in speed hits both alike
                for verifier in VERIFIERS:
                    bar.set_postfix_str(f"{method.spec} {verifier}", refresh=False)
                    records[verifier].append(decode(generator, method, prompt.ids, settings, verifier == "coupled"))
                    bar.update()
            if method.spec == REFERENCE:
                reference = {key: r["token_ids"] for key, r in zip(keys, records["coupled"])}
            results["rows"] += [summarize_row(method.spec, v, keys, records[v], reference) for v in VERIFIERS]
    results["environment"]["load_average_end"] = common.load_average()
    results["measure_s"] = round(time.perf_counter() - started, 1)
    common.save_json(settings.out / "results.json", results)
    (settings.out / "results.md").write_text(markdown(results))
    return results
