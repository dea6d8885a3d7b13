"""`Datastore`: a read-only, memory-mapped suffix-array datastore and its query API.

Vocabulary: a **prefix** is a token sequence to look up; its **count** is how often it occurs (summed over shards,
never across a document end); a **continuation** of an occurrence is the `length` tokens that follow it, padded with
-1 where the document ends. `continuations(prefix, k, length)` samples at most k occurrences at even spacing over
each shard's sorted match range (SSSD), k split across shards in proportion to their counts.

Worked example::

    from datastore import Datastore, build_from_token_docs
    path = build_from_token_docs([[5, 6, 7], [5, 6, 8, 9]], "/tmp/ds", vocab_size=10)
    ds = Datastore.open(path)
    ds.count([5, 6])                      # 2
    ds.continuations([5, 6], k=10, length=2)
    # array([[ 7, -1],
    #        [ 8,  9]], dtype=int32)      (suffix order: "5 6 7 ·" sorts before "5 6 8 9 ·")
    batch = ds.continuations_batch([[5, 6], [9]], k=10, length=2)
    batch.counts                          # array([2, 1])
    batch.rows[batch.offsets[1]:batch.offsets[2]]   # array([[-1, -1]]): 9 ends its document
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from . import kernels
from .encoding import TokenEncoding
from .errors import DatastoreError
from .manifest import Manifest, file_checksum

# Below this many prefixes the serial kernel wins. Measured on the 12.7M-token default datastore (2 cores shared
# with other jobs): serial 2.3 µs/prefix for count and 8.6 µs for continuations(k=100, length=8) at batch 64, while
# the prange kernel took ~8 ms per batch, waiting for a second core that was busy (one scheduler slice). The
# parallel kernel only pays once a batch holds milliseconds of work.
PARALLEL_MIN_BATCH = 512


class ContinuationBatch(NamedTuple):
    """Continuations of B prefixes: rows of prefix i are rows[offsets[i]:offsets[i+1]]."""

    rows: np.ndarray  # int32 [R, length], -1 past a document end
    offsets: np.ndarray  # int64 [B + 1]
    counts: np.ndarray  # int64 [B]: total matches of each prefix (as count_batch)


class Datastore:
    """A datastore directory opened for queries (see the module docstring for the vocabulary and an example).

    Open with `Datastore.open(path, verify=False)`; `verify=True` also recomputes every file's xxhash64. Arrays are
    memory-mapped read-only, so many processes share one copy through the page cache.
    """

    def __init__(self, path: Path, manifest: Manifest, tokens: tuple[np.ndarray, ...], sas: tuple[np.ndarray, ...]):
        self.path = path
        self.manifest = manifest
        self._tokens = tokens
        self._sas = sas
        self._sep = int(manifest.separator)

    # ---------------------------------------------------------------- opening
    @classmethod
    def open(cls, path: str | os.PathLike[str], verify: bool = False) -> "Datastore":
        path = Path(path)
        m = Manifest.read(path)
        enc = TokenEncoding.for_vocab(m.vocab_size)
        if (enc.width, enc.separator, enc.dtype.name) != (m.token_bytes, m.separator, m.tokens_dtype) or not m.shards:
            raise DatastoreError(f"{path}/manifest.json: inconsistent encoding or no shards; rebuild the datastore")
        tokens, sas = [], []
        for s in m.shards:
            for name in (s.tokens_file, s.sa_file):
                f = path / name
                if not f.is_file():
                    raise DatastoreError(
                        f"{f}: shard file missing (shard {s.id}); the datastore is incomplete: rebuild it, or restore "
                        "the file"
                    )
                if verify and file_checksum(f) != s.checksums.get(name):
                    raise DatastoreError(
                        f"{f}: checksum mismatch (shard {s.id}): the file is corrupted; rebuild the datastore"
                    )
            t = _load(path / s.tokens_file, s.id)
            sa = _load(path / s.sa_file, s.id)
            want_t = (s.length, 3) if enc.width == 3 else (s.length,)
            if t.dtype != enc.dtype or t.shape != want_t or sa.dtype != np.int32 or sa.shape != (s.num_tokens,):
                raise DatastoreError(
                    f"{path}: shard {s.id} arrays have dtype/shape {t.dtype}{t.shape}, {sa.dtype}{sa.shape} but the "
                    f"manifest says {enc.dtype}{want_t}, int32({s.num_tokens},); rebuild the datastore"
                )
            tokens.append(t)
            sas.append(sa)
        return cls(path, m, tuple(tokens), tuple(sas))

    # ---------------------------------------------------------------- metadata
    @property
    def vocab_size(self) -> int:
        return self.manifest.vocab_size

    @property
    def num_tokens(self) -> int:
        return self.manifest.num_tokens

    @property
    def num_documents(self) -> int:
        return self.manifest.num_documents

    @property
    def num_shards(self) -> int:
        return len(self.manifest.shards)

    @property
    def tokenizer_id(self) -> str:
        return self.manifest.tokenizer_id

    @property
    def bytes_on_disk(self) -> int:
        files = [self.path / n for s in self.manifest.shards for n in (s.tokens_file, s.sa_file)]
        return sum(f.stat().st_size for f in files) + (self.path / "manifest.json").stat().st_size

    def __repr__(self) -> str:
        return (f"Datastore({str(self.path)!r}, tokens={self.num_tokens}, documents={self.num_documents}, "
                f"shards={self.num_shards}, vocab={self.vocab_size})")

    def kernel_arrays(self) -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...], int]:
        """(token arrays, suffix arrays, separator code), one entry per shard, zero-copy: for numba kernels of other
        packages built on `datastore.kernels` (they must validate query ids against `vocab_size` themselves)."""
        return self._tokens, self._sas, self._sep

    def documents(self) -> Iterator[np.ndarray]:
        """Every stored document as int32 token ids, shard by shard (for building peer indexes from the same text)."""
        enc = TokenEncoding.for_vocab(self.vocab_size)
        for stored in self._tokens:
            ids = enc.decode(np.asarray(stored))
            ends = np.flatnonzero(ids == self._sep)
            start = 0
            for end in ends:
                yield ids[start:end].astype(np.int32)
                start = end + 1

    # ---------------------------------------------------------------- queries
    def count(self, prefix: Any) -> int:
        """Occurrences of the token sequence `prefix` (never across a document end), summed over shards."""
        return int(self.count_batch([prefix])[0])

    def continuations(self, prefix: Any, k: int, length: int) -> np.ndarray:
        """int32 [<=k, length]: the tokens after up to k evenly sampled occurrences of `prefix`."""
        return self.continuations_batch([prefix], k, length).rows

    def count_batch(self, prefixes: Sequence[Any] | np.ndarray) -> np.ndarray:
        """int64 [B]: `count` of every prefix, in one kernel call."""
        flat, offsets = self._flatten(prefixes)
        return self.count_flat(flat, offsets)

    def continuations_batch(self, prefixes: Sequence[Any] | np.ndarray, k: int, length: int) -> ContinuationBatch:
        """Continuations of every prefix in one kernel call (see `ContinuationBatch`)."""
        flat, offsets = self._flatten(prefixes)
        return self.continuations_flat(flat, offsets, k, length)

    def count_flat(self, flat: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """`count_batch` on prefixes given flat: prefix i is flat[offsets[i]:offsets[i+1]] (int64 arrays)."""
        flat, offsets = self._check_flat(flat, offsets)
        kernel = kernels.count_batch_kernel if offsets.size > PARALLEL_MIN_BATCH else kernels.count_batch_serial
        return kernel(self._tokens, self._sas, flat, offsets)

    def continuations_flat(self, flat: np.ndarray, offsets: np.ndarray, k: int, length: int) -> ContinuationBatch:
        """`continuations_batch` on prefixes given flat (see `count_flat`)."""
        flat, offsets = self._check_flat(flat, offsets)
        if int(k) < 0 or int(length) < 0:
            raise DatastoreError(f"k and length must be >= 0, got k={k}, length={length}")
        kernel = (kernels.continuations_batch_kernel if offsets.size > PARALLEL_MIN_BATCH
                  else kernels.continuations_batch_serial)
        counts, offs, rows = kernel(self._tokens, self._sas, self._sep, flat, offsets, int(k), int(length))
        return ContinuationBatch(rows=rows, offsets=offs, counts=counts)

    # ---------------------------------------------------------------- validation at the boundary
    def _flatten(self, prefixes: Sequence[Any] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if isinstance(prefixes, np.ndarray) and prefixes.ndim == 2:
            b, m = prefixes.shape
            return prefixes.reshape(-1), np.arange(b + 1, dtype=np.int64) * m
        arrays = [np.asarray(p) for p in prefixes]
        for i, a in enumerate(arrays):
            if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
                raise DatastoreError(f"prefix {i}: expected a 1-D sequence of integer token ids, got {a.dtype}{a.shape}")
            if a.size == 0:
                arrays[i] = a.astype(np.int64)
        offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
        np.cumsum([a.size for a in arrays], out=offsets[1:])
        flat = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)
        return flat, offsets

    def _check_flat(self, flat: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        flat = np.ascontiguousarray(flat)
        if flat.size and flat.dtype.kind not in "iu":
            raise DatastoreError(f"prefix tokens must be integers, got {flat.dtype}")
        flat = flat.astype(np.int64, copy=False)
        offsets = np.ascontiguousarray(offsets, dtype=np.int64)
        if offsets.ndim != 1 or offsets.size < 1 or offsets[0] != 0 or offsets[-1] != flat.size or (
                offsets.size > 1 and np.any(offsets[1:] < offsets[:-1])):
            raise DatastoreError("offsets must be non-decreasing int64 [B + 1] from 0 to len(flat)")
        if flat.size:
            lo, hi = int(flat.min()), int(flat.max())
            if lo < 0 or hi >= self.vocab_size:
                bad = lo if lo < 0 else hi
                raise DatastoreError(
                    f"token id {bad} in a query is outside the vocabulary [0, {self.vocab_size}) of {self.path}; "
                    "query with ids from the datastore's tokenizer"
                )
        return flat, offsets


def _load(f: Path, shard_id: int) -> np.ndarray:
    try:
        return np.asarray(np.load(f, mmap_mode="r", allow_pickle=False))
    except (ValueError, OSError, EOFError) as e:
        raise DatastoreError(f"{f}: unreadable or truncated shard file (shard {shard_id}: {e}); rebuild the datastore")
