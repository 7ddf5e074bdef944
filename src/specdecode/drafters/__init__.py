"""Drafter registry.  Every module in this package is imported on first use, so a new drafter is
one new file with a ``@register_drafter("name")`` class — nothing else changes."""

from __future__ import annotations

import importlib
import inspect
import keyword
import pkgutil
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from specdecode.drafters.base import Drafter, DraftRequest, DraftSession
from specdecode.errors import SpecDecodeError, UnknownDrafterError

if TYPE_CHECKING:
    from specdecode.models.loading import LoadedModel

_REGISTRY: dict[str, type[Drafter]] = {}
_DISCOVERED = False


def register_drafter(name: str):
    """Class decorator: make a drafter available under ``name``."""

    def decorate(cls: type[Drafter]) -> type[Drafter]:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"drafter name {name!r} registered twice")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return decorate


def _discover() -> None:
    global _DISCOVERED
    if _DISCOVERED:
        return
    for module in pkgutil.iter_modules(__path__):
        if module.name != "base":
            importlib.import_module(f"{__name__}.{module.name}")
    _DISCOVERED = True


def available_drafters() -> list[str]:
    _discover()
    return sorted(_REGISTRY)


def drafter_class(name: str) -> type[Drafter]:
    _discover()
    if name not in _REGISTRY:
        raise UnknownDrafterError(f"unknown drafter {name!r}; available: {', '.join(available_drafters())}")
    return _REGISTRY[name]


def _option(parameter: str) -> str:
    """The option a constructor parameter takes: a Python keyword (``with``) is a parameter with a trailing
    underscore (``with_``)."""
    return parameter[:-1] if parameter.endswith("_") and keyword.iskeyword(parameter[:-1]) else parameter


def _parameter(option: str) -> str:
    return f"{option}_" if keyword.iskeyword(option) else option


def _joined(cls: type[Drafter], options: Mapping[str, Any] | None) -> object:
    """What the option :attr:`Drafter.passes_options_to` of ``cls`` names in ``options``, else its default."""
    assert cls.passes_options_to is not None
    default = inspect.signature(cls.__init__).parameters[_parameter(cls.passes_options_to)].default
    return (options or {}).get(cls.passes_options_to, default)


def accepted_options(name: str, options: Mapping[str, Any] | None = None) -> frozenset[str]:
    """The options drafter ``name`` takes: its constructor's keyword arguments, and for a drafter that joins another
    (:attr:`Drafter.passes_options_to`) those of the drafter ``options`` names there (else its default), which it
    passes on to it."""
    cls = drafter_class(name)
    own = frozenset(
        _option(key)
        for key, parameter in inspect.signature(cls.__init__).parameters.items()
        if key not in {"self", "target"} and parameter.kind is not parameter.VAR_KEYWORD
    )
    if cls.passes_options_to is None:
        return own
    joined = _joined(cls, options)
    # A drafter object joined (Python) comes with its own options; an unknown name fails here, with the list.
    return own | accepted_options(joined) if isinstance(joined, str) else own


def check_drafter_options(name: str, **options: Any) -> dict[str, Any]:
    """The given (non-None) options, after checking that drafter ``name`` exists and takes them all:
    an option it does not take is an error, not silently ignored.  Cheap: call it before loading models."""
    given = {_option(key): value for key, value in options.items() if value is not None}
    unknown = sorted(set(given) - accepted_options(name, given))
    if unknown:
        pretty = ", ".join(opt.replace("_", "-") for opt in unknown)
        cls = drafter_class(name)
        joining = f" (joining {_joined(cls, given)!r})" if cls.passes_options_to else ""
        raise SpecDecodeError(f"drafter {name!r}{joining} does not take option(s): {pretty}")
    return given


def create_drafter(name: str, target: LoadedModel, **options: Any) -> Drafter:
    """Build drafter ``name`` for ``target`` (options as in :func:`check_drafter_options`)."""
    given = check_drafter_options(name, **options)
    return drafter_class(name)(target, **{_parameter(key): value for key, value in given.items()})


__all__ = [
    "accepted_options",
    "DraftRequest",
    "DraftSession",
    "Drafter",
    "available_drafters",
    "check_drafter_options",
    "create_drafter",
    "drafter_class",
    "register_drafter",
]
