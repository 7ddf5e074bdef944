"""The benchmark's contestants: each of our methods (and its draft-length variants) and each transformers peer
configured like one of them, all behind one call that turns prompt ids into ``max_new_tokens`` generated ids.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from specdecode.bench import peers
from specdecode.bench.common import drafter_options
from specdecode.bench.methods import MethodSpec
from specdecode.bench.suites import BenchSettings, sweep_methods
from specdecode.generator import SpeculativeGenerator
from specdecode.models.loading import LoadedModel
from specdecode.stats import GenerationStats

#: transformers has no cost-model schedule: a peer matching one of our adaptive methods drafts this many.
PEER_K = 5

# --------------------------------------------------------------------------------------------------------
# Contestants: anything that turns prompt ids into ``max_new_tokens`` generated ids


@dataclass(frozen=True)
class PeerSpec:
    """A transformers configuration and the method of ours it is configured like."""

    name: str
    matches: MethodSpec
    config: dict[str, Any]


def peer_specs(settings: BenchSettings) -> list[PeerSpec]:
    """``hf-plain`` for ``none``, ``hf-pld`` for the first ``pld`` method, ``hf-assisted`` for the first
    ``draft-model`` method — each only when that method is benchmarked."""
    if not settings.peers:
        return []
    # Peers take a fixed draft length: match the first method of each kind that has one, else the first
    # method of that kind, drafting PEER_K.
    first = {
        name: next(
            (m for m in settings.methods if m.drafter == name and isinstance(m.k, int)),
            next((m for m in settings.methods if m.drafter == name), None),
        )
        for name in ("none", "pld", "draft-model")
    }
    specs = []
    if first["none"] is not None:
        specs.append(PeerSpec("hf-plain", first["none"], {}))
    if (pld := first["pld"]) is not None:
        config = {"prompt_lookup_num_tokens": _peer_k(pld), "max_matching_ngram_size": pld.option("max_ngram")}
        specs.append(PeerSpec("hf-pld", pld, config))
    if (assisted := first["draft-model"]) is not None:
        # A constant schedule with no confidence cut-off drafts exactly k tokens per step, as ours does.
        config = {
            "assistant_model": assisted.draft_model,
            "num_assistant_tokens": _peer_k(assisted),
            "num_assistant_tokens_schedule": "constant",
            "assistant_confidence_threshold": 0.0,
        }
        specs.append(PeerSpec("hf-assisted", assisted, config))
    return specs


def _peer_k(method: MethodSpec) -> int:
    return method.k if isinstance(method.k, int) else PEER_K


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


def _ours(target: LoadedModel, method: MethodSpec, drafts: dict[str, LoadedModel]) -> Contestant:
    generator = SpeculativeGenerator.build(target, method.drafter, **drafter_options(method, drafts))

    def run(prompt_ids: list[int], max_new_tokens: int) -> Measurement:
        start = time.perf_counter()
        result = generator.generate(
            prompt_ids, max_new_tokens=max_new_tokens, num_draft_tokens=method.k, ignore_eos=True
        )
        return Measurement(result.token_ids, time.perf_counter() - start, result.stats)

    # Resetting is not timed: it stands for a fresh server, not for work a request pays for.
    return Contestant(method.spec, run, generator.reset_drafter)


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
    """Our methods and draft-length variants, then the transformers peers.

    ``peer_models`` (target, drafts) are what the peers run on — loaded without our CPU fast path, so
    that they measure transformers as a user would run it; default: the same models as ours."""
    peer_target, peer_drafts = peer_models or (target, drafts)
    contestants: dict[str, Contestant] = {}
    for method in [*settings.methods, *(variant for variant, _ in sweep_methods(settings).values())]:
        if method.spec not in contestants:  # a variant may be a listed method under the same key
            contestants[method.spec] = _ours(target, method, drafts)
    contestants.update({spec.name: _peer(peer_target, spec, peer_drafts) for spec in peer_specs(settings)})
    return contestants
