"""Build a datastore from tokenized documents: shard → suffix array → `.npy` files + manifest.

Vocabulary: a **document** is a sequence of token ids; documents are packed into **shards** of at most
`max_shard_tokens` real tokens, each document followed by the separator (see `encoding`). A document longer than a
shard is cut into shard-sized pieces (matches do not cross the cut).

Atomicity: a fresh build writes into a hidden temporary directory beside the target and renames it into place at
the end; `append` builds its new shards in such a directory, moves the files in, then replaces the manifest
atomically, and only then deletes shards dropped by `max_shards`. An error or interrupt leaves the target as it was.

Worked example::

    from datastore import build_from_token_docs, Datastore
    path = build_from_token_docs([[1, 2, 3], [1, 2, 4]], "/tmp/ds", vocab_size=10)
    Datastore.open(path).count([1, 2])            # 2
    build_from_token_docs([[1, 2, 5]], path, vocab_size=10, append=True)
    Datastore.open(path).num_shards               # 2
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from pydivsufsort import divsufsort

from .encoding import TokenEncoding
from .errors import DatastoreError
from .kernels import filter_token_suffixes
from .manifest import MANIFEST, Manifest, ShardInfo, file_checksum, now_iso

DEFAULT_MAX_SHARD_TOKENS = 2**28  # ~1.6 GB of files per shard at 2 bytes/token; ~3.5 GB of RAM while sorting


def max_shard_tokens_limit(width: int) -> int:
    """Largest shard (tokens + separators) whose byte string and positions still fit int32 for divsufsort."""
    return (2**31 - 1) // width - 1


@dataclass(frozen=True)
class TokenizerIdentity:
    """Which tokenizer produced the ids: `id` must match to append; `name` is for humans."""

    id: str
    name: str
    vocab_size: int


@dataclass
class BuildStats:
    """What a build did, for the CLI summary and benchmarks (seconds per phase, sizes)."""

    documents: int = 0
    tokens: int = 0
    shards_written: int = 0
    shards_dropped: int = 0
    bytes_written: int = 0
    seconds: dict[str, float] = field(default_factory=lambda: {"suffix_array": 0.0, "write": 0.0})

    @property
    def bytes_per_token(self) -> float:
        return self.bytes_written / self.tokens if self.tokens else float("nan")


class _ShardPacker:
    """Packs validated documents into shards and writes each shard when full."""

    def __init__(self, directory: Path, enc: TokenEncoding, *, first_id: int, max_tokens: int, stats: BuildStats):
        self.directory = directory
        self.enc = enc
        self.next_id = first_id
        self.max_tokens = max_tokens
        self.stats = stats
        self.pending: list[np.ndarray] = []
        self.pending_tokens = 0
        self.shards: list[ShardInfo] = []

    def add(self, ids: np.ndarray) -> None:
        for start in range(0, ids.size, self.max_tokens):
            piece = ids[start : start + self.max_tokens]
            if self.pending_tokens + piece.size > self.max_tokens:
                self.flush()
            self.pending.append(piece)
            self.pending_tokens += piece.size

    def flush(self) -> None:
        if not self.pending:
            return
        docs, self.pending, self.pending_tokens = self.pending, [], 0
        self.shards.append(write_shard(self.directory, self.next_id, docs, self.enc, self.stats))
        self.next_id += 1


def suffix_array(tokens: np.ndarray, enc: TokenEncoding, num_real: int) -> np.ndarray:
    """int32 token-level suffix array of a stored token array, separator suffixes dropped."""
    byte_sa = divsufsort(enc.to_bytes(tokens))
    return filter_token_suffixes(byte_sa, enc.width, num_real)


def write_shard(directory: Path, shard_id: int, docs: list[np.ndarray], enc: TokenEncoding, stats: BuildStats) -> ShardInfo:
    num_real = sum(d.size for d in docs)
    length = num_real + len(docs)
    tokens = enc.empty(length)
    pos = 0
    sep = np.array([enc.separator], dtype=np.int64)
    for d in docs:
        enc.store(tokens, pos, d)
        enc.store(tokens, pos + d.size, sep)
        pos += d.size + 1
    t0 = time.perf_counter()
    sa = suffix_array(tokens, enc, num_real)
    t1 = time.perf_counter()
    tokens_file, sa_file = ShardInfo.file_names(shard_id)
    checksums = {}
    for name, arr in ((tokens_file, tokens), (sa_file, sa)):
        np.save(directory / name, arr, allow_pickle=False)
        checksums[name] = file_checksum(directory / name)
        stats.bytes_written += (directory / name).stat().st_size
    stats.seconds["suffix_array"] += t1 - t0
    stats.seconds["write"] += time.perf_counter() - t1
    stats.shards_written += 1
    return ShardInfo(
        id=shard_id, tokens_file=tokens_file, sa_file=sa_file, num_tokens=num_real, num_documents=len(docs),
        length=length, checksums=checksums, created=now_iso(),
    )


def _validated(docs: Iterable[Any], vocab_size: int, stats: BuildStats) -> Iterator[np.ndarray]:
    for i, doc in enumerate(docs):
        ids = np.asarray(doc)
        if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
            raise DatastoreError(f"document {i}: expected a 1-D sequence of integer token ids, got {ids.dtype} {ids.shape}")
        if ids.size == 0:
            continue
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= vocab_size:
            bad = lo if lo < 0 else hi
            raise DatastoreError(
                f"document {i}: token id {bad} is outside the vocabulary [0, {vocab_size}); pass the tokenizer's "
                "full vocab_size (added tokens included) or fix the ids"
            )
        stats.documents += 1
        stats.tokens += ids.size
        yield ids.astype(np.int64, copy=False)


def _check_compatible(old: Manifest, tok: TokenizerIdentity, path: Path) -> None:
    if old.tokenizer_id != tok.id or old.vocab_size != tok.vocab_size:
        raise DatastoreError(
            f"{path}: cannot append: the datastore was built with tokenizer {old.tokenizer_name!r} "
            f"(id {old.tokenizer_id}, vocab {old.vocab_size}) but this build uses {tok.name!r} (id {tok.id}, vocab "
            f"{tok.vocab_size}); append with the same tokenizer or build a new datastore with --out"
        )


def build_datastore(
    docs: Iterable[Any],
    out_dir: str | os.PathLike[str],
    *,
    tokenizer: TokenizerIdentity,
    max_shard_tokens: int | None = None,
    append: bool = False,
    max_shards: int | None = None,
    overwrite: bool = False,
    build_info: dict[str, Any] | None = None,
    stats: BuildStats | None = None,
) -> Path:
    """Build (or extend, with `append`) a datastore at `out_dir` from an iterable of token-id documents.

    `docs` is consumed lazily (so tokenization time stays with the caller). Raises `DatastoreError` on bad ids, an
    empty corpus, an existing target without `append`/`overwrite`, or a tokenizer mismatch on append; the target is
    then untouched. Returns the datastore path.
    """
    out = Path(out_dir).absolute()
    enc = TokenEncoding.for_vocab(tokenizer.vocab_size)
    limit = max_shard_tokens_limit(enc.width)
    if max_shard_tokens is None:
        max_shard_tokens = min(DEFAULT_MAX_SHARD_TOKENS, limit)
    if not 1 <= max_shard_tokens <= limit:
        raise DatastoreError(
            f"max_shard_tokens={max_shard_tokens} is out of range [1, {limit}] (int32 suffix-array positions at "
            f"{enc.width} bytes/token); choose a value in that range"
        )
    if max_shards is not None and max_shards < 1:
        raise DatastoreError(f"max_shards={max_shards} must be >= 1")
    stats = stats if stats is not None else BuildStats()

    old: Manifest | None = None
    exists_nonempty = out.exists() and (not out.is_dir() or any(out.iterdir()))
    if append and (out / MANIFEST).exists():
        old = Manifest.read(out)
        _check_compatible(old, tokenizer, out)
    elif exists_nonempty and not overwrite:
        hint = "pass --append to add shards to it or --force to replace it" if (out / MANIFEST).exists() else (
            "choose an empty or new --out directory")
        raise DatastoreError(f"{out}: already exists and is not empty; {hint}")

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.building-", dir=out.parent))
    try:
        packer = _ShardPacker(tmp, enc, first_id=old.next_shard_id if old else 0, max_tokens=max_shard_tokens,
                              stats=stats)
        for ids in _validated(docs, tokenizer.vocab_size, stats):
            packer.add(ids)
        packer.flush()
        if not packer.shards:
            raise DatastoreError(
                "empty corpus: the inputs hold no tokens (no documents, or only empty ones); check the input "
                "paths, --glob and --text-field"
            )
        created = now_iso()
        shards = (old.shards if old else ()) + tuple(packer.shards)
        dropped: tuple[ShardInfo, ...] = ()
        if max_shards is not None and len(shards) > max_shards:
            dropped, shards = shards[: len(shards) - max_shards], shards[len(shards) - max_shards :]
        stats.shards_dropped = len(dropped)
        if old is not None:
            manifest = replace(old, shards=shards, next_shard_id=packer.next_id, updated=created)
            for s in packer.shards:
                for name in (s.tokens_file, s.sa_file):
                    os.replace(tmp / name, out / name)
            manifest.write(out)  # the commit point of an append
            for s in dropped:
                for name in (s.tokens_file, s.sa_file):
                    (out / name).unlink(missing_ok=True)
        else:
            manifest = Manifest(
                tokenizer_id=tokenizer.id, tokenizer_name=tokenizer.name, vocab_size=int(tokenizer.vocab_size),
                token_bytes=enc.width, separator=enc.separator, tokens_dtype=enc.dtype.name, sa_dtype="int32",
                shards=shards, next_shard_id=packer.next_id, created=created, updated=created,
                build=dict(build_info or {}),
            )
            for s in dropped:
                for name in (s.tokens_file, s.sa_file):
                    (tmp / name).unlink()
            manifest.write(tmp)
            _swap_into_place(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _swap_into_place(tmp: Path, out: Path) -> None:
    """Rename the finished build over `out` (an empty directory is replaced by rename; a full one is moved aside
    first and deleted after)."""
    if out.exists() and out.is_dir() and any(out.iterdir()):
        trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.replace(out, trash / "old")
        os.replace(tmp, out)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)


def build_from_token_docs(
    docs: Iterable[Any],
    out_dir: str | os.PathLike[str],
    *,
    vocab_size: int,
    tokenizer_id: str = "synthetic",
    max_shard_tokens: int | None = None,
    append: bool = False,
    max_shards: int | None = None,
    overwrite: bool = False,
) -> Path:
    """Programmatic build from already-tokenized documents (each an int sequence of ids < vocab_size).

    The tokenizer identity is `tokenizer_id` (also its display name); appending requires the same id and
    vocab_size. See the module docstring for an example.
    """
    identity = TokenizerIdentity(id=tokenizer_id, name=tokenizer_id, vocab_size=int(vocab_size))
    TokenEncoding.for_vocab(vocab_size)  # validate before touching the disk
    return build_datastore(docs, out_dir, tokenizer=identity, max_shard_tokens=max_shard_tokens, append=append,
                           max_shards=max_shards, overwrite=overwrite, build_info={"source": "build_from_token_docs"})
