"""On-disk format: `manifest.json` plus two `.npy` files per shard.

Layout of a datastore directory::

    manifest.json
    shard-00000.tokens.npy   # documents, each followed by the separator (uint16 [n] / uint8 [n, 3] / uint32 [n])
    shard-00000.sa.npy       # int32 [num_tokens]: token positions sorted by suffix (separator suffixes dropped)
    shard-00001.tokens.npy ...

`manifest.json` holds the format version, the tokenizer identity (`tokenizer_id`, a human name, vocab size), the
encoding (bytes per token, separator, dtypes) and per shard: file names, token and document counts, array length
and the xxhash64 of each file. Files are plain `.npy` (read with allow_pickle=False, memory-mapped). The manifest
is replaced atomically (write a temporary file, then os.replace), so readers see the old or the new one, never half.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import xxhash

from .errors import DatastoreError

FORMAT_NAME = "retrospec-datastore"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class ShardInfo:
    """One shard: its files, sizes and checksums."""

    id: int
    tokens_file: str
    sa_file: str
    num_tokens: int  # real tokens (= suffix array length)
    num_documents: int  # = separators in the token array
    length: int  # token array length = num_tokens + num_documents
    checksums: dict[str, str]  # file name -> "xxh64:<hex>"
    created: str

    @staticmethod
    def file_names(shard_id: int) -> tuple[str, str]:
        return f"shard-{shard_id:05d}.tokens.npy", f"shard-{shard_id:05d}.sa.npy"


@dataclass(frozen=True)
class Manifest:
    """Everything needed to open and check a datastore."""

    tokenizer_id: str
    tokenizer_name: str
    vocab_size: int
    token_bytes: int
    separator: int
    tokens_dtype: str
    sa_dtype: str
    shards: tuple[ShardInfo, ...]
    next_shard_id: int
    created: str
    updated: str
    build: dict[str, Any] = field(default_factory=dict)  # how it was built (preset, sources); informational
    format: str = FORMAT_NAME
    format_version: int = FORMAT_VERSION

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.shards)

    @property
    def num_documents(self) -> int:
        return sum(s.num_documents for s in self.shards)

    def to_json(self) -> str:
        d = asdict(self)
        d["shards"] = [asdict(s) for s in self.shards]
        return json.dumps(d, indent=2, sort_keys=True) + "\n"

    @classmethod
    def read(cls, directory: Path) -> "Manifest":
        path = Path(directory) / MANIFEST
        if not Path(directory).is_dir():
            raise DatastoreError(f"{directory}: no such datastore directory; build one with `build-datastore`")
        if not path.is_file():
            raise DatastoreError(
                f"{path}: manifest missing, so {directory} is not a (complete) datastore; rebuild it with "
                "`build-datastore`"
            )
        try:
            d = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise DatastoreError(f"{path}: unreadable manifest ({e}); rebuild the datastore with `build-datastore`")
        if not isinstance(d, dict) or d.get("format") != FORMAT_NAME:
            raise DatastoreError(f"{path}: not a retrospec datastore manifest; rebuild with `build-datastore`")
        if d.get("format_version") != FORMAT_VERSION:
            raise DatastoreError(
                f"{path}: unknown format version {d.get('format_version')!r} (this code reads version "
                f"{FORMAT_VERSION}); rebuild the datastore with this version's `build-datastore`"
            )
        try:
            shards = tuple(ShardInfo(**s) for s in d.pop("shards"))
            return cls(shards=shards, **d)
        except (TypeError, KeyError) as e:
            raise DatastoreError(f"{path}: malformed manifest ({e}); rebuild the datastore with `build-datastore`")

    def write(self, directory: Path) -> None:
        """Atomically replace `directory/manifest.json`."""
        fd, tmp = tempfile.mkstemp(prefix=".manifest-", suffix=".tmp", dir=directory)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(self.to_json())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, Path(directory) / MANIFEST)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def file_checksum(path: Path, chunk: int = 1 << 22) -> str:
    """"xxh64:<hex>" of a file, read in 4 MiB chunks."""
    h = xxhash.xxh64()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return "xxh64:" + h.hexdigest()
