"""How a backend's forward time grows with the number of new tokens: the cost curve of verification.

Speculation with k drafted tokens replaces k+1 one-token forwards by one (k+1)-token forward, so its
speed-up is bounded by ``(k+1) * t(1) / t(k+1)``.  The draft-length cost model (``--num-draft-tokens
auto``) needs the shape of that curve, so measuring it belongs to the models layer; the benchmark's
``forward-cost`` command reports it in full.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from weakref import WeakKeyDictionary

import torch
from torch import nn

from specdecode.machine import cpu_flags, cpu_name
from specdecode.models.base import CausalLM, KVCache, SequenceInput
from specdecode.models.cache import cache_dir
from specdecode.models.cpu_kernels import bf16_widened_pays, cpu_kernels_built, kernels_source_digest
from specdecode.models.fastpath import DENSE_ROWS, PackedLinear, dense_copies, use_dense_rows
from specdecode.models.greedy_head import greedy_head_applies
from specdecode.threads import OthersLoad

_SEED = 0


def linear_curve(ratio_8_1: float, widths: int = 16) -> tuple[float, ...]:
    """A relative cost curve t(w) / t(1) growing linearly to ``ratio_8_1`` at w = 8 (a stand-in before
    anything is measured)."""
    return tuple(1.0 + (w - 1) * (ratio_8_1 - 1.0) / 7.0 for w in range(1, widths + 1))


def prefilled(backend: CausalLM, context_tokens: int, max_new: int) -> tuple[KVCache, torch.Tensor]:
    """A cache holding ``context_tokens`` tokens, plus ``max_new`` tokens to run on top of it.

    Token values do not change the cost of a dense forward, so fixed pseudo-random ids stand in for text.
    """
    if context_tokens < 1 or max_new < 1:
        raise ValueError("context_tokens and max_new must be at least 1")
    if context_tokens + max_new > backend.max_context:
        raise ValueError(
            f"context_tokens + max_new = {context_tokens + max_new} exceeds the model's context "
            f"of {backend.max_context} tokens"
        )
    generator = torch.Generator().manual_seed(_SEED)
    ids = torch.randint(0, backend.vocab_size, (context_tokens + max_new,), generator=generator)
    cache = backend.new_cache()
    backend.forward(ids[:context_tokens], cache, logits_rows=slice(-1, None), invariant=False)
    return cache, ids[context_tokens:]


def timed_rounds(
    backend: CausalLM, context_tokens: int, max_new: int, repeats: int, warmup: int
) -> dict[int, list[float]]:
    """Seconds of a forward over n = 1..max_new new tokens after ``context_tokens`` cached ones, ``repeats``
    samples each after ``warmup`` rounds.

    Rounds go over every n in turn (rather than all repeats of one n, then the next) so that a burst of
    load from other processes spreads over the whole curve instead of distorting one point.
    """
    cache, new = prefilled(backend, context_tokens, max_new)
    samples: dict[int, list[float]] = {n: [] for n in range(1, max_new + 1)}
    for round_index in range(warmup + repeats):
        for n, elapsed in zip(samples, timed_round(backend, cache, new)):
            if round_index >= warmup:
                samples[n].append(elapsed)
    return samples


def timed_round(
    backend: CausalLM, cache: KVCache, new: torch.Tensor, widths: Sequence[int] | None = None
) -> list[float]:
    """Seconds of a forward over the first n of ``new`` on top of ``cache``, for each n of ``widths`` (default
    1..len(new)) in turn, as a greedy request's verification runs it (each row's choice where the backend computes
    choices without the logits, :mod:`specdecode.models.greedy_head`); the cache is cropped back after each."""
    length, seconds = cache.length, []
    for n in widths or range(1, len(new) + 1):
        start = time.perf_counter()
        backend.forward_batch([SequenceInput(new[:n], cache, choices_only=True)])
        seconds.append(time.perf_counter() - start)
        cache.crop(length)
    return seconds


def fastest_forwards(
    backend: CausalLM, widths: Sequence[int], context_tokens: int = 32, repeats: int = 2
) -> dict[int, float]:
    """The fastest seconds of a forward over each of ``widths`` new tokens after ``context_tokens`` cached ones, of
    ``repeats`` rounds after one that warms up (the widths interleaved, as in :func:`timed_rounds`)."""
    cache, new = prefilled(backend, context_tokens, max(widths))
    fastest = dict.fromkeys(widths, float("inf"))
    for round_index in range(repeats + 1):
        for width, elapsed in zip(widths, timed_round(backend, cache, new, widths)):
            if round_index:
                fastest[width] = min(fastest[width], elapsed)
    cache.release()
    return fastest


#: The context the draft-length cost model's curve is measured after: the short prompts most requests have.
CURVE_CONTEXT_TOKENS = 128
#: Timed rounds a curve takes the fastest of, per width.  Trees are sized by the curve, and two rounds spread it widely
#: on a shared 2-core VM: four curves of SmolLM2 in bf16, one after another, put 16 inputs at 1.18-1.76 one-input
#: forwards and 9 at 1.07-1.39; six rounds at 1.32-1.65 and 1.12-1.28 (docs/results/panel-row-blocks-epyc-smollm2-135m).
CURVE_REPEATS = 6
#: From this context on, a sequence's verification is priced with curves measured at long contexts
#: (:class:`VerificationCosts`): below it the curve after ``CURVE_CONTEXT_TOKENS`` tokens differs little (attention
#: over a thousand keys is a small part of a forward: 5 inputs cost 1.09x one after 128 tokens and 1.15x after 1,024 on
#: smollm2-135m), above it 1.24x at 2k tokens and 1.59x at 8k (docs/results/longctx-auto-smollm2-135m).
LONG_CONTEXT_TOKENS = 1024
#: Each loaded backend's measured curves, by the context they were measured after.
_CURVES: WeakKeyDictionary[CausalLM, dict[int, tuple[float, ...]]] = WeakKeyDictionary()
_TUNED: WeakKeyDictionary[CausalLM, int] = WeakKeyDictionary()


def cost_at(curve: tuple[float, ...], width: int) -> float:
    """The relative cost of a forward over ``width`` inputs from a curve of t(w) / t(1) for w = 1, 2, ...:
    read off the curve, or extrapolated linearly past it (from its first and last points)."""
    if width <= len(curve):
        return curve[max(width, 1) - 1]
    slope = (curve[-1] - curve[0]) / (len(curve) - 1) if len(curve) > 1 else 0.0
    return curve[-1] + slope * (width - len(curve))


def monotone_fit(values: list[float]) -> list[float]:
    """The non-decreasing sequence closest to ``values`` in least squares (pool adjacent violators).

    A forward never gets cheaper with more inputs, so a width measured faster than a narrower one is
    noise; pooling the two keeps the measured shape otherwise, steps included."""
    blocks: list[tuple[float, int]] = []  # (mean, count) of pooled runs
    for value in values:
        mean, count = value, 1
        while blocks and blocks[-1][0] > mean:
            previous, previous_count = blocks.pop()
            mean = (previous * previous_count + mean * count) / (previous_count + count)
            count += previous_count
        blocks.append((mean, count))
    return [mean for mean, count in blocks for _ in range(count)]


def timed_relative_curve(backend: CausalLM, context_tokens: int, widths: int, repeats: int) -> tuple[float, ...]:
    """One measurement of ``t(w) / t(1)``, w = 1..widths, after ``context_tokens``: the fastest of ``repeats`` rounds
    per width after a warm-up round, made non-decreasing (:func:`monotone_fit`); nothing cached or read."""
    samples = timed_rounds(backend, context_tokens, widths, repeats, warmup=1)
    fitted = monotone_fit([min(samples[w]) for w in range(1, widths + 1)])
    return tuple(t / fitted[0] for t in fitted)


def relative_cost_curve(
    backend: CausalLM, widths: int = 16, repeats: int = CURVE_REPEATS, context_tokens: int = CURVE_CONTEXT_TOKENS
) -> tuple[float, ...] | None:
    """``t(w) / t(1)`` for w = 1..widths after ``context_tokens`` cached tokens (at most the model's context less
    ``widths``), measured once per machine, model structure and context: cached per loaded backend, and on disk
    (:func:`curve_file`) for the next process on the same machine.  Attention reads the whole context for every
    new token, so the curve's shape changes with the context's length (``bench forward-cost --context-tokens
    256,4096,8000`` compares them).

    The draft-length cost model needs the *shape* of the verification cost (its scale it learns online),
    and a quick measurement (``(repeats + 1) * widths`` forwards, interleaved over widths) beats a guess.
    It takes the fastest of the repeats, not the median (other processes only ever add time), and then
    the closest non-decreasing curve (:func:`monotone_fit`).  The shape is kept as measured because it is
    often not a line: torch's int4 and int8 kernels work in blocks of 4 rows, so widths 2-4 cost little more
    than one input and width 5 jumps (``docs/results/quantize-qwen2.5-coder-1.5b/forward-cost-int4.json``); a
    straight line through all widths overprices the 1-3 tokens that pay, and the policy would never draft them
    (``docs/results/curve-shape``).
    None if the model's context is too short to measure on."""
    context_tokens = min(context_tokens, backend.max_context - widths)
    if context_tokens < 1:
        return None
    measured = _CURVES.setdefault(backend, {})
    if context_tokens in measured:
        return measured[context_tokens]
    key = _machine_and_model_key(backend, widths, repeats, context_tokens)
    saved = saved_entry(key) if key else None
    curve = saved.get("curve") if saved else None
    if isinstance(curve, list) and len(curve) == widths and all(isinstance(c, (int, float)) for c in curve):
        measured[context_tokens] = tuple(float(c) for c in curve)
        return measured[context_tokens]
    with OthersLoad() as others:
        measured[context_tokens] = timed_relative_curve(backend, context_tokens, widths, repeats)
    if key and not others.busy:  # a curve timed on a busy machine serves this process only
        save_entry(key, {"curve": list(measured[context_tokens]), "context_tokens": context_tokens})
    return measured[context_tokens]


