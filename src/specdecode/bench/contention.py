"""``specdecode bench contention``: decoding speed with one busy process beside us, against the idle speed.

A laptop or a shared server always has something else running, and torch's spin-waiting OpenMP threads collapse
when another process keeps one of the cores they count on busy (see :mod:`specdecode.threads`, whose thread
governor is what this benchmark checks; measured in ``docs/results/contention-smollm2-135m``).  For each
contestant — our plain and ``pld`` decoding with governed threads, our plain decoding with the thread count
fixed at the number of CPUs (no governor), and transformers' plain and prompt-lookup
``generate()`` as a user runs them (torch's default threads, no CPU fast path) — the same prompts are decoded
twice in a row: idle, then with one competitor (a Python busy loop) running.  The competitor starts before
an untimed warm-up generation, so the governor has settled (it needs about a second) when timing starts.

Goals (:mod:`specdecode.bench.contention_report`): with one busy competitor on 2 cores we keep at least 45% of
our idle tokens/s, and the speed-up of ``pld`` over plain stays within 20% of its idle value.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedModel

from specdecode.bench import common, peers
from specdecode.bench.contention_report import CONDITIONS, CONTESTANTS, write_report
from specdecode.bench.resume import resume, run_fingerprint, save_json
from specdecode.data.tasks import Task, load_tasks
from specdecode.generator import SpeculativeGenerator
from specdecode.models.loading import LoadedModel, fast_path_default, load_model
from specdecode.threads import GOVERNOR, fixed_threads, process_cpus

SCHEMA_VERSION = 1
DEFAULTS: dict[str, Any] = {
    "model": "smollm2-135m",
    "tasks": ("edit", "summarize", "rag", "humaneval"),
    "prompts_per_task": 1,
    "max_new_tokens": 64,
    "seed": 0,
    "out": "bench-out/contention",
}
BUSY_LOOP = "while True:\n    pass\n"


@dataclass(frozen=True)
class ContentionSettings(common.PromptSettings):
    """No ``threads``: how many threads to run is what this benchmark leaves to the governor, and checks."""


def resolve_settings(**overrides: Any) -> ContentionSettings:
    """The defaults, overridden by every given (non-None) value; strings are parsed as on the command line."""
    parsers = {"tasks": common.split_names}
    return ContentionSettings(
        **common.resolve_values(ContentionSettings, DEFAULTS, overrides, "contention setting", parsers)
    )


@contextmanager
def busy_competitor() -> Iterator[None]:
    """One other process keeping one CPU busy for as long as the block runs."""
    process = subprocess.Popen([sys.executable, "-c", BUSY_LOOP])
    try:
        yield
    finally:
        process.kill()
        process.wait()


Decode = Callable[[list[int], int], list[int]]


def contestants(target: LoadedModel, peer: PreTrainedModel) -> dict[str, tuple[Decode, int | None]]:
    """Each contestant's decode(prompt ids, new tokens) → token ids, and the thread count it is held at
    (None: the governor chooses).  ``peer`` is the target loaded without our fast path, as transformers'
    users run it."""
    cpus = len(process_cpus())

    def ours(drafter: str) -> Decode:
        generator = SpeculativeGenerator.build(target, drafter)

        def decode(ids: list[int], new_tokens: int) -> list[int]:
            generator.reset_drafter()
            return generator.generate(ids, max_new_tokens=new_tokens, ignore_eos=True).token_ids

        return decode

    def hf(call: Callable[..., peers.PeerResult]) -> Decode:
        return lambda ids, new_tokens: call(peer, ids, new_tokens, ignore_eos=True).token_ids

    return {
        "none": (ours("none"), None),
        "pld": (ours("pld"), None),
        "none-fixed-threads": (ours("none"), cpus),
        "hf-plain": (hf(peers.hf_plain), cpus),
        "hf-prompt-lookup": (hf(peers.hf_prompt_lookup), cpus),
    }


def measure_cell(decode: Decode, threads: int | None, prompts: Sequence[list[int]], new_tokens: int) -> dict:
    """Decode every prompt after an untimed warm-up: tokens/s over the whole set, and the threads used."""
    with fixed_threads(threads):
        decode(prompts[0], min(8, new_tokens))
        started = time.perf_counter()
        outputs = [decode(ids, new_tokens) for ids in prompts]
        wall_s = time.perf_counter() - started
        used = GOVERNOR.threads
    tokens = sum(len(out) for out in outputs)
    return {
        "tokens": tokens,
        "wall_s": round(wall_s, 3),
        "tokens_per_s": round(tokens / wall_s, 2),
        "threads_at_end": used,
        "outputs": outputs,
    }


def run_contention(
    settings: ContentionSettings, tasks: Sequence[Task] | None = None, progress: bool = True
) -> dict[str, Any]:
    """Measure every (contestant, condition) not yet in ``settings.out/results.json``; write the report.
    ``tasks`` replaces the real prompt sets (tests inject tiny ones).  Returns the results JSON."""
    tasks = list(tasks) if tasks is not None else load_tasks(settings.tasks, settings.prompts_per_task, settings.seed)
    path = settings.out / "results.json"
    fingerprint = run_fingerprint(settings, tasks)
    results = resume(path, fingerprint) or common.new_results(SCHEMA_VERSION, fingerprint)
    results["settings"] = settings.to_json()
    done = {(c["method"], c["condition"]) for c in results["cells"]}
    pending = [(name, condition) for name in CONTESTANTS for condition in CONDITIONS if (name, condition) not in done]
    if pending:
        target = load_model(settings.model)
        decoders = contestants(target, load_model(settings.model, fast_path=False).backend.model)
        encode = common.PromptEncoder(target, settings.model, settings.max_new_tokens)
        prompts = [p.ids for p in encode.encode_tasks(tasks)]
        cpus = len(process_cpus())
        results.setdefault("environment", common.environment(cpus))
        governed = f"{cpus} or fewer (governed: {'adaptive' if GOVERNOR.adaptive else 'fixed here'})"
        results["environment"].update(fast_path=fast_path_default(), threads=governed)
        started = time.perf_counter()
        for name, condition in pending:
            if progress:
                print(f"[bench contention] {name}, {condition}", file=sys.stderr, flush=True)
            decode, threads = decoders[name]
            with busy_competitor() if condition == "busy" else nullcontext():
                cell = measure_cell(decode, threads, prompts, settings.max_new_tokens)
            started = common.add_cell(results, {"method": name, "condition": condition, **cell}, path, started)
        results["environment"]["load_average_end"] = common.load_average()
    save_json(path, results)
    write_report(results, settings.out)
    return results
