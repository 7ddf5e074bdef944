"""The verifiers a request may choose (``--verifier``, ``verifier=``, ``"verifier"``), and whether each is lossless.

Every module of this package that defines a class decorated ``@register_verifier("name", lossless=...)`` is one
verifier: a new verifier is one new file (see :class:`specdecode.verify.base.VerifierMethod`).  ``exact`` is the
default, lossless: greedy matching, coupled verification or rejection sampling as the sampling settings ask;
``spectr`` and ``optimal-md`` are lossless too, for several i.i.d. drafts per node.  The others are *relaxed*: they
keep some draft tokens the target would not have produced, trading the guarantee of the target's exact output for
fewer verification forwards.  That trade is never silent — every relaxed verifier is marked ``lossless: false`` in
``--json`` stats, in the server's metrics and in ``specdecode verifiers``.

Pure Python on purpose: the CLI imports it to parse and list without importing torch (the verifiers themselves
import it, so the listing reads their declarations from the source, as ``specdecode drafters`` does).
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specdecode.declarations import declarations
from specdecode.errors import SpecDecodeError
from specdecode.options import option_value

if TYPE_CHECKING:
    from specdecode.models.base import CausalLM
    from specdecode.types import Draft, Verdict
    from specdecode.verify.base import TargetRows, VerifierMethod

DEFAULT_VERIFIER = "exact"

#: Modules of this package that declare no verifier: the registry itself and what every verifier shares.
_NOT_VERIFIERS = frozenset({"registry", "base"})
_PACKAGE_DIR = Path(__file__).parent

_REGISTRY: dict[str, type[VerifierMethod]] = {}
_DISCOVERED = False


def register_verifier(name: str, *, lossless: bool) -> Callable[[type[VerifierMethod]], type[VerifierMethod]]:
    """Class decorator: make a verifier available under ``name``; ``lossless``: its output is the target's own.
    Its docstring's first line is its description in ``specdecode verifiers``."""

    def decorate(cls: type[VerifierMethod]) -> type[VerifierMethod]:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"verifier name {name!r} registered twice")
        cls.name, cls.lossless = name, lossless
        _REGISTRY[name] = cls
        return cls

    return decorate


def _verifier_modules() -> list[str]:
    return [m.name for m in pkgutil.iter_modules([str(_PACKAGE_DIR)]) if m.name not in _NOT_VERIFIERS]


def _discover() -> None:
    global _DISCOVERED
    if _DISCOVERED:
        return
    for module in _verifier_modules():
        importlib.import_module(f"{__package__}.{module}")
    _DISCOVERED = True


def _ordered(names: list[str]) -> list[str]:
    """The default first, then by name: the order of ``specdecode verifiers`` and of error messages."""
    return sorted(names, key=lambda name: (name != DEFAULT_VERIFIER, name))


def verifiers() -> dict[str, type[VerifierMethod]]:
    """Every registered verifier by name, the default first."""
    _discover()
    return {name: _REGISTRY[name] for name in _ordered(list(_REGISTRY))}


def verifier_method(name: object) -> type[VerifierMethod]:
    """The verifier registered as ``name``, else the one-line error a user sees (CLI exit 2, HTTP 400)."""
    _discover()
    if not isinstance(name, str) or name not in _REGISTRY:
        raise SpecDecodeError(f"unknown verifier {name!r}; choose from {', '.join(verifiers())}")
    return _REGISTRY[name]


def check_verifier(name: object) -> str:
    """``name`` if it is a registered verifier, else the one-line error (the server's field check)."""
    return verifier_method(name).name


def is_lossless(name: str) -> bool:
    return verifier_method(name).lossless


@dataclass(frozen=True)
class VerifierChoice:
    """A request's verifier and its options, an instance of that verifier's ``options`` class (its defaults when
    omitted): what ``--verifier NAME[:KEY=VALUE...]``, the HTTP ``"verifier"`` and the API's ``verifier=`` become,
    checked once when made."""

    name: str = DEFAULT_VERIFIER
    options: Any = None

    def __post_init__(self) -> None:
        method = verifier_method(self.name)
        if self.options is None:
            object.__setattr__(self, "options", method.options())
        elif not isinstance(self.options, method.options):
            kind = type(self.options).__name__
            raise SpecDecodeError(f"verifier {self.name!r} takes {method.options.__name__}, got {kind}")

    @property
    def method(self) -> type[VerifierMethod]:
        return verifier_method(self.name)

    @property
    def lossless(self) -> bool:
        return self.method.lossless

    def with_options(self, options: Mapping[str, object]) -> VerifierChoice:
        """These options over the ones chosen (the API's ``verifier_options``); an unknown one is an error."""
        given = {**dataclasses.asdict(self.options), **options}
        return VerifierChoice(self.name, _options(self.method, given, self.name))

    def prepare(self, target: CausalLM) -> None:
        """Refuse now what this verifier cannot run on ``target`` (CLI exit 2, HTTP 400), before a request starts."""
        self.method.prepare(target, self.options)

    def verify(self, rows: TargetRows, draft: Draft) -> Verdict:
        return self.method.verify(rows, draft, self.options)


def _options(method: type[VerifierMethod], given: Mapping[str, object], spec: str) -> object:
    """``method``'s options from ``given`` (validated by the options class itself)."""
    known = [field.name for field in dataclasses.fields(method.options)]
    if given and not known:
        raise SpecDecodeError(f"verifier {spec!r}: {method.name} takes no options")
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise SpecDecodeError(f"unknown verifier option(s) {', '.join(unknown)}; known: {', '.join(known)}")
    return method.options(**given)


def parse_verifier(text: str, options: Mapping[str, object] | None = None) -> VerifierChoice:
    """``NAME[:OPTION=VALUE...]`` (``--verifier``, ``bench quality --verifiers``, the API's ``verifier=``) plus
    ``options`` (``--verifier-option KEY=VALUE``, typed; they win over the inline ones) → the choice."""
    if not isinstance(text, str):
        verifier_method(text)  # the unknown-verifier error
    spec = text.strip()
    name, *parts = spec.split(":")
    method = verifier_method(name)
    inline: dict[str, object] = {}
    for part in parts:
        key, sep, raw = part.partition("=")
        if not sep or not key or not raw:
            raise SpecDecodeError(f"verifier {spec!r}: expected OPTION=VALUE after ':', got {part!r}")
        inline[key.replace("-", "_")] = option_value(raw)
    return VerifierChoice(name, _options(method, {**inline, **(options or {})}, spec))


@dataclass(frozen=True)
class VerifierInfo:
    name: str
    lossless: bool
    description: str  # one line, for ``specdecode verifiers``


def verifier_listing() -> list[VerifierInfo]:
    """Every verifier's declaration read from the source of this package, without importing it (the verifiers
    import torch): the classes decorated ``@register_verifier("name", lossless=...)``, described by the first
    line of their docstring."""
    paths = [_PACKAGE_DIR / f"{module}.py" for module in _verifier_modules()]
    found = {}
    for declared in declarations(paths, "register_verifier"):
        name, lossless = (declared.args or (None,))[0], declared.keywords.get("lossless")
        if isinstance(name, str) and isinstance(lossless, bool):
            found[name] = VerifierInfo(name, lossless, declared.summary)
    return [found[name] for name in _ordered(list(found))]


def format_verifiers() -> str:
    """``specdecode verifiers``: one line per verifier, its name, lossless or lossy, and what it does."""
    return "\n".join(
        f"{info.name:<9} {'lossless' if info.lossless else 'lossy':<9} {info.description}"
        for info in verifier_listing()
    )
