"""Paged KV cache: fixed-size blocks, a block table per request, an allocator that keeps each request's blocks in runs.

Vocabulary:
    slot        one token's K/V row. Slot s of a request lives in block `table[s // block_size]`, row
                `s % block_size`; its *flat slot* (index into each KV head's pool viewed as
                [num_blocks * block_size, head_dim]) is `table[s // block_size] * block_size + s % block_size`.
    pool        one tensor [n_layers, 2 (K, V), n_kv_heads, num_blocks, block_size, head_dim], head-major: gathering
                a call's blocks gives each KV head's keys as one [requests, keys, head_dim] run, which the attention
                matmuls read in place (token-major blocks had to be transposed into a copy for every layer).
                `keys(l)` and `values(l)` are the per-layer pools [n_kv_heads, num_blocks, block_size, head_dim].

Example (block_size 4): a request with 6 cached tokens holds 2 blocks, say table [7, 2]; its slot 5 is flat slot
2 * 4 + 1 = 9. Admission asks `blocks_needed(prompt + max_new)` <= `free_blocks()`.

Placement: a request's next block is the one after its last where that is free, else the middle of the longest run
of free blocks (its start at the pool's start), which leaves the blocks on either side room to grow. So a prompt's
blocks are one run, and requests that grow side by side (a batch decoding) each extend their own run instead of
taking turns on the lowest free block. A CPU attention kernel reads each block as a 2 KB run per layer and KV head,
and the hardware prefetcher starts over at every jump: a plain step over blocks handed out at random took 1.03-1.47x
its time over blocks in a row (`benchmarks/results/kv_placement.md`).

Prefix caching (`prefix_caching=True`; vLLM's automatic prefix caching, TensorRT-LLM's KV block reuse): a full block
whose K/V are final (`publish`) is keyed by its tokens and the key of the block before it, so one key names one
exact token prefix (dict keys compare the tokens themselves: no hash collision can hand out another prompt's K/V).
A new request `match`es its prompt's leading full blocks and `attach`es them: they are shared, counted by
reference, never written (tree slots and commits lie past the prompt). A block whose last holder leaves stays
cached, counted as free, until an allocation needs it: the least recently released goes first (a request's later
blocks before its earlier ones, so a shared head outlives the tails that hang on it). An optional salt starts the
chain, so requests with different salts never share (vLLM's `cache_salt`).

    cache.match(prompt, max_blocks=(len(prompt) - 1) // block_size, salt=s)  -> blocks holding the longest prefix
    cache.attach(rid, blocks); cache.ensure(rid, len(prompt))                 -> prefill computes the rest
    cache.publish(rid, prompt, len(prompt), salt=s)                          -> its full blocks can be matched
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor


class PrefixIndex:
    """Which block holds which exact token prefix (module docstring): one entry per cached block, keyed by the
    block's tokens and the entry of the block before it (or the salt, for a chain's first block)."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._ids: dict[tuple[int | bytes, bytes], int] = {}  # (previous entry or salt, tokens) -> entry
        self._block: dict[int, int] = {}  # entry -> block
        self._key: dict[int, tuple[int | bytes, bytes]] = {}  # block -> its key
        self._next_id = 1  # never reused: a chain through a forgotten block cannot reach a newer one

    def __len__(self) -> int:
        return len(self._key)

    def __contains__(self, block: int) -> bool:
        return block in self._key

    def match(self, tokens: np.ndarray, max_blocks: int, salt: str | None) -> list[int]:
        """The blocks holding `tokens`' longest cached prefix of at most `max_blocks` full blocks."""
        tokens, bs = np.asarray(tokens, dtype=np.int64), self.block_size
        parent, blocks = self._root(salt), []
        for i in range(min(max_blocks, len(tokens) // bs)):
            entry = self._ids.get((parent, tokens[i * bs:(i + 1) * bs].tobytes()))
            if entry is None:
                break
            blocks.append(self._block[entry])
            parent = entry
        return blocks

    def publish(self, tokens: np.ndarray, blocks: Sequence[int], salt: str | None) -> None:
        """Record that `blocks[i]` holds the K/V of `tokens`' i-th full block (for as many as both have). A prefix
        already cached in another block keeps that one."""
        tokens, bs = np.asarray(tokens, dtype=np.int64), self.block_size
        parent = self._root(salt)
        for i in range(min(len(blocks), len(tokens) // bs)):
            key = (parent, tokens[i * bs:(i + 1) * bs].tobytes())
            entry = self._ids.get(key)
            if entry is None:
                if blocks[i] in self._key:  # the block caches another prefix already: nothing to add past it
                    return
                entry = self._next_id
                self._next_id += 1
                self._ids[key], self._block[entry], self._key[blocks[i]] = entry, blocks[i], key
            parent = entry

    def forget(self, block: int) -> None:
        del self._block[self._ids.pop(self._key.pop(block))]

    def clear(self) -> int:
        forgotten = len(self._key)
        self._ids.clear()
        self._block.clear()
        self._key.clear()
        return forgotten

    @staticmethod
    def _root(salt: str | None) -> int | bytes:
        return 0 if salt is None else salt.encode()


class PagedKVCache:
    def __init__(
        self,
        *,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        prefix_caching: bool = False,
    ):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1; got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        # zeros (calloc) commits memory lazily on CPU, so an oversized pool costs nothing until used.
        self.pool = torch.zeros(n_layers, 2, n_kv_heads, num_blocks, block_size, head_dim, dtype=dtype, device=device)
        self._flat = self.pool.view(n_layers, 2, n_kv_heads, num_blocks * block_size, head_dim)
        self._is_free = np.ones(num_blocks, bool)  # neither held nor cached (module docstring: placement)
        self.tables: dict[object, list[int]] = {}
        self.prefix_caching = bool(prefix_caching)
        self._refs = np.zeros(num_blocks, np.int32)  # tables holding each block
        self._prefixes = PrefixIndex(block_size)
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks nobody holds, oldest release first

    def keys(self, layer: int) -> Tensor:
        return self.pool[layer, 0]

    def values(self, layer: int) -> Tensor:
        return self.pool[layer, 1]

    def flat(self, layer: int, kind: int) -> Tensor:
        """[n_kv_heads, num_blocks * block_size, head_dim] view of layer `layer`'s keys (kind 0) or values (1)."""
        return self._flat[layer, kind]

    def free_blocks(self) -> int:
        """Blocks an allocation can take: unused ones and cached ones nobody holds."""
        return int(np.count_nonzero(self._is_free)) + len(self._evictable)

    def cached_blocks(self) -> int:
        """Blocks holding a prefix that `match` can find (held by a request or not)."""
        return len(self._prefixes)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-max(int(num_tokens), 0) // self.block_size)

    def extra_blocks(self, request_id, num_slots: int) -> int:
        """Blocks `ensure(request_id, num_slots)` would allocate."""
        return max(0, self.blocks_needed(num_slots) - len(self.tables.get(request_id, ())))

    def ensure(self, request_id, num_slots: int) -> None:
        """Grow the request's table to cover `num_slots` slots. Callers check `extra_blocks` first."""
        table = self.tables.setdefault(request_id, [])
        need = self.blocks_needed(num_slots) - len(table)
        if need > self.free_blocks():
            raise RuntimeError(f"KV cache has {self.free_blocks()} free blocks, {need} needed (caller must check "
                               "first)")
        for _ in range(need):
            table.append(self._take(table[-1] + 1 if table else -1))

    def shrink(self, request_id, num_slots: int) -> None:
        """Give back the blocks beyond the first `num_slots` slots."""
        table = self.tables[request_id]
        keep = self.blocks_needed(num_slots)
        while len(table) > keep:
            self._drop(table.pop())

    def release(self, request_id) -> None:
        for block in reversed(self.tables.pop(request_id, [])):  # the tail first: it is evicted first
            self._drop(block)

    # ---- prefix caching (module docstring) ----------------------------------------------------------------------
    def match(self, tokens: np.ndarray, max_blocks: int, *, salt: str | None = None) -> list[int]:
        """The cached blocks holding `tokens`' longest prefix of at most `max_blocks` full blocks (none without
        prefix caching)."""
        return self._prefixes.match(tokens, max_blocks, salt) if self.prefix_caching else []

    def free_after_attach(self, blocks: Sequence[int]) -> int:
        """`free_blocks()` once `blocks` (from `match`) are attached: the cached ones nobody held stop being free."""
        return self.free_blocks() - sum(1 for b in blocks if b in self._evictable)

    def attach(self, request_id, blocks: Sequence[int]) -> None:
        """Start a new request's table with shared cached `blocks` (from `match`)."""
        if request_id in self.tables:
            raise RuntimeError(f"request {request_id!r} already holds blocks; attach starts a table")
        for block in blocks:
            self._evictable.pop(block, None)
            self._refs[block] += 1
        self.tables[request_id] = list(blocks)

    def publish(self, request_id, tokens: np.ndarray, num_tokens: int, *, salt: str | None = None) -> None:
        """Let `match` find the request's full blocks among its first `num_tokens` slots, which hold the K/V of
        `tokens[:num_tokens]` and are never written again. A prefix already cached in another block keeps that one."""
        if self.prefix_caching:
            self._prefixes.publish(np.asarray(tokens)[:num_tokens], self.tables[request_id], salt)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (blocks nobody holds become free); returns how many were
        forgotten. Blocks requests hold stay theirs."""
        self._is_free[list(self._evictable)] = True
        self._evictable.clear()
        return self._prefixes.clear()

    def _take(self, preferred: int) -> int:
        """A block for a table: `preferred` (the one after the table's last, -1 for none) where it is free, else the
        middle of the longest free run, else the cached block released longest ago (evicted)."""
        if 0 <= preferred < self.num_blocks and self._is_free[preferred]:
            block = preferred
        elif self._is_free.any():
            block = self._run_middle()
        else:
            block, _ = self._evictable.popitem(last=False)
            self._prefixes.forget(block)
        self._is_free[block] = False
        self._refs[block] = 1
        return block

    def _run_middle(self) -> int:
        """The middle block of the longest run of free blocks (the first such run), or its first block where it
        starts the pool: a new run there leaves the run's left neighbour, a table that may grow, half the room."""
        edges = np.flatnonzero(np.diff(self._is_free, prepend=False, append=False))  # run starts and ends, paired
        starts, ends = edges[0::2], edges[1::2]
        longest = int(np.argmax(ends - starts))
        start, end = int(starts[longest]), int(ends[longest])
        return start if start == 0 else (start + end) // 2

    def _drop(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] == 0:
            if block in self._prefixes:
                self._evictable[block] = None
            else:
                self._is_free[block] = True

    def flat_slots(self, request_id, start: int, stop: int) -> np.ndarray:
        """int64 flat slot ids of the request's slots [start, stop)."""
        table = np.asarray(self.tables[request_id], dtype=np.int64)
        s = np.arange(start, stop, dtype=np.int64)
        return table[s // self.block_size] * self.block_size + s % self.block_size

    def block_table(self, request_id, num_slots: int) -> np.ndarray:
        """int64 ids of the blocks holding the request's first `num_slots` slots, in slot order."""
        return np.asarray(self.tables[request_id][: self.blocks_needed(num_slots)], dtype=np.int64)

    def block_buffer(self, num_blocks: int) -> Tensor:
        """An uninitialised buffer for up to `num_blocks` blocks of K and V (`gather_blocks` views it)."""
        _, _, heads, _, block_size, head_dim = self.pool.shape
        return self.pool.new_empty(2 * heads * num_blocks * block_size * head_dim)

    def head_block_ids(self, block_ids: np.ndarray) -> Tensor:
        """`gather_blocks`' index for blocks `block_ids`: each block once per KV head, head-major."""
        heads = self.pool.shape[2]
        ids = np.arange(heads, dtype=np.int64)[:, None] * self.num_blocks + np.asarray(block_ids, np.int64)
        return torch.as_tensor(ids.reshape(-1), device=self.pool.device)

    def gather_blocks(self, layer: int, head_block_ids: Tensor, buffer: Tensor) -> Tensor:
        """Layer `layer`'s K and V of the blocks behind `head_block_ids` (`head_block_ids(block_ids)`), copied into
        `buffer` (from `block_buffer`) and returned as [2 (K, V), n_kv_heads, len(block_ids) * block_size, head_dim]:
        one memcpy per block and head, where per-token gathers into fresh tensors cost more than the attention that
        reads them on CPU."""
        _, _, heads, _, block_size, head_dim = self.pool.shape
        n = len(head_block_ids)  # blocks x heads
        out = buffer[: 2 * n * block_size * head_dim].view(2, n, block_size * head_dim)
        for kind in (0, 1):
            rows = self.pool[layer, kind].view(heads * self.num_blocks, -1)
            torch.index_select(rows, 0, head_block_ids, out=out[kind])
        return out.view(2, heads, n // heads * block_size, head_dim)

    def move(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Copy the K/V rows of flat slots `src` to `dst` in every layer (reads all sources before writing); nothing to
        copy costs nothing (no tensors, no inference-mode guard)."""
        if len(src):
            src_t = torch.as_tensor(src, device=self.pool.device)
            dst_t = torch.as_tensor(dst, device=self.pool.device)
            with torch.inference_mode():
                self._flat[:, :, :, dst_t] = self._flat[:, :, :, src_t]

    def gather(self, request_id, num_slots: int) -> Tensor:
        """[n_layers, 2, num_slots, n_kv_heads, head_dim] copy of the request's first `num_slots` slots (tests)."""
        idx = torch.as_tensor(self.flat_slots(request_id, 0, num_slots), device=self.pool.device)
        return self._flat[:, :, :, idx].transpose(2, 3).clone()
