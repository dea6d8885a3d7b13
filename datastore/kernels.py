"""Numba kernels: suffix-array filtering at build time, prefix search and continuation sampling at query time.

Query vocabulary
----------------
- A **shard** is a token array `tokens` (documents, each followed by the separator) and its suffix array `sa`
  (int32 start positions of the suffixes that start with a real token, sorted).
- The **match range** of a prefix q in a shard is [lo, hi): the suffixes whose first len(q) tokens equal q.
  hi - lo is the prefix's count in that shard. The empty prefix matches every real token position.
- **Sampling** (SSSD): a prefix's k samples are split across shards in proportion to their counts (largest
  remainder, ties to the earlier shard); within a shard k_i samples are taken at
  round(lo + j * step), step = max(1, (hi - lo) / k_i), j = 0 .. min(k_i, hi - lo) - 1 (round = floor(x + 0.5)).
  With step >= 1 no position repeats. Each sample yields the `length` tokens after the prefix, -1 past a document end.

Worked example: one shard holding [5, 6, 7] [5, 6, 8] (vocab 10), prefix [5, 6], k = 1: the match range holds two
suffixes (5 6 7 ·, 5 6 8 ·); step = 2, one sample at lo, continuation (length 2) = [7, -1].

Prefixes come flat (`q` int64 [total], `q_off` int64 [B + 1]); shards come as tuples of arrays of one type, so one
compiled kernel serves any shard count. The batch kernels run `prange` over prefixes; `*_serial` twins skip the
thread launch for single lookups.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange
from numba.extending import overload


def token_at(tokens, i):  # pragma: no cover - replaced by the overload inside numba
    """Token id at position i of a stored array (uint16/uint32 [n] or big-endian uint8 [n, 3])."""
    raise NotImplementedError


@overload(token_at, inline="always")
def _token_at_impl(tokens, i):
    if tokens.ndim == 2:

        def impl(tokens, i):
            return (np.int64(tokens[i, 0]) << 16) | (np.int64(tokens[i, 1]) << 8) | np.int64(tokens[i, 2])

        return impl

    def impl(tokens, i):
        return np.int64(tokens[i])

    return impl


@njit(cache=True)
def filter_token_suffixes(byte_sa, width, num_real):
    """Byte-level suffix array → token-level one: keep positions divisible by `width`, divided by it, and only the
    first `num_real` (the suffixes starting with a separator sort last and are dropped)."""
    out = np.empty(num_real, dtype=np.int32)
    j = 0
    for i in range(byte_sa.size):
        p = byte_sa[i]
        if p % width == 0:
            if j == num_real:
                break
            out[j] = p // width
            j += 1
    return out


@njit(inline="always")
def _compare(tokens, pos, q, qs, m):
    """Sign of tokens[pos:pos+m] versus q[qs:qs+m] (a suffix cut short by the array end compares smaller)."""
    n = tokens.shape[0]
    for j in range(m):
        if pos + j >= n:
            return -1
        t = token_at(tokens, pos + j)
        c = q[qs + j]
        if t < c:
            return -1
        if t > c:
            return 1
    return 0


@njit(cache=True)
def _match_range(tokens, sa, q, qs, m):
    """[lo, hi) of suffixes of one shard starting with q[qs:qs+m]."""
    if m == 0:
        return 0, sa.shape[0]
    lo = 0
    hi = sa.shape[0]
    # Narrow [lo, hi) until the middle matches; then the lower and upper bounds lie on either side of it.
    while lo < hi:
        mid = (lo + hi) >> 1
        c = _compare(tokens, sa[mid], q, qs, m)
        if c < 0:
            lo = mid + 1
        elif c > 0:
            hi = mid
        else:
            a, b = lo, mid
            while a < b:
                h = (a + b) >> 1
                if _compare(tokens, sa[h], q, qs, m) < 0:
                    a = h + 1
                else:
                    b = h
            c2, d = mid + 1, hi
            while c2 < d:
                h = (c2 + d) >> 1
                if _compare(tokens, sa[h], q, qs, m) <= 0:
                    c2 = h + 1
                else:
                    d = h
            return a, c2
    return lo, lo


@njit(cache=True)
def _ranges_one(tokens_tup, sa_tup, q, q_off, b, lo, hi):
    num_shards = len(tokens_tup)
    qs = q_off[b]
    m = q_off[b + 1] - qs
    total = 0
    for s in range(num_shards):
        a, c = _match_range(tokens_tup[s], sa_tup[s], q, qs, m)
        lo[b, s] = a
        hi[b, s] = c
        total += c - a
    return total


@njit(cache=True)
def _split_k(lo, hi, b, k, total, take):
    """take[b, s] = samples from shard s: all matches when they fit in k, else k split in proportion to counts."""
    num_shards = lo.shape[1]
    if total <= k:
        for s in range(num_shards):
            take[b, s] = hi[b, s] - lo[b, s]
        return total
    given = 0
    for s in range(num_shards):
        take[b, s] = (k * (hi[b, s] - lo[b, s])) // total
        given += take[b, s]
    # Largest remainder first; ties go to the earlier shard (strict '>' keeps the first maximum).
    for _ in range(k - given):
        best = -1
        best_rem = -1
        for s in range(num_shards):
            rem = (k * (hi[b, s] - lo[b, s])) % total
            # take * total <= k * count holds until a shard got its +1, so no shard gains twice.
            if rem > best_rem and take[b, s] * total <= k * (hi[b, s] - lo[b, s]):
                best_rem = rem
                best = s
        take[b, best] += 1
    return k


@njit(cache=True)
def _gather_one(tokens_tup, sa_tup, sep, q_off, b, lo, hi, take, length, rows, row0):
    m = q_off[b + 1] - q_off[b]
    r = row0
    for s in range(len(tokens_tup)):
        kk = take[b, s]
        if kk == 0:
            continue
        tokens = tokens_tup[s]
        sa = sa_tup[s]
        n = tokens.shape[0]
        span = hi[b, s] - lo[b, s]
        step = span / kk
        if step < 1.0:
            step = 1.0
        for j in range(kk):
            idx = np.int64(np.floor(lo[b, s] + j * step + 0.5))
            p = np.int64(sa[idx]) + m
            ended = False
            for t in range(length):
                if not ended:
                    if p + t >= n:
                        ended = True
                    else:
                        tok = token_at(tokens, p + t)
                        if tok == sep:
                            ended = True
                        else:
                            rows[r, t] = tok
                if ended:
                    rows[r, t] = -1
            r += 1


@njit(parallel=True, cache=True)
def count_batch_kernel(tokens_tup, sa_tup, q, q_off):
    """Occurrences of each prefix summed over shards: int64 [B]."""
    nb = q_off.shape[0] - 1
    lo = np.empty((nb, len(tokens_tup)), dtype=np.int64)
    hi = np.empty_like(lo)
    out = np.empty(nb, dtype=np.int64)
    for b in prange(nb):
        out[b] = _ranges_one(tokens_tup, sa_tup, q, q_off, b, lo, hi)
    return out


@njit(cache=True)
def count_batch_serial(tokens_tup, sa_tup, q, q_off):
    """`count_batch_kernel` without the thread launch (for one or a few prefixes)."""
    nb = q_off.shape[0] - 1
    lo = np.empty((nb, len(tokens_tup)), dtype=np.int64)
    hi = np.empty_like(lo)
    out = np.empty(nb, dtype=np.int64)
    for b in range(nb):
        out[b] = _ranges_one(tokens_tup, sa_tup, q, q_off, b, lo, hi)
    return out


@njit(parallel=True, cache=True)
def continuations_batch_kernel(tokens_tup, sa_tup, sep, q, q_off, k, length):
    """Counts int64 [B], row offsets int64 [B + 1] and continuation rows int32 [R, length] for every prefix."""
    nb = q_off.shape[0] - 1
    num_shards = len(tokens_tup)
    lo = np.empty((nb, num_shards), dtype=np.int64)
    hi = np.empty_like(lo)
    take = np.empty_like(lo)
    counts = np.empty(nb, dtype=np.int64)
    nrows = np.empty(nb, dtype=np.int64)
    for b in prange(nb):
        counts[b] = _ranges_one(tokens_tup, sa_tup, q, q_off, b, lo, hi)
        nrows[b] = _split_k(lo, hi, b, k, counts[b], take)
    offsets = np.empty(nb + 1, dtype=np.int64)
    offsets[0] = 0
    for b in range(nb):
        offsets[b + 1] = offsets[b] + nrows[b]
    rows = np.empty((offsets[nb], length), dtype=np.int32)
    for b in prange(nb):
        _gather_one(tokens_tup, sa_tup, sep, q_off, b, lo, hi, take, length, rows, offsets[b])
    return counts, offsets, rows


@njit(cache=True)
def continuations_batch_serial(tokens_tup, sa_tup, sep, q, q_off, k, length):
    """`continuations_batch_kernel` without the thread launch (for one or a few prefixes)."""
    nb = q_off.shape[0] - 1
    num_shards = len(tokens_tup)
    lo = np.empty((nb, num_shards), dtype=np.int64)
    hi = np.empty_like(lo)
    take = np.empty_like(lo)
    counts = np.empty(nb, dtype=np.int64)
    offsets = np.empty(nb + 1, dtype=np.int64)
    offsets[0] = 0
    for b in range(nb):
        counts[b] = _ranges_one(tokens_tup, sa_tup, q, q_off, b, lo, hi)
        offsets[b + 1] = offsets[b] + _split_k(lo, hi, b, k, counts[b], take)
    rows = np.empty((offsets[nb], length), dtype=np.int32)
    for b in range(nb):
        _gather_one(tokens_tup, sa_tup, sep, q_off, b, lo, hi, take, length, rows, offsets[b])
    return counts, offsets, rows


# Building blocks for numba kernels of other packages (the drafter's batched back-off lookup calls them from its own
# compiled code, so a whole batch of lookups costs one Python call). Queries must be validated by the caller.
ranges_one = _ranges_one
split_k = _split_k
gather_one = _gather_one
