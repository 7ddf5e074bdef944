"""A retrieval datastore: a user's texts tokenized with the target's tokenizer, indexed by a suffix array.

``rasd`` (:mod:`specdecode.drafters.rasd`) drafts what followed the context's longest suffix in these texts.  The
texts are a directory (every file under it that is UTF-8 text, hidden files and folders left out) or a JSON Lines
file (one object a line with a string ``text`` field).  All of them are concatenated, each followed by a separator
no token equals, and sorted into a suffix array by libdivsufsort (``pydivsufsort``): every occurrence of a
pattern is then one contiguous range of the array, found by binary search, and the suffixes of a range are sorted by
the token that follows the pattern, so the continuations of the pattern and how often each occurred are contiguous
runs of it.  Memory: 8 bytes per token (the tokens and the array).

Tokenizing is what costs (seconds per megabyte); the suffix array takes a tenth of a second per million tokens.  So
each text's tokens are cached under the SHA-256 of its content and the tokenizer, in
``$SPECDECODE_DATASTORES`` (default ``<cache>/datastores``): a second run tokenizes nothing, and a run after files
were added or changed tokenizes those alone.  The whole index is cached too, per datastore path, and rebuilt when
any text changed.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import sys
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from transformers import PreTrainedTokenizerBase

from specdecode.errors import SpecDecodeError
from specdecode.models.cache import cache_dir

#: Ends every text: no token id equals it, and it sorts after every token.
SEPARATOR = np.iinfo(np.uint32).max
#: Texts tokenized per call of the tokenizer (a fast tokenizer spreads a batch over threads).
TOKENIZE_BATCH = 64


def datastore_cache() -> Path:
    """``$SPECDECODE_DATASTORES``, else ``<cache>/datastores``."""
    root = os.environ.get("SPECDECODE_DATASTORES")
    return Path(root).expanduser() if root else cache_dir() / "datastores"


#: Tokenizer keys of the tokenizers seen in this process (hashing a large vocabulary takes a noticeable moment).
_KEYS: weakref.WeakKeyDictionary[object, str] = weakref.WeakKeyDictionary()


def tokenizer_key(tokenizer: PreTrainedTokenizerBase) -> str:
    """Names what tokenizing depends on: the fast tokenizer's whole definition (normalizer, pre-tokenizer, model),
    else the vocabulary."""
    key = _KEYS.get(tokenizer)
    if key is None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        definition = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
        text = f"{type(tokenizer).__name__}\n{definition}"
        key = _KEYS[tokenizer] = hashlib.sha256(text.encode()).hexdigest()[:16]
    return key


@dataclass(frozen=True)
class Source:
    """One text of a datastore: where it comes from (for messages) and its content."""

    where: str
    text: str

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()


def read_sources(path: Path) -> tuple[list[Source], int]:
    """The texts of a datastore, in a fixed order, and how many files of a directory were left out as not UTF-8
    text; a missing path, a file that is not ``.jsonl``, a bad JSON line or no text at all is a one-line error."""
    if not path.exists():
        raise SpecDecodeError(f"rasd: datastore {path} does not exist")
    if path.is_dir():
        sources, skipped = _directory_texts(path)
    elif path.suffix == ".jsonl":
        sources, skipped = list(_jsonl_texts(path)), 0
    else:
        raise SpecDecodeError(f"rasd: datastore {path} must be a directory of text files or a .jsonl file of texts")
    if not any(source.text for source in sources):
        raise SpecDecodeError(f"rasd: datastore {path} has no text to index")
    return sources, skipped


def _files(root: Path) -> Iterator[Path]:
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if not d.startswith("."))
        for name in sorted(files):
            if not name.startswith("."):
                yield Path(directory, name)


def _directory_texts(root: Path) -> tuple[list[Source], int]:
    """The UTF-8 texts under ``root``, and how many files were not: a binary file (compiled code, an image) is no
    text to copy from."""
    sources, skipped = [], 0
    for path in _files(root):
        try:
            text = path.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            text = "\0"
        if "\0" in text:
            skipped += 1
        else:
            sources.append(Source(str(path.relative_to(root)), text))
    return sources, skipped


def _jsonl_texts(path: Path) -> Iterator[Source]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecDecodeError(f"rasd: cannot read datastore {path}: {exc}") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SpecDecodeError(f"rasd: datastore {path} line {number}: not valid JSON ({exc.msg})") from None
        if not isinstance(item, dict) or not isinstance(item.get("text"), str):
            raise SpecDecodeError(f"rasd: datastore {path} line {number}: expected an object with a string 'text'")
        yield Source(f"{path.name}:{number}", item["text"])


class Datastore:
    """The tokens of every text, each followed by :data:`SEPARATOR`, and their suffix array."""

    def __init__(self, tokens: np.ndarray, suffixes: np.ndarray, texts: int) -> None:
        self.tokens = tokens  # uint32
        self.suffixes = suffixes  # start of every suffix, sorted by the suffix
        self.texts = texts

    @property
    def size(self) -> int:
        """Tokens indexed, separators excluded."""
        return len(self.tokens) - self.texts

    @classmethod
    def open(cls, path: str | Path, tokenizer: PreTrainedTokenizerBase) -> Datastore:
        """The datastore of the texts at ``path`` for ``tokenizer``, from the cache where nothing changed."""
        path = Path(path).expanduser().absolute()
        sources, skipped = read_sources(path)
        root = datastore_cache() / tokenizer_key(tokenizer)
        digests = [source.digest for source in sources]
        content = hashlib.sha256("\n".join(digests).encode()).hexdigest()
        index_file = root / "indexes" / f"{hashlib.sha256(str(path).encode()).hexdigest()[:16]}.npz"
        if index_file.is_file():
            with np.load(index_file) as saved:
                if str(saved["content"]) == content:
                    return cls(saved["tokens"], saved["suffixes"], len(sources))
        pieces = _tokenized(sources, digests, tokenizer, root / "texts", path, skipped)
        tokens = np.concatenate([np.append(piece, SEPARATOR).astype(np.uint32) for piece in pieces])
        store = cls(tokens, _suffix_array(tokens), len(sources))
        _save(index_file, content=np.array(content), tokens=store.tokens, suffixes=store.suffixes)
        return store

    # -- search: ranges of the suffix array -------------------------------------------------------
    def _key(self, offset: int):
        tokens, suffixes = self.tokens, self.suffixes
        return lambda index: tokens[suffixes[index] + offset]

    def narrow(self, low: int, high: int, offset: int, token: int) -> tuple[int, int]:
        """Of the suffixes ``low..high`` (which share their first ``offset`` tokens), those whose next token is
        ``token``: a range again, empty where none is."""
        key = self._key(offset)
        indices = range(len(self.suffixes))
        start = bisect.bisect_left(indices, token, low, high, key=key)
        return start, bisect.bisect_right(indices, token, start, high, key=key)

    def find(self, pattern: list[int]) -> tuple[int, int]:
        """The range of the suffixes that begin with ``pattern`` (empty where it does not occur)."""
        low, high = 0, len(self.suffixes)
        for offset, token in enumerate(pattern):
            low, high = self.narrow(low, high, offset, token)
            if low == high:
                break
        return low, high

    def longest_suffix(self, context: list[int], shortest: int, longest: int) -> tuple[int, int, int]:
        """The longest suffix of ``context``, ``shortest..longest`` tokens, that occurs: its length and range
        ((0, 0, 0) where none does).  Binary search over the length: a suffix occurs wherever a longer one does."""
        found = (0, 0, 0)
        low, high = shortest, min(longest, len(context))
        while low <= high:
            middle = (low + high) // 2
            start, end = self.find(context[len(context) - middle :])
            if start < end:
                found, low = (middle, start, end), middle + 1
            else:
                high = middle - 1
        return found

    def continuations(self, low: int, high: int, offset: int) -> list[tuple[int, int, int, int]]:
        """The tokens that follow the ``offset`` tokens the suffixes ``low..high`` share: (token, occurrences, and
        the range of the suffixes it continues), most frequent first; the end of a text is no continuation."""
        following = self.tokens[self.suffixes[low:high] + offset]
        bounds = np.flatnonzero(np.diff(following)) + 1  # sorted: each token is one run
        starts = np.concatenate(([0], bounds))
        ends = np.concatenate((bounds, [len(following)]))
        found = [
            (int(following[s]), int(e - s), low + int(s), low + int(e))
            for s, e in zip(starts, ends)
            if following[s] != SEPARATOR
        ]
        return sorted(found, key=lambda item: -item[1])


def _tokenized(
    sources: list[Source],
    digests: list[str],
    tokenizer: PreTrainedTokenizerBase,
    folder: Path,
    path: Path,
    skipped: int,
) -> list[np.ndarray]:
    """Every text's tokens: from the cache where its content was tokenized before, tokenized (and cached) if not."""
    cached = {digest: folder / f"{digest}.npy" for digest in digests}
    missing = sorted({d: s for d, s in zip(digests, sources) if not cached[d].is_file()}.items())
    if missing:
        left_out = f"; {skipped} files that are not UTF-8 text left out" if skipped else ""
        print(
            f"specdecode: rasd: tokenizing {len(missing)} of {len(sources)} texts of {path} (cached for next time)"
            f"{left_out} ...",
            file=sys.stderr,
        )
        folder.mkdir(parents=True, exist_ok=True)
        for start in range(0, len(missing), TOKENIZE_BATCH):
            batch = missing[start : start + TOKENIZE_BATCH]
            encoded = tokenizer([source.text for _, source in batch], add_special_tokens=False)["input_ids"]
            for (digest, _), ids in zip(batch, encoded):
                _save(cached[digest], tokens=np.asarray(ids, dtype=np.uint32))
    return [np.load(cached[digest]) for digest in digests]


def _suffix_array(tokens: np.ndarray) -> np.ndarray:
    from pydivsufsort import divsufsort

    return divsufsort(tokens)


def _save(path: Path, **arrays: np.ndarray) -> None:
    """Write atomically: a reader never sees half a file, and two processes indexing at once both succeed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    with open(temporary, "wb") as handle:
        if path.suffix == ".npy":
            np.save(handle, arrays["tokens"])
        else:
            np.savez(handle, **arrays)
    temporary.replace(path)
