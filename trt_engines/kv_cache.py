"""Paged KV cache: fixed-size blocks, a block table per request, a free-list allocator.

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
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor


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
    ):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1; got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        # zeros (calloc) commits memory lazily on CPU, so an oversized pool costs nothing until used.
        self.pool = torch.zeros(n_layers, 2, n_kv_heads, num_blocks, block_size, head_dim, dtype=dtype, device=device)
        self._flat = self.pool.view(n_layers, 2, n_kv_heads, num_blocks * block_size, head_dim)
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out low block ids first
        self.tables: dict[object, list[int]] = {}

    def keys(self, layer: int) -> Tensor:
        return self.pool[layer, 0]

    def values(self, layer: int) -> Tensor:
        return self.pool[layer, 1]

    def flat(self, layer: int, kind: int) -> Tensor:
        """[n_kv_heads, num_blocks * block_size, head_dim] view of layer `layer`'s keys (kind 0) or values (1)."""
        return self._flat[layer, kind]

    def free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-max(int(num_tokens), 0) // self.block_size)

    def extra_blocks(self, request_id, num_slots: int) -> int:
        """Blocks `ensure(request_id, num_slots)` would allocate."""
        return max(0, self.blocks_needed(num_slots) - len(self.tables.get(request_id, ())))

    def ensure(self, request_id, num_slots: int) -> None:
        """Grow the request's table to cover `num_slots` slots. Callers check `extra_blocks` first."""
        table = self.tables.setdefault(request_id, [])
        need = self.blocks_needed(num_slots) - len(table)
        if need > len(self._free):
            raise RuntimeError(f"KV cache has {len(self._free)} free blocks, {need} needed (caller must check first)")
        for _ in range(need):
            table.append(self._free.pop())

    def shrink(self, request_id, num_slots: int) -> None:
        """Return the blocks beyond the first `num_slots` slots to the free list."""
        table = self.tables[request_id]
        keep = self.blocks_needed(num_slots)
        while len(table) > keep:
            self._free.append(table.pop())

    def release(self, request_id) -> None:
        self._free.extend(reversed(self.tables.pop(request_id, [])))

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
        """Copy the K/V rows of flat slots `src` to `dst` in every layer (reads all sources before writing)."""
        if len(src):
            src_t = torch.as_tensor(src, device=self.pool.device)
            dst_t = torch.as_tensor(dst, device=self.pool.device)
            self._flat[:, :, :, dst_t] = self._flat[:, :, :, src_t]

    def gather(self, request_id, num_slots: int) -> Tensor:
        """[n_layers, 2, num_slots, n_kv_heads, head_dim] copy of the request's first `num_slots` slots (tests)."""
        idx = torch.as_tensor(self.flat_slots(request_id, 0, num_slots), device=self.pool.device)
        return self._flat[:, :, :, idx].transpose(2, 3).clone()
