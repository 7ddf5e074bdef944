"""Drafting methods as the benchmarks name them: ``NAME`` or ``NAME:OPTION=VALUE[:OPTION=VALUE...]``.

``pld:k=6:max_ngram=4`` or ``draft-model:qwen2.5-coder-0.5b:k=4`` parse into a :class:`MethodSpec`, the key every
benchmark (``bench``, ``bench throughput``, ``bench serve``, ``bench coupling``) files its results under.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from specdecode.config import (
    DEFAULT_NUM_DRAFT_TOKENS,
    MAX_FIXED_DRAFT_LENGTH,
    Fixed,
    parse_draft_length,
)
from specdecode.drafters import accepted_options, drafter_class
from specdecode.drafters.adapt import asks_to_adapt
from specdecode.errors import SpecDecodeError
from specdecode.models.quantize import draft_quantization
from specdecode.options import option_value

DEFAULT_K = DEFAULT_NUM_DRAFT_TOKENS.to_json()


@dataclass(frozen=True)
class MethodSpec:
    """One drafter configuration.  ``spec`` is the name results are keyed by; it does not take part in
    equality, so two spellings of the same configuration compare equal."""

    drafter: str
    k: int | str = DEFAULT_K  # a draft length as --num-draft-tokens takes it, 0 excepted
    options: tuple[tuple[str, Any], ...] = ()
    spec: str = field(default="", compare=False)

    @property
    def draft_model(self) -> str | None:
        return dict(self.options).get("draft_model")

    def option(self, name: str) -> Any:
        """The option's value, or the drafter's default for it."""
        given = dict(self.options)
        if name in given:
            return given[name]
        return inspect.signature(drafter_class(self.drafter).__init__).parameters[name].default

    def with_k(self, k: int) -> MethodSpec:
        """The same configuration drafting ``k`` tokens, spelled canonically."""
        parts = [self.drafter]
        if self.draft_model is not None:
            parts.append(self.draft_model)
        parts.append(f"k={k}")
        parts += [f"{key}={value}" for key, value in self.options if key != "draft_model"]
        return replace(self, k=k, spec=":".join(parts))


def parse_method(text: str) -> MethodSpec:
    """``pld:k=6:max_ngram=4``, ``draft-model:qwen2.5-coder-0.5b:k=4`` → :class:`MethodSpec`."""
    spec = text.strip()
    name, *parts = spec.split(":")
    if not name:
        raise SpecDecodeError(f"method {text!r} has no drafter name (syntax NAME[:OPTION=VALUE...])")
    drafter_class(name)  # an unknown drafter fails here, before any model is loaded
    takes_draft_model = "draft_model" in accepted_options(name)  # draft-model, hsd: NAME:MODEL[:...]
    k: int | str = DEFAULT_K
    k_given = False
    options: dict[str, Any] = {}
    for part in parts:
        key, sep, raw = part.partition("=")
        if not sep and takes_draft_model and "draft_model" not in options and part:
            options["draft_model"] = part
            continue
        if not sep or not key or not raw:
            raise SpecDecodeError(f"method {spec!r}: expected OPTION=VALUE after ':', got {part!r}")
        key = key.replace("-", "_")
        if key in options or (key == "k" and k_given):
            raise SpecDecodeError(f"method {spec!r} sets {key!r} twice")
        if key == "k":
            k_given = True
            try:
                length = parse_draft_length(option_value(raw))
            except SpecDecodeError:
                length = None
            if length in (None, Fixed(0)):  # k=0 drafts nothing: that is the method `none`
                raise SpecDecodeError(
                    f"method {spec!r}: k (draft length) must be a positive integer up to {MAX_FIXED_DRAFT_LENGTH}, "
                    f"auto or heuristic, got {raw!r}"
                )
            k = length.to_json()
        else:
            options[key] = option_value(raw)
    if takes_draft_model and "draft_model" not in options and _drafts_with_a_model(name, options):
        raise SpecDecodeError(f"method {spec!r} needs a draft model, e.g. {name}:qwen2.5-coder-0.5b")
    return MethodSpec(drafter=name, k=k, options=tuple(sorted(options.items())), spec=spec)


def _drafts_with_a_model(name: str, options: dict[str, Any]) -> bool:
    """``draft-model`` and ``hsd`` draft with a draft model; a drafter that joins another's drafts (``rasd:with=``)
    only where that one does."""
    if "with" not in accepted_options(name):
        return True
    joined = options.get("with", MethodSpec(name).option("with_"))
    return "draft_model" in accepted_options(str(joined))


def parse_methods(text: str) -> list[MethodSpec]:
    methods = [parse_method(part) for part in text.split(",") if part.strip()]
    if not methods:
        raise SpecDecodeError("--methods is empty; give e.g. none,pld")
    seen: set[str] = set()
    for method in methods:
        if method.spec in seen:
            raise SpecDecodeError(f"method {method.spec!r} is listed twice")
        seen.add(method.spec)
    return methods


def parse_int_list(text: str, label: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise SpecDecodeError(f"{label} takes comma-separated positive integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise SpecDecodeError(f"{label} takes comma-separated positive integers, got {text!r}")
    return values


def draft_weights(methods: Sequence[MethodSpec], quantize: str, given: str | None) -> str | None:
    """The weights the methods' draft models load with (``--quantize-draft``): ``given``, else as ``generate``
    loads them (int4 by default, fp32 for a draft that adapts); None when no method has a draft model.
    Recorded as loaded in results: the default may change between versions."""
    if not any(m.draft_model for m in methods):
        return given
    trains = any(asks_to_adapt(dict(m.options)) for m in methods)
    return draft_quantization(given, quantize, trains=trains)