class VerificationCosts:
    """A verification forward's cost relative to one input, by its width and by the context it runs after.

    Attention reads the whole context for every new token, so the wider forward's extra cost grows with the context.
    ``curves`` maps a context length to the curve t(w) / t(1) measured after that many tokens; a context between two
    measured ones is priced between their curves (linearly in the context), one beyond the longest at the longest's,
    one below the shortest at the shortest's.  :meth:`prepare` measures, where ``measure`` can, the curve at the
    power of two (from ``LONG_CONTEXT_TOKENS``) at or below a context a sequence has reached: at most the prefill of
    a prompt that long, once per machine and model (kept on disk as every curve is).  It measures; :meth:`relative`
    never does, so that no step's drafting or verification is timed with a measurement inside."""

    def __init__(
        self, curves: dict[int, tuple[float, ...]], measure: Callable[[int], tuple[float, ...] | None] | None = None
    ) -> None:
        if not curves or any(not curve or curve[0] <= 0 for curve in curves.values()):
            raise ValueError("verification costs need a curve with a positive cost for one input")
        for context, curve in curves.items():
            if curve[0] != 1.0:  # measured curves are relative already (and stay the very objects measured)
                curves[context] = tuple(c / curve[0] for c in curve)
        self.curves = curves  # shared with the backend's measured curves where measured on one (verification_costs)
        self.measure = measure
        self._contexts: list[int] = []  # curves' contexts, sorted (curves are only ever added)

    @classmethod
    def of(cls, curve: Sequence[float]) -> VerificationCosts:
        """One curve, used at every context (nothing measured)."""
        return cls({CURVE_CONTEXT_TOKENS: tuple(curve)})

    @property
    def base(self) -> tuple[float, ...]:
        """The curve after the shortest context measured (``CURVE_CONTEXT_TOKENS`` where the model allows)."""
        return self.curves[min(self.curves)]

    def prepare(self, context_tokens: int) -> None:
        """Measure the curve a sequence ``context_tokens`` long is priced with, if not measured yet (see the class)."""
        if self.measure is None or context_tokens < LONG_CONTEXT_TOKENS:
            return
        bucket = 1 << (context_tokens.bit_length() - 1)
        if bucket not in self.curves and (curve := self.measure(bucket)) is not None:
            self.curves[bucket] = curve

    def relative(self, width: int, context_tokens: int = 0) -> float:
        """t(width) / t(1) after ``context_tokens`` cached tokens (0: the shortest context measured)."""
        if len(self._contexts) != len(self.curves):
            self._contexts = sorted(self.curves)
        contexts = self._contexts  # read many times a step (the batch plan): no list built per call
        above = bisect.bisect_right(contexts, context_tokens)
        if above == 0 or above == len(contexts):
            return cost_at(self.curves[contexts[max(above - 1, 0)]], width)
        low, high = contexts[above - 1], contexts[above]
        share = (context_tokens - low) / (high - low)
        return (1.0 - share) * cost_at(self.curves[low], width) + share * cost_at(self.curves[high], width)


