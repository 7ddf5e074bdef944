"""The files of a trained head directory, shared by every kind of head (EAGLE, Medusa, Hydra).

Each kind writes the same three files — ``config.json``, ``model.safetensors`` and a ``manifest.json``
holding the SHA-256 of both — and a drafter finds its head the same way: the directory an option names,
else one trained next to the target model, else one shipped with the package for that registry model
(``shipped/<model>/<artifact>``, so the default model drafts with a trained head on a fresh machine).
Keeping that here means one layout, one integrity check and one error message pattern for all of them;
what differs (the config's contents, how it is read) stays with each kind.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from specdecode.errors import SpecDecodeError
from specdecode.models import registry
from specdecode.models.artifacts import trained_artifact_path

#: Heads trained by the project for registry models, installed with the package (see docs/training.md).
SHIPPED_DIR = Path(__file__).parent / "shipped"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
MANIFEST_FILE = "manifest.json"


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file, read in 1 MiB blocks so a large weights file never sits in memory twice."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def replace_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """Have ``write`` fill a sibling of ``path`` named for this process, then rename it over ``path``: an interrupted
    write leaves the previous file (or none) rather than a truncated one that would load as garbage, and two processes
    writing the same file at once each rename a whole one."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    write(tmp)
    tmp.replace(path)


def write_head_files(directory: Path, tensors: dict[str, torch.Tensor], config: dict) -> None:
    """Write ``model.safetensors`` and ``config.json`` to ``directory`` (created; each replaced atomically),
    then ``manifest.json`` with their SHA-256, which the loaders check before trusting either."""
    directory.mkdir(parents=True, exist_ok=True)
    replace_atomically(directory / WEIGHTS_FILE, lambda p: save_file(tensors, str(p), metadata={"format": "pt"}))
    replace_atomically(directory / CONFIG_FILE, lambda p: p.write_text(json.dumps(config, indent=2) + "\n"))
    manifest = {name: sha256_file(directory / name) for name in (CONFIG_FILE, WEIGHTS_FILE)}
    (directory / MANIFEST_FILE).write_text(json.dumps({"sha256": manifest}, indent=2) + "\n")


def check_manifest(directory: Path) -> None:
    """Raise unless every file ``manifest.json`` lists has its recorded SHA-256 (a half-copied or edited
    head would otherwise draft wrongly without a word).  A missing manifest raises ``OSError``."""
    for name, digest in json.loads((directory / MANIFEST_FILE).read_text())["sha256"].items():
        if sha256_file(directory / name) != digest:
            raise SpecDecodeError(f"{name} does not match its SHA-256 in {MANIFEST_FILE}")


def shipped_head(model_name: str, artifact: str) -> Path | None:
    """The ``artifact`` the package ships for the registry model ``model_name``, or None."""
    path = SHIPPED_DIR / model_name / artifact
    return path if registry.is_registered(model_name) and (path / CONFIG_FILE).is_file() else None


def head_directory(
    option: str | None, model_name: str, artifact: str, drafter: str, what: str, flag: str, user: str = "drafter"
) -> Path:
    """Where a trained head is: the directory ``option`` names, else ``artifact`` next to the model (trained
    here: it wins over a shipped one), else the one the package ships for that model.

    Without one the ``user`` (a drafter, or a verifier: the judge) named ``drafter`` cannot run, so the error
    says how to make it: the ``specdecode train {drafter}`` command, or the ``--{user}-option {flag}=DIR`` that
    points at an existing one.  ``what`` names the thing wanted ("a head", "heads", "a judge")."""
    path = Path(option).expanduser() if option else trained_artifact_path(model_name, artifact)
    if not option and (path is None or not (path / CONFIG_FILE).is_file()):
        path = shipped_head(model_name, artifact) or path
    if path is None or not (path / CONFIG_FILE).is_file():
        where = f" (looked in {path})" if path else ""
        raise SpecDecodeError(
            f"{user} {drafter!r} needs {what} trained for {model_name!r}{where}: run "
            f"`specdecode train {drafter} --model {model_name}` first, or pass --{user}-option {flag}=DIR"
        )
    return path
