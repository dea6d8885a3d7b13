"""The paged KV cache's allocator: where a request's blocks go (`trt_engines.kv_cache`, placement) and that placing
them never loses or double-books a block."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trt_engines.kv_cache import PagedKVCache


def _cache(num_blocks: int, *, prefix_caching: bool = False) -> PagedKVCache:
    return PagedKVCache(n_layers=1, n_kv_heads=1, head_dim=2, num_blocks=num_blocks, block_size=4,
                        dtype=torch.float32, prefix_caching=prefix_caching)


def _runs(table: list[int]) -> int:
    return 1 + int(np.count_nonzero(np.diff(table) != 1))


def test_requests_growing_side_by_side_each_keep_their_blocks_in_one_run():
    cache = _cache(64)
    ids = ["a", "b", "c", "d"]
    for rid in ids:
        cache.ensure(rid, 9)  # a prompt: three blocks
    for tokens in range(10, 41):  # a batch decoding a token a step: each table grows by turns
        for rid in ids:
            cache.ensure(rid, tokens)
    for rid in ids:
        assert len(cache.tables[rid]) == 10 and _runs(cache.tables[rid]) == 1
    held = [b for rid in ids for b in cache.tables[rid]]
    assert len(set(held)) == len(held) == 40 and cache.free_blocks() == 24


def test_a_tree_step_takes_the_block_after_the_table_and_gives_it_back():
    cache = _cache(16)
    cache.ensure("a", 8)
    cache.ensure("b", 8)
    cache.ensure("a", 13)  # a verify step's tree slots need a third block
    assert _runs(cache.tables["a"]) == 1
    cache.shrink("a", 9)  # the commit keeps one token of it
    cache.ensure("b", 10)
    cache.ensure("a", 12)
    assert _runs(cache.tables["a"]) == 1 and _runs(cache.tables["b"]) == 1


def test_a_fragmented_pool_still_hands_out_every_free_block():
    cache = _cache(12)
    for i in range(12):
        cache.ensure(i, 4)
    assert sorted(b for i in range(12) for b in cache.tables[i]) == list(range(12))
    freed = sorted(cache.tables[i][0] for i in range(0, 12, 2))
    for i in range(0, 12, 2):
        cache.release(i)
    assert cache.free_blocks() == 6
    cache.ensure("big", 24)  # six blocks, wherever the released requests had theirs
    assert sorted(cache.tables["big"]) == freed and cache.free_blocks() == 0
    with pytest.raises(RuntimeError, match="0 free blocks, 1 needed"):
        cache.ensure("big", 25)
    assert len(cache.tables["big"]) == 6  # the refused growth took nothing


def test_cached_blocks_are_taken_only_when_no_free_block_is_left():
    cache = _cache(6, prefix_caching=True)
    cache.ensure("a", 8)
    cache.publish("a", np.arange(8), 8)
    cached = list(cache.tables["a"])
    cache.release("a")
    cache.ensure("b", 16)  # four blocks: the four never cached
    assert not set(cache.tables["b"]) & set(cached) and cache.cached_blocks() == 2
    cache.ensure("b", 20)  # the fifth evicts a cached block (the tail, released first)
    assert cache.tables["b"][-1] == cached[1] and cache.cached_blocks() == 1


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.sampled_from(["grow", "shrink", "release", "publish"]),
                          st.integers(1, 12)), max_size=80))
def test_any_sequence_of_allocations_never_double_books_or_loses_a_block(ops):
    num_blocks = 24
    cache = _cache(num_blocks, prefix_caching=True)
    tokens: dict[int, int] = {}
    for rid, op, n in ops:
        if op == "grow":
            want = tokens.get(rid, 0) + n
            extra = cache.extra_blocks(rid, want)
            if extra > cache.free_blocks():
                with pytest.raises(RuntimeError):
                    cache.ensure(rid, want)
                continue
            cache.ensure(rid, want)
            tokens[rid] = want
        elif op == "shrink" and rid in tokens:
            tokens[rid] = max(tokens[rid] - n, 0)
            cache.shrink(rid, tokens[rid])
        elif op == "release" and rid in tokens:
            cache.release(rid)
            del tokens[rid]
        elif op == "publish" and rid in tokens:  # full blocks of distinct tokens per request: nothing is shared
            cache.publish(rid, np.arange(tokens[rid]) + 1000 * rid, tokens[rid], salt=str(rid))
        held = [b for rid in tokens for b in cache.tables[rid]]
        assert len(held) == len(set(held)), "a block is in two tables"
        assert all(0 <= b < num_blocks for b in held)
        assert cache.free_blocks() == num_blocks - len(held)  # cached blocks nobody holds count as free