def verification_costs(backend: CausalLM) -> VerificationCosts | None:
    """``backend``'s :class:`VerificationCosts`, over every curve measured on it in this process (the draft-length
    policy, tree sizing and the benchmark's long-context report share them); the curve after
    ``CURVE_CONTEXT_TOKENS`` tokens is measured now if it is not yet.  None if the model's context is too short to
    measure on."""
    base = relative_cost_curve(backend)
    if base is None:
        return None
    widths = len(base)

    def measure(context_tokens: int) -> tuple[float, ...] | None:
        if context_tokens + widths > backend.max_context:
            return None
        return relative_cost_curve(backend, widths, context_tokens=context_tokens)

    return VerificationCosts(_CURVES[backend], measure)


def tune_fast_path(backend: CausalLM, repeats: int = 3) -> int:
    """How many rows a call may have to use the fast path's dense copies (:mod:`specdecode.models.fastpath`):
    the most new tokens n (0 to ``DENSE_ROWS``) for which a whole forward over every count up to n was faster
    with the copies than without, timed once per machine and model structure (kept on disk as the curves are),
    then applied.  MKL's few-row kernel beats oneDNN's on some CPUs and loses on others
    (``docs/results/quick-epyc-fastpath-r7``)."""
    model = getattr(backend, "model", None)
    copies = dense_copies(model) if isinstance(model, nn.Module) else []
    if not copies or backend.max_context <= DENSE_ROWS + 32:
        return 0
    if backend in _TUNED:
        return _TUNED[backend]
    key = _machine_and_model_key(backend, DENSE_ROWS, repeats, 32)
    saved = saved_entry(f"dense-rows:{key}") if key else None
    rows = saved.get("rows") if saved else None
    if not isinstance(rows, int) or not 0 <= rows <= DENSE_ROWS:
        with OthersLoad() as others:
            fastest = _fastest_with_and_without_copies(backend, copies, repeats)
        rows = 0
        while rows < DENSE_ROWS and fastest[True, rows + 1] < fastest[False, rows + 1]:
            rows += 1
        if key and not others.busy:
            save_entry(f"dense-rows:{key}", {"rows": rows})
    use_dense_rows(model, rows)
    _TUNED[backend] = rows
    return rows


