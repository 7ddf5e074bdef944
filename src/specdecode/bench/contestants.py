"""The benchmark's contestants: each of our methods (and its draft-length variants) and each peer — transformers,
llama.cpp, OpenVINO GenAI — configured like one of them, all behind one call that turns prompt ids into
``max_new_tokens`` generated ids.
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from specdecode.bench import native_peers, peers
from specdecode.bench.common import drafter_options
from specdecode.bench.methods import MethodSpec
from specdecode.bench.suites import BenchSettings, sweep_methods
from specdecode.errors import SpecDecodeError
from specdecode.generator import SpeculativeGenerator, StreamEvent
from specdecode.models.loading import LoadedModel
from specdecode.stats import GenerationStats

#: transformers has no cost-model schedule: a peer matching one of our adaptive methods drafts this many.
PEER_K = 5

# --------------------------------------------------------------------------------------------------------
# Contestants: anything that turns prompt ids into ``max_new_tokens`` generated ids


@dataclass(frozen=True)
class PeerSpec:
    """A peer's configuration and the method of ours it is configured like; ``family`` is the engine
    (``transformers``, ``llamacpp``, ``openvino-int8``, ``openvino-int4``)."""

    name: str
    matches: MethodSpec
    config: dict[str, Any]
    family: str = "transformers"


#: Each family's name prefix; its plain decoding is ``<prefix>-plain``.
PEER_PREFIX = {"transformers": "hf", "llamacpp": "llamacpp", "openvino-int8": "ov-int8", "openvino-int4": "ov-int4"}


def peer_specs(settings: BenchSettings) -> list[PeerSpec]:
    """Per peer family: plain decoding for ``none``, prompt lookup for the first ``pld`` method, a draft
    model for the first ``draft-model`` method — each only when that method is benchmarked, and only for
    families that can run here (:func:`skipped_peers` says why the others cannot)."""
    # Peers take a fixed draft length: match the first method of each kind that has one, else the first
    # method of that kind, drafting PEER_K.
    first = {
        name: next(
            (m for m in settings.methods if m.drafter == name and isinstance(m.k, int)),
            next((m for m in settings.methods if m.drafter == name), None),
        )
        for name in ("none", "pld", "draft-model")
    }
    skipped = skipped_peers(settings)
    specs = []
    for family in (f for f in settings.peers if f not in skipped):
        prefix = PEER_PREFIX[family]
        if first["none"] is not None:
            specs.append(PeerSpec(f"{prefix}-plain", first["none"], {}, family))
        if (pld := first["pld"]) is not None:
            specs.append(PeerSpec(f"{prefix}-pld", pld, _lookup_config(family, pld), family))
        if (assisted := first["draft-model"]) is not None:
            name = "hf-assisted" if family == "transformers" else f"{prefix}-draft"
            specs.append(PeerSpec(name, assisted, _draft_config(family, assisted), family))
    return specs


@functools.cache
def _unavailable(family: str, model: str) -> str | None:
    return None if family == "transformers" else native_peers.unavailable(family, model)


def skipped_peers(settings: BenchSettings) -> dict[str, str]:
    """The requested peer families that cannot run here → why (a missing extra, an unregistered model)."""
    return {f: reason for f in settings.peers if (reason := _unavailable(f, settings.model)) is not None}


def _lookup_config(family: str, pld: MethodSpec) -> dict[str, Any]:
    k, ngram = _peer_k(pld), pld.option("max_ngram")
    if family == "transformers":
        return {"prompt_lookup_num_tokens": k, "max_matching_ngram_size": ngram}
    if family == "llamacpp":
        return {"num_pred_tokens": k, "max_ngram_size": ngram}
    return {"num_assistant_tokens": k, "max_ngram_size": ngram}


def _draft_config(family: str, assisted: MethodSpec) -> dict[str, Any]:
    k = _peer_k(assisted)
    if family == "transformers":
        # A constant schedule with no confidence cut-off drafts exactly k tokens per step, as ours does.
        return {
            "assistant_model": assisted.draft_model,
            "num_assistant_tokens": k,
            "num_assistant_tokens_schedule": "constant",
            "assistant_confidence_threshold": 0.0,
        }
    key = "num_pred_tokens" if family == "llamacpp" else "num_assistant_tokens"
    return {"assistant_model": assisted.draft_model, key: k}


def _peer_k(method: MethodSpec) -> int:
    return method.k if isinstance(method.k, int) else PEER_K


#: (prompt ids, max new tokens) → the events of one request, decoded as they are pulled.
StreamCall = Callable[[list[int], int], Iterator[StreamEvent]]


@dataclass
class Measurement:
    token_ids: list[int]
    wall_s: float
    stats: GenerationStats | None  # None for peers (transformers reports no acceptance counts)


@dataclass
class Contestant:
    name: str
    run: Callable[[list[int], int], Measurement]  # (prompt ids, max new tokens) → measurement
    reset: Callable[[], None] = lambda: None  # forget what was learned from earlier runs (ours: the drafter)
    #: Ours: the same request as events pulled step by step, for taking turns (:mod:`specdecode.bench.lockstep`);
    #: None where it cannot take turns (peers; a drafter that works between steps).
    stream: StreamCall | None = None


def _ours(target: LoadedModel, method: MethodSpec, drafts: dict[str, LoadedModel]) -> Contestant:
    generator = SpeculativeGenerator.build(target, method.drafter, **drafter_options(method, drafts))

    def run(prompt_ids: list[int], max_new_tokens: int) -> Measurement:
        start = time.perf_counter()
        result = generator.generate(
            prompt_ids, max_new_tokens=max_new_tokens, num_draft_tokens=method.k, ignore_eos=True
        )
        return Measurement(result.token_ids, time.perf_counter() - start, result.stats)

    def stream(prompt_ids: list[int], max_new_tokens: int) -> Iterator[StreamEvent]:
        return generator.stream_events(
            prompt_ids, max_new_tokens=max_new_tokens, num_draft_tokens=method.k, ignore_eos=True
        )

    # Resetting is not timed: it stands for a fresh server, not for work a request pays for.
    steps = None if generator.drafter.works_between_steps else stream
    return Contestant(method.spec, run, generator.reset_drafter, steps)


def _native_peer(settings: BenchSettings, spec: PeerSpec) -> Contestant:
    """A llama.cpp or OpenVINO GenAI peer on the registered model ``settings.model``."""
    options = dict(spec.config)
    draft = options.pop("assistant_model", None)
    lookup = options or None
    if spec.family == "llamacpp":
        run = native_peers.llamacpp_run(settings.model, settings.threads, draft, lookup)
    else:
        weights = spec.family.removeprefix("openvino-")
        run = native_peers.openvino_run(settings.model, weights, settings.threads, draft, lookup)

    def measure(prompt_ids: list[int], max_new_tokens: int) -> Measurement:
        try:
            tokens, wall_s = run(prompt_ids, max_new_tokens)
        except (RuntimeError, ValueError) as exc:  # the engine's own failure: one line, not its traceback
            raise SpecDecodeError(
                f"peer {spec.name} failed on a {len(prompt_ids)}-token prompt: {exc}; the prompts measured so far "
                f"are saved (rerun without --peers {spec.family}, or with another --out, to go on)"
            ) from exc
        return Measurement(tokens, wall_s, None)

    return Contestant(spec.name, measure)


def _peer(target: LoadedModel, spec: PeerSpec, drafts: dict[str, LoadedModel]) -> Contestant:
    model = target.backend.model
    if spec.name == "hf-plain":
        call = functools.partial(peers.hf_plain, model)
    elif spec.name == "hf-pld":
        call = functools.partial(peers.hf_prompt_lookup, model, **spec.config)
    else:
        options = {key: value for key, value in spec.config.items() if key != "assistant_model"}
        assistant = drafts[spec.config["assistant_model"]].backend.model
        call = functools.partial(peers.hf_assisted, model, assistant, **options)

    def run(prompt_ids: list[int], max_new_tokens: int) -> Measurement:
        result = call(prompt_ids=prompt_ids, max_new_tokens=max_new_tokens, ignore_eos=True)
        return Measurement(result.token_ids, result.wall_s, None)

    return Contestant(spec.name, run)


def build_contestants(
    settings: BenchSettings,
    target: LoadedModel,
    drafts: dict[str, LoadedModel],
    peer_models: tuple[LoadedModel, dict[str, LoadedModel]] | None = None,
) -> dict[str, Contestant]:
    """Our methods and draft-length variants, then the peers; a peer family that cannot run here is said
    on stderr and left out.

    ``peer_models`` (target, drafts) are what the transformers peers run on — loaded without our CPU fast
    path, so that they measure transformers as a user would run it; default: the same models as ours."""
    peer_target, peer_drafts = peer_models or (target, drafts)
    contestants: dict[str, Contestant] = {}
    for method in [*settings.methods, *(variant for variant, _ in sweep_methods(settings).values())]:
        if method.spec not in contestants:  # a variant may be a listed method under the same key
            contestants[method.spec] = _ours(target, method, drafts)
    for family, reason in skipped_peers(settings).items():
        print(f"[bench] peer {family} skipped: {reason}", file=sys.stderr)
    for spec in peer_specs(settings):
        if spec.family == "transformers":
            contestants[spec.name] = _peer(peer_target, spec, peer_drafts)
        else:
            contestants[spec.name] = _native_peer(settings, spec)
    return contestants
