"""Where trained drafter parts (a Kangaroo adapter, an EAGLE head) live: next to the model they were
trained for, so that the drafter finds them without being told."""

from __future__ import annotations

from pathlib import Path

from specdecode.models import registry


def trained_artifact_path(model_name: str, name: str) -> Path | None:
    """``name`` next to the cached checkpoint of a registry model, inside a local model directory, beside a
    ``.gguf`` file (prefixed with its stem); None for other models (hub ids): the user says where."""
    if registry.is_registered(model_name):
        return registry.ensure_model(model_name, progress=False).parent / name
    path = Path(model_name).expanduser()
    if path.is_dir():
        return path / name
    if path.is_file() and path.suffix == ".gguf":
        return path.with_name(f"{path.stem}.{name}")
    return None
