"""Brute-force references for the datastore tests: naive scans and a naive suffix sort (no shared code with
datastore/ beyond the documented sampling rule)."""

from __future__ import annotations

import math

import numpy as np


def naive_count(docs: list[list[int]], prefix: list[int]) -> int:
    m = len(prefix)
    if m == 0:
        return sum(len(d) for d in docs)
    return sum(1 for d in docs for i in range(len(d) - m + 1) if list(d[i : i + m]) == list(prefix))


def shard_docs(docs: list[list[int]], docs_per_shard: list[int]) -> list[list[list[int]]]:
    nonempty = [d for d in docs if len(d)]
    out, i = [], 0
    for n in docs_per_shard:
        out.append(nonempty[i : i + n])
        i += n
    assert i == len(nonempty)
    return out


def _split_k(counts: list[int], k: int) -> list[int]:
    total = sum(counts)
    if total <= k:
        return list(counts)
    take = [k * c // total for c in counts]
    rems = [k * c % total for c in counts]
    order = sorted(range(len(counts)), key=lambda s: (-rems[s], s))
    for s in order[: k - sum(take)]:
        take[s] += 1
    return take


def naive_continuations(shards: list[list[list[int]]], prefix: list[int], k: int, length: int,
                        sep: int) -> tuple[int, np.ndarray]:
    """(count, rows) by sorting every suffix of each shard's separator-joined array as a tuple."""
    m = len(prefix)
    per_shard = []
    for docs in shards:
        arr: list[int] = []
        for d in docs:
            arr.extend(int(t) for t in d)
            arr.append(sep)
        real = [p for p in range(len(arr)) if arr[p] != sep]
        order = sorted(real, key=lambda p: tuple(arr[p:]))
        matches = [p for p in order if arr[p : p + m] == list(prefix)]
        per_shard.append((arr, matches))
    counts = [len(mt) for _, mt in per_shard]
    take = _split_k(counts, k)
    rows = []
    for (arr, matches), kk in zip(per_shard, take):
        if kk == 0:
            continue
        step = max(1.0, len(matches) / kk)
        for j in range(min(kk, len(matches))):
            p = matches[int(math.floor(j * step + 0.5))] + m
            row = []
            for t in range(length):
                if p + t >= len(arr) or arr[p + t] == sep or (row and row[-1] == -1):
                    row.append(-1)
                else:
                    row.append(arr[p + t])
            rows.append(row)
    return sum(counts), np.array(rows, dtype=np.int32).reshape(len(rows), length)


def test_naive_reference_on_a_hand_worked_example() -> None:
    # Shard [5 6 7 | 5 6 8 9 |]: suffixes "5 6 7 ·…" < "5 6 8 9 ·"; k=1 takes round(0 * 2) = the first.
    shards = [[[5, 6, 7], [5, 6, 8, 9]]]
    assert naive_count(shards[0], [5, 6]) == 2 and naive_count(shards[0], [7, 5]) == 0
    count, rows = naive_continuations(shards, [5, 6], k=1, length=2, sep=99)
    assert count == 2 and rows.tolist() == [[7, -1]]
    assert _split_k([6, 2], 4) == [3, 1] and _split_k([3, 2], 4) == [2, 2] and _split_k([1, 1], 5) == [1, 1]
