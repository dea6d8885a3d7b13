"""Token encodings: how token ids become the big-endian byte string the suffix array sorts.

Vocabulary
----------
- **width**: bytes per token (2, 3 or 4), the smallest that leaves one code free for the separator.
- **separator**: the largest code of the width (0xFFFF, 0xFFFFFF, 0xFFFFFFFF). It ends every document, so a
  prefix (made of ids < vocab_size) never matches across a document end, and a continuation stops there. Being the
  largest code, suffixes that start with it sort last, so the suffix array simply drops them.
- **big-endian**: the first byte of a token is its most significant one, so comparing byte strings compares token
  sequences; filtering the byte-level suffix array to positions that are multiples of the width gives the
  token-level suffix array.

Worked example: vocab 50,000 → width 2, separator 65535; documents [7, 300], [7] are stored as the uint16 array
[7, 300, 65535, 7, 65535] and handed to divsufsort as bytes 00 07 01 2C FF FF 00 07 FF FF.

Storage per width: 2 → uint16 [n]; 3 → uint8 [n, 3] (the big-endian bytes themselves); 4 → uint32 [n].
At exactly vocab 65,536 every 2-byte code is a real token, so no separator code is left: 3 bytes are used.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import DatastoreError

MAX_VOCAB_SIZE = 2**31 - 1  # ids are returned as int32
_WIDTH_LIMITS = ((2, 2**16 - 1), (3, 2**24 - 1), (4, MAX_VOCAB_SIZE))


@dataclass(frozen=True)
class TokenEncoding:
    """Width, separator and array layout for one vocabulary size."""

    width: int
    separator: int

    @classmethod
    def for_vocab(cls, vocab_size: int) -> "TokenEncoding":
        if not isinstance(vocab_size, (int, np.integer)) or vocab_size < 1:
            raise DatastoreError(f"vocab_size must be a positive integer, got {vocab_size!r}")
        for width, limit in _WIDTH_LIMITS:
            if vocab_size <= limit:
                return cls(width=width, separator=(1 << (8 * width)) - 1)
        raise DatastoreError(
            f"vocab_size {vocab_size} is above the supported maximum {MAX_VOCAB_SIZE} (2^31 - 1: continuations are "
            "returned as int32); use a tokenizer with a smaller vocabulary"
        )

    @property
    def dtype(self) -> np.dtype:
        return np.dtype({2: np.uint16, 3: np.uint8, 4: np.uint32}[self.width])

    def empty(self, length: int) -> np.ndarray:
        """An uninitialised token array of `length` tokens in this encoding's storage layout."""
        shape = (length, 3) if self.width == 3 else (length,)
        return np.empty(shape, dtype=self.dtype)

    def store(self, out: np.ndarray, start: int, ids: np.ndarray) -> None:
        """Write int ids into out[start:start+len(ids)] (ids are assumed validated)."""
        if self.width == 3:
            ids = ids.astype(np.uint32, copy=False)
            block = out[start : start + ids.size]
            block[:, 0] = ids >> 16
            block[:, 1] = (ids >> 8) & 0xFF
            block[:, 2] = ids & 0xFF
        else:
            out[start : start + ids.size] = ids

    def decode(self, stored: np.ndarray) -> np.ndarray:
        """Stored layout → int64 ids (the separator decodes to `self.separator`)."""
        if self.width == 3:
            s = stored.astype(np.int64)
            return (s[:, 0] << 16) | (s[:, 1] << 8) | s[:, 2]
        return stored.astype(np.int64)

    def to_bytes(self, stored: np.ndarray) -> np.ndarray:
        """The big-endian byte string (uint8 [n * width]) that divsufsort sorts."""
        if self.width == 3:
            return np.ascontiguousarray(stored).reshape(-1)
        return stored.astype(f">u{self.width}").view(np.uint8)