def _fastest_with_and_without_copies(
    backend: CausalLM, copies: list[PackedLinear], repeats: int
) -> dict[tuple[bool, int], float]:
    """Fastest seconds of a forward over n = 1..``DENSE_ROWS`` new tokens, with the dense copies (True) and without."""
    cache, new = prefilled(backend, 32, DENSE_ROWS)
    fastest = {(with_copies, n): float("inf") for with_copies in (True, False) for n in range(1, DENSE_ROWS + 1)}
    for round_index in range(repeats + 1):  # the first round warms both ways up
        for with_copies in (True, False):
            for module in copies:
                module.dense_rows = DENSE_ROWS if with_copies else 0
            for n, elapsed in enumerate(timed_round(backend, cache, new), start=1):
                if round_index:
                    fastest[with_copies, n] = min(fastest[with_copies, n], elapsed)
    cache.release()
    return fastest


# --------------------------------------------------------------------------------------------------------
# The curves on disk: a shape depends on the machine and the model's structure, not on the process, and measuring
# one takes 112 forwards, seconds on a CPU -- more than a short `specdecode generate` decodes.  Delete the file to
# measure again.


def curve_file() -> Path:
    """``$SPECDECODE_COST_CURVES`` if set, else ``cost-curves.json`` in the cache root."""
    return Path(os.environ.get("SPECDECODE_COST_CURVES") or cache_dir() / "cost-curves.json")


