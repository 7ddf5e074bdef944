"""``--quantize auto``: the weight format this CPU decodes a model fastest in, measured once per machine and model.

Which format wins depends on the CPU more than on anything else: int4 decodes Qwen2.5-1.5B 3.2x faster than fp32 on
an AVX-512 Xeon, our w4a8 kernel beats int4 on AVX2-only and VNNI CPUs, and bf16 verifies 8 tokens for little more
than one on CPUs with AMX (``docs/quantization.md``).  So ``auto`` times each format this CPU runs on the model
itself: a copy of the loaded fp32 model that shares its weights (:func:`~specdecode.models.hf.shared_weights_copy`)
is quantized, loaded as it would be (with the fast path, tuned by :func:`~specdecode.models.cost.tune_fast_path`),
and timed on a one-token decoding step and a ``VERIFY_WIDTH``-token verification; the fastest by :func:`score` is
kept, in the file the cost curves are kept in, keyed by the machine and the model's structure.  The next load on
this machine reads it instead.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from specdecode.errors import SpecDecodeError
from specdecode.models import w4a8
from specdecode.models.cost import (
    curve_file,
    fastest_forwards,
    machine_and_model_key,
    save_entry,
    saved_entry,
    tune_fast_path,
)
from specdecode.models.cpu_kernels import bf16_panels_pay
from specdecode.models.hf import HFCausalLM, shared_weights_copy
from specdecode.models.layer_forward import apply_cpu_fast_path_with_layers
from specdecode.models.quantize import QUANTIZE_MODES, quantize_model, quantize_supported
from specdecode.threads import OthersLoad

#: The verification a format is timed on besides a decoding step: 8 new tokens, the width ``auto``'s draft length
#: and the benchmarks' drafters reach.
VERIFY_WIDTH = 8
#: Tokens :func:`score` counts a verification as yielding: one draft token kept in eight, a modest drafter's.
VERIFY_YIELD = 2.0
#: Cached tokens under the timed forwards: enough for attention to take part, few enough that the prompt is read
#: fast by every format (an int4 layer without its bf16 copy reads one row at a time).
CONTEXT_TOKENS = 32
#: Timed rounds per format, after one that warms up; the fastest counts (other processes only ever add time).
REPEATS = 2

#: Seconds of a one-token decoding step and of a ``VERIFY_WIDTH``-token verification.
Timing = tuple[float, float]


def score(timing: Timing) -> float:
    """Seconds per token of plain decoding plus of verifying: a step yields one token, a verification
    ``VERIFY_YIELD``; a format fast at one but slow at the other (int8's verification, fp32's step) pays for it."""
    step_s, verify_s = timing
    return step_s + verify_s / VERIFY_YIELD


def fastest_format(timings: Mapping[str, Timing]) -> str:
    """The format with the lowest :func:`score`; on a tie, the first in ``timings`` (``none`` first: fp32's output)."""
    if not timings:
        raise ValueError("no format was timed")
    return min(timings, key=lambda mode: score(timings[mode]))


@dataclass(frozen=True)
class FormatChoice:
    """What ``auto`` chose, and from what: each timed format's :data:`Timing` (none off the CPU), read from the
    cache (``cached``) or timed now and kept there (``kept``) or not (the machine was busy)."""

    mode: str
    timings: Mapping[str, Timing]
    cached: bool = False
    kept: bool = False
    device: str = "cpu"

    def summary(self, model_name: str) -> str:
        """One line for the terminal: the choice and the timings it was made from."""
        head = f"[quantize auto] {self.mode} for {model_name}"
        if not self.timings:
            return f"{head}: the quantized formats run on the CPU only, not on {self.device}"
        times = ", ".join(
            f"{mode} {1e3 * step:.1f}+{1e3 * verify:.1f}" for mode, (step, verify) in self.timings.items()
        )
        if self.cached or self.kept:
            source = f"{'cached' if self.cached else 'measured now, kept'} in {curve_file()}"
        else:
            source = "measured now while other processes kept the CPUs busy: not kept"
        return f"{head}: ms per decoding step + {VERIFY_WIDTH}-token verification: {times} ({source})"


def candidate_formats() -> tuple[str, ...]:
    """The formats this torch build and CPU have kernels for (``w4a8``: a compiler and AVX2; built when timed)."""
    return tuple(mode for mode in QUANTIZE_MODES if mode == "none" or quantize_supported(mode))


#: Choices timed on a busy machine, by cache key: kept for this process, not on disk.
_CHOSEN: dict[str, FormatChoice] = {}


def choose_format(
    model: nn.Module, candidates: Sequence[str], time_format: Callable[[str], Timing | None], *, fast_path: bool = True
) -> FormatChoice:
    """The fastest of ``candidates`` for ``model`` on this machine: from the cache if it holds this machine, model
    structure, candidates, ``fast_path`` (fp32's kernels) and our quantized kernels' builds, else timed by
    ``time_format`` (None: the format does not run here) and kept, unless other processes kept the CPUs busy meanwhile
    (the timings were then not this machine's alone: they serve this process only)."""
    kernels = f"w4a8 {w4a8.source_digest()}, bf16 {'panels' if bf16_panels_pay() else 'onednn'}"  # ours, as built
    key = "quantize:" + machine_and_model_key(model, f"{','.join(candidates)};fast path {fast_path};{kernels}")
    if key in _CHOSEN:
        return _CHOSEN[key]
    if (cached := _cached_choice(key, candidates)) is not None:
        return cached
    with OthersLoad() as others:
        timings = {mode: timed for mode in candidates if (timed := time_format(mode)) is not None}
    choice = FormatChoice(fastest_format(timings), timings, kept=not others.busy)
    if choice.kept:
        save_entry(key, {"quantize": choice.mode, "timings": {mode: list(t) for mode, t in timings.items()}})
    else:
        _CHOSEN[key] = choice
    return choice


def _cached_choice(key: str, candidates: Sequence[str]) -> FormatChoice | None:
    """The choice kept under ``key``; None if there is none, or it is not one of ``candidates``'s (an edited file)."""
    saved = saved_entry(key) or {}
    try:
        timings = {mode: (float(step), float(verify)) for mode, (step, verify) in saved["timings"].items()}
    except (KeyError, AttributeError, TypeError, ValueError):
        return None
    mode = saved.get("quantize")
    return FormatChoice(mode, timings, cached=True) if mode in candidates and mode in timings else None


def time_format(model: nn.Module, mode: str, fast_path: bool) -> Timing | None:
    """A decoding step's and a verification's fastest seconds on a copy of ``model`` in ``mode``, loaded as
    :func:`~specdecode.models.loading.load_model` would load it; None where ``mode``'s kernel does not build."""
    trial = shared_weights_copy(model)
    try:
        quantize_model(trial, mode)
    except SpecDecodeError:  # w4a8's kernel failed to build: a default passes over it
        return None
    if fast_path:  # as load_model: fp32's layers, or those a format leaves in fp32
        apply_cpu_fast_path_with_layers(trial)
    backend = HFCausalLM(trial, f"auto:{mode}")
    tune_fast_path(backend)  # the fp32 copy's kernels as its load would pick them (and cached for that load)
    seconds = fastest_forwards(backend, (1, VERIFY_WIDTH), CONTEXT_TOKENS, REPEATS)
    return seconds[1], seconds[VERIFY_WIDTH]


def auto_format(model: nn.Module, device: torch.device, fast_path: bool) -> FormatChoice:
    """``auto``'s format for the fp32 ``model`` loaded on ``device``: timed or cached on the CPU; ``none`` elsewhere
    (the quantized kernels are the CPU's)."""
    if device.type != "cpu":
        return FormatChoice("none", {}, device=str(device))
    candidates = candidate_formats()
    return choose_format(model, candidates, lambda mode: time_format(model, mode, fast_path), fast_path=fast_path)