def _machine_and_model_key(backend: CausalLM, widths: int, repeats: int, context_tokens: int) -> str | None:
    """:func:`machine_and_model_key` of ``backend``'s module and these measuring settings.  None for a backend
    without a torch module on the CPU (nothing to key it by): it is measured every time."""
    model = getattr(backend, "model", None)
    if not isinstance(model, nn.Module) or getattr(backend, "device", torch.device("cpu")).type != "cpu":
        return None
    return machine_and_model_key(model, f"{widths}/{repeats}/{context_tokens}")


def machine_and_model_key(model: nn.Module, settings: str) -> str:
    """What a forward's cost depends on: the CPU (its name and instruction sets), torch and its threads, whether our
    CPU kernels run and their sources (:mod:`specdecode.models.cpu_kernels`), and the model's structure -- every
    module's type and weight shape and dtype (so quantized, packed and plain layers differ) -- not its weight values;
    ``settings`` says what was measured, and how."""
    layout = hashlib.sha256()
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        shape = (tuple(weight.shape), str(weight.dtype)) if isinstance(weight, torch.Tensor) else ()
        # The fast path's layout and kernel choice (tune_fast_path), the w4a8 kernel's instruction set and source, the
        # bf16 layers' product, and a forward of the module's own (models/layer_forward.py).
        kernels = f"{getattr(module, 'panels', '')}{getattr(module, 'dense_rows', '')}"
        kernels += getattr(module, "kernel_build", "")
        kernels += type(module.__dict__["forward"]).__name__ if "forward" in module.__dict__ else ""
        layout.update(f"{name}:{type(module).__name__}:{shape}{kernels};".encode())
    parts = [
        cpu_name(),
        str(torch.backends.cpu.get_cpu_capability()),
        " ".join(sorted(cpu_flags())),
        str(torch.get_num_threads()),
        torch.__version__,
        f"cpu kernels {kernels_source_digest()}" if cpu_kernels_built() else "torch kernels",
        ("greedy head, widened" if bf16_widened_pays() else "greedy head") if greedy_head_applies(model) else "",
        layout.hexdigest(),
        settings,
    ]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()


def saved_entry(key: str) -> dict | None:
    """The entry :func:`save_entry` kept under ``key``, if the file has one."""
    entry = _saved_curves().get(key)
    return entry if isinstance(entry, dict) else None


def _saved_curves() -> dict[str, dict]:
    try:
        data = json.loads(curve_file().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def save_entry(key: str, entry: dict) -> None:
    """Add one entry to the file (written whole to a temporary file, then renamed: readers never see half)."""
    path = curve_file()
    curves = _saved_curves()
    curves[key] = {**entry, "measured": time.strftime("%Y-%m-%dT%H:%M:%S"), "cpu": cpu_name()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.{os.getpid()}")
        temporary.write_text(json.dumps(curves, indent=1))
        os.replace(temporary, path)
    except OSError:
        pass  # a read-only cache: measured again next time, nothing worse
