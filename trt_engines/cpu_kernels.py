"""CPU kernels for bf16 models on processors without bf16 dot-product instructions (numba).

Without AVX512-BF16 or AMX, PyTorch's bf16 matmuls on the CPU fall back to a slow path: on a 2-core AVX2 EPYC a
16-row bf16 linear layer ran at ~16 GFLOP/s (one of SmolLM2's MLP projections: 3.5 ms for 16 rows, 0.47 ms for 2),
and its batched attention matmuls likewise, so verifying a 15-node tree cost 6.6x a plain step. These kernels read
the bf16 weights and KV cache as raw bits, widen them to fp32 in registers and accumulate in fp32 (what bf16 GEMMs
do), at ~100 GFLOP/s on the same machine (0.58 ms for 16 rows). `TorchEngine(cpu_kernels=...)` decides where they run.

Both are batch-invariant by construction, which is what lossless bf16 speculation needs (`torch_engine` docstring):

- `linear`: every output element is one dot product over the input features, in a fixed order that depends only on
  the layer's shape, never on how many rows are computed together or where a row sits in the batch.
- `tree_attention`: each query row attends over exactly the keys it may see (its context, its tree ancestors,
  itself), gathered into one list in slot order; masked keys are left out, not given zero weight. A score is one dot
  product over head_dim whatever else is computed beside it, and the softmax and the weighted sum of values run
  over that list alone, split into vector lanes in a way that depends only on its length. A draft token's list is
  the one plain decoding of its path sees (its ancestors are the tokens plain decoding saw, in the same order), so
  verified anywhere in a draft tree, on any branch, next to any other requests, it gets bitwise the result it gets
  in plain decoding.

Shapes (packed tokens, `trt_engines.llama` vocabulary), all bf16 bits (uint16 views, `bf16_bits`): x [T, K];
weights [N, K]; the KV pool of a layer [kv_heads, slots, head_dim]; q [T, heads, head_dim]. Outputs are bf16 (fp32
on request, for tests).
"""

from __future__ import annotations

import functools
import os
import platform

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload
from torch import Tensor

# Reassociation lets the dot products vectorise (a fixed split into lanes, the same for every row); contraction
# fuses multiply-adds. Neither depends on the data or on the batch, so results stay batch-invariant (attention's
# sums over keys run over each row's own key list, so there too the split depends only on that list).
_FASTMATH = {"reassoc", "contract", "nsz"}
WEIGHT_ROWS = 4  # output features per task of `_linear_kernel` (times two input rows: eight dot products at once)
_ROW_CHUNK = 64  # input rows per kernel call (even): a chunk stays in L2 while every weight tile streams past it
_LINE_ELEMENTS = 32  # bf16 values per 64-byte cache line
_TASKS_PER_THREAD = 4  # runs of weight tiles per thread and `_linear_kernel` call: balanced however they split


def bf16_bits(t: Tensor) -> np.ndarray:
    """A uint16 numpy view (no copy) of a contiguous bf16 CPU tensor's bits."""
    if t.dtype != torch.bfloat16 or t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"expected a contiguous bf16 CPU tensor; got {t.dtype} on {t.device}")
    return t.view(torch.int16).numpy().view(np.uint16)


def cpu_has_native_bf16() -> bool:
    """Whether this CPU has bf16 dot-product instructions (AVX512-BF16 or AMX-BF16), i.e. PyTorch's bf16 matmuls
    run at full speed and the `torch` path is the fast one."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return True  # not Linux: keep PyTorch's kernels
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cpu_description() -> str:
    """This CPU as CPU benchmarks quote it: architecture, cores, PyTorch's vector ISA, and whether it has bf16
    dot-product instructions (which decides where "auto" runs these kernels)."""
    bf16 = "bf16 dot products" if cpu_has_native_bf16() else "no bf16 dot-product instructions"
    return f"{platform.machine()} {os.cpu_count()} cores ({torch.backends.cpu.get_cpu_capability()}, {bf16})"


@njit(inline="always")
def _widen(bits: np.uint16) -> np.uint32:
    """bf16 bits -> the bits of the same value in fp32 (its high half)."""
    return np.uint32(bits) << np.uint32(16)


@njit(inline="always")
def _round_bf16(bits: np.uint32) -> np.uint16:
    """fp32 bits -> bf16 bits, rounded to nearest even (torch's `.to(torch.bfloat16)` for finite values)."""
    return np.uint16((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


def _store(out, i, j, values, index):  # pragma: no cover - replaced by the overload inside numba
    """out[i, j] = values[index] (an fp32 scratch array): as bf16 bits when `out` is uint16, else as fp32."""


@overload(_store, inline="always")
def _store_overload(out, i, j, values, index):
    if out.dtype == types.uint16:
        def store_bf16(out, i, j, values, index):
            out[i, j] = _round_bf16(values.view(np.uint32)[index])
        return store_bf16

    def store_fp32(out, i, j, values, index):
        out[i, j] = values[index]
    return store_fp32


@njit(inline="always")
def _dot_2x4(xa, xb, w0, w1, w2, w3, n):
    """The eight dot products of two vectors with four others over their first n elements, in one loop (vectorised
    along it): the one loop body both kernels compute every product with, whatever else is computed beside it."""
    a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = np.float32(0.0)
    for k in range(n):
        u, v = xa[k], xb[k]
        a0 += u * w0[k]
        a1 += u * w1[k]
        a2 += u * w2[k]
        a3 += u * w3[k]
        b0 += v * w0[k]
        b1 += v * w1[k]
        b2 += v * w2[k]
        b3 += v * w3[k]
    return a0, a1, a2, a3, b0, b1, b2, b3


@intrinsic
def _prefetch(typingctx, array, row, col):
    """Ask the CPU to start loading array[row, col]'s cache line (LLVM's prefetch: read, keep in every cache level);
    a hint that never faults and changes no value."""
    if not (isinstance(array, types.Array) and array.ndim == 2):
        return None

    def codegen(context, builder, signature, args):
        array_type = signature.args[0]
        view = context.make_array(array_type)(context, builder, args[0])
        pointer = cgutils.get_item_pointer(context, builder, array_type, view, [args[1], args[2]], wraparound=False)
        i32 = ir.IntType(32)
        function_type = ir.FunctionType(ir.VoidType(), [pointer.type, i32, i32, i32])
        function = cgutils.get_or_insert_function(builder.module, function_type, "llvm.prefetch.p0")
        builder.call(function, [pointer, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return types.void(array, row, col), codegen


@njit(parallel=True, fastmath=_FASTMATH, boundscheck=False, cache=True)
def _linear_kernel(x: np.ndarray, w: np.ndarray, bias: np.ndarray, out: np.ndarray, tasks: int) -> None:
    """out = x w^T + bias, accumulated in fp32: x [M, K], w [N, K] (N a multiple of WEIGHT_ROWS) bf16 bits, bias [N]
    fp32, out [M, N] bf16 bits (or fp32); `tasks` runs of consecutive weight tiles share the threads, each allocating
    its scratch once. Every output comes out of the same loop body (`_dot_2x4`: two input rows x four weight rows)
    whatever M is (an odd last row is paired with itself): that is what makes rows batch-invariant.

    A verify step's few rows make each weight tile's compute short, and waiting for the next tile from memory cost
    about as much as the arithmetic: so each pass over the rows prefetches its share of the next tile's cache lines,
    and the fetch overlaps this tile's compute (the same bits). With one pass (one or two rows) there is nothing to
    overlap the fetch with, and the hardware prefetcher alone streams the weights. What this buys is not yet in a
    committed results file: `verify_cost.md` predates it."""
    rows, k_dim = x.shape
    tiles = w.shape[0] // WEIGHT_ROWS
    passes = (rows + 1) // 2
    row_lines = (k_dim + _LINE_ELEMENTS - 1) // _LINE_ELEMENTS
    lines_per_pass = (WEIGHT_ROWS * row_lines + passes - 1) // passes
    xw = np.empty((rows, k_dim), np.uint32)
    for m in range(rows):
        for k in range(k_dim):
            xw[m, k] = _widen(x[m, k])
    xf = xw.view(np.float32)
    for task in prange(tasks):
        ww = np.empty((WEIGHT_ROWS, k_dim), np.uint32)
        result = np.empty(2 * WEIGHT_ROWS, np.float32)
        for tile in range(task * tiles // tasks, (task + 1) * tiles // tasks):
            n0 = tile * WEIGHT_ROWS
            prefetching = passes > 1 and tile + 1 < tiles
            for r in range(WEIGHT_ROWS):
                for k in range(k_dim):
                    ww[r, k] = _widen(w[n0 + r, k])
            wf = ww.view(np.float32)
            w0, w1, w2, w3 = wf[0], wf[1], wf[2], wf[3]
            for m in range(0, rows, 2):
                if prefetching:
                    first = (m // 2) * lines_per_pass
                    for line in range(first, min(first + lines_per_pass, WEIGHT_ROWS * row_lines)):
                        _prefetch(w, n0 + WEIGHT_ROWS + line // row_lines, (line % row_lines) * _LINE_ELEMENTS)
                xa, xb = xf[m], xf[min(m + 1, rows - 1)]
                a0, a1, a2, a3, b0, b1, b2, b3 = _dot_2x4(xa, xb, w0, w1, w2, w3, k_dim)
                result[0], result[1], result[2], result[3] = a0, a1, a2, a3
                result[4], result[5], result[6], result[7] = b0, b1, b2, b3
                for r in range(WEIGHT_ROWS):
                    result[r] += bias[n0 + r]
                    result[WEIGHT_ROWS + r] += bias[n0 + r]
                for r in range(WEIGHT_ROWS):
                    _store(out, m, n0 + r, result, r)
                    if m + 1 < rows:
                        _store(out, m + 1, n0 + r, result, WEIGHT_ROWS + r)


class Bf16Linear:
    """A bf16 weight [N, K] (and optional bias) applied with `_linear_kernel`; `__call__(x [T, K] bf16) -> [T, N]
    bf16`. Holds a view of the weight's bits (a zero-padded copy when N is not a multiple of WEIGHT_ROWS)."""

    def __init__(self, weight: Tensor, bias: Tensor | None = None):
        self.out_features = weight.shape[0]
        bits = bf16_bits(weight.detach())
        pad = -self.out_features % WEIGHT_ROWS
        self.bits = np.concatenate([bits, np.zeros((pad, bits.shape[1]), np.uint16)]) if pad else bits
        self.bias = np.zeros(self.bits.shape[0], np.float32)
        if bias is not None:
            self.bias[: self.out_features] = bias.detach().float().numpy()

    def __call__(self, x: Tensor, *, fp32_out: bool = False) -> Tensor:
        """x [T, K] bf16 -> [T, N] bf16 (`fp32_out`: the fp32 accumulations before rounding, for tests)."""
        if x.dtype != torch.bfloat16:
            raise TypeError(f"Bf16Linear takes bf16 inputs; got {x.dtype}")
        xb = bf16_bits(x.detach().contiguous())
        out = np.empty((xb.shape[0], self.bits.shape[0]), np.float32 if fp32_out else np.uint16)
        tasks = min(self.bits.shape[0] // WEIGHT_ROWS, numba.get_num_threads() * _TASKS_PER_THREAD)
        for start in range(0, xb.shape[0], _ROW_CHUNK):
            _linear_kernel(xb[start:start + _ROW_CHUNK], self.bits, self.bias, out[start:start + _ROW_CHUNK], tasks)
        result = torch.from_numpy(out) if fp32_out else torch.from_numpy(out).view(torch.bfloat16)
        return result if out.shape[1] == self.out_features else result[:, : self.out_features]


# exp(x) for x <= 0 (Cephes' expf: x = n ln2 + r, a degree-7 polynomial in r, times 2^n): within 1 ulp of the C
# library's expf, and written so that LLVM vectorises it.
_LOG2E = np.float32(1.4426950408889634)
_LN2_HI, _LN2_LO = np.float32(0.693359375), np.float32(-2.12194440e-4)
_EXP_POLY = tuple(np.float32(c) for c in (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2,
                                          1.6666665459e-1, 5.0000001201e-1))
_EXP_FLOOR = np.float32(-87.0)  # below it exp underflows to (nearly) 0 and 2^n would leave the normal range
_ROWS_PER_TASK = 16  # query rows (tokens x heads of a KV group) per task of `_tree_attention_kernel`
_KEY_TILE = 4  # keys per step of the score loop (times two query rows: eight dot products at once, as in `linear`)


@njit(inline="always")
def _gather_widened(pool, kv, slots, out, dim):
    """out[j] = pool[kv, slots[j]] widened to fp32 (bits): a segment's keys or values, contiguous."""
    for j in range(slots.shape[0]):
        slot = slots[j]
        for d in range(dim):
            out[j, d] = _widen(pool[kv, slot, d])


@njit(inline="always")
def _scores(qf, kf, scores, dim):
    """scores[i, j] = qf[i] . kf[j] for every query row and key. Every score comes out of the same loop body
    (`_dot_2x4`: two rows x four keys, over head_dim); odd edges repeat their last row or key
    rather than running a different loop, so a score depends only on its two vectors."""
    rows, keys = qf.shape[0], kf.shape[0]
    for i in range(0, rows, 2):
        ia, ib = i, min(i + 1, rows - 1)
        qa, qb = qf[ia], qf[ib]
        for j in range(0, keys, _KEY_TILE):
            j0, j1, j2, j3 = j, min(j + 1, keys - 1), min(j + 2, keys - 1), min(j + 3, keys - 1)
            k0, k1, k2, k3 = kf[j0], kf[j1], kf[j2], kf[j3]
            a0, a1, a2, a3, b0, b1, b2, b3 = _dot_2x4(qa, qb, k0, k1, k2, k3, dim)
            scores[ia, j0], scores[ia, j1], scores[ia, j2], scores[ia, j3] = a0, a1, a2, a3
            scores[ib, j0], scores[ib, j1], scores[ib, j2], scores[ib, j3] = b0, b1, b2, b3


@njit(inline="always")
def _softmax_weights(weights, m, power_bits):
    """weights[:m] <- exp(weights[:m] - max) in place (Cephes' expf, above; 0 below `_EXP_FLOOR`); returns their sum.
    `power_bits`: uint32 scratch [>= m] for the 2^k factors."""
    p0, p1, p2, p3, p4, p5 = _EXP_POLY
    top = np.float32(-np.inf)
    for t in range(m):
        top = max(top, weights[t])
    for t in range(m):
        x = weights[t] - top
        clamped = max(x, _EXP_FLOOR)
        k = np.floor(clamped * _LOG2E + np.float32(0.5))
        r = clamped - k * _LN2_HI - k * _LN2_LO
        power_bits[t] = np.uint32(np.int32(k) + np.int32(127)) << np.uint32(23)  # the bits of 2^k
        poly = (((((p0 * r + p1) * r + p2) * r + p3) * r + p4) * r + p5) * (r * r) + r + np.float32(1.0)
        weights[t] = poly if x > _EXP_FLOOR else np.float32(0.0)
    powers = power_bits.view(np.float32)
    total = np.float32(0.0)
    for t in range(m):
        weights[t] *= powers[t]
        total += weights[t]
    return total


@functools.cache
def _tree_attention_kernel(head_dim: int):
    """The attention kernel compiled for one head_dim: a constant there, so the loops over it unroll."""

    @njit(parallel=True, fastmath=_FASTMATH, boundscheck=False, cache=True)
    def kernel(q, k_pool, v_pool, row_start, rows, ctx, key_start, key_slots, mask_start, mask,
               task_segment, task_kv, task_first, task_rows, group, scale, out):
        """softmax(q k^T * scale) v for every query row, over its visible keys only (module docstring). A task is
        a run of `task_rows` query rows from `task_first` of segment `task_segment`'s rows under the heads that
        share KV head `task_kv`, counted head-major (row g * n + i is token i under head task_kv * group + g).

        q [T, H, D], k_pool and v_pool [KV, slots, D], out [T, H * D]: all bf16 bits. Per segment s: its first
        packed row `row_start[s]`, `rows[s]` query rows, `ctx[s]` cached keys, its keys' flat slots
        `key_slots[key_start[s]:][:ctx + rows]`, and its [rows, rows] mask over its own new tokens at
        `mask[mask_start[s]:]` (uint8, row-major). Scores, softmax and the weighted sum run in fp32; `out` may be
        fp32."""
        dim = head_dim
        for task in prange(task_segment.shape[0]):
            s, kv, first, count = task_segment[task], task_kv[task], task_first[task], task_rows[task]
            n, c, r0 = rows[s], ctx[s], row_start[s]
            keys = c + n
            slots = key_slots[key_start[s]:key_start[s] + keys]
            q_bits = np.empty((count, dim), np.uint32)
            for row in range(count):
                g, i = divmod(first + row, n)
                for d in range(dim):
                    q_bits[row, d] = _widen(q[r0 + i, kv * group + g, d])
            kv_bits = np.empty((keys, dim), np.uint32)
            _gather_widened(k_pool, kv, slots, kv_bits, dim)
            scores = np.empty((count, keys), np.float32)
            _scores(q_bits.view(np.float32), kv_bits.view(np.float32), scores, dim)
            _gather_widened(v_pool, kv, slots, kv_bits, dim)  # the keys are done with: their buffer takes the values
            vf = kv_bits.view(np.float32)
            visible = np.arange(keys)
            weights = np.empty(keys, np.float32)
            power_bits = np.empty(keys, np.uint32)
            acc = np.empty(dim, np.float32)
            for row in range(count):
                g, i = divmod(first + row, n)
                # the keys this row sees, in slot order: its context, then its ancestors and itself. For a draft
                # token that is exactly the key list plain decoding of its path sees, so everything below, which
                # depends only on that list (its length fixes how the sums split into vector lanes), matches plain
                # decoding bitwise.
                m = c
                for j in range(n):
                    if mask[mask_start[s] + i * n + j]:
                        visible[m] = c + j
                        m += 1
                for t in range(m):
                    weights[t] = scores[row, visible[t]] * scale
                total = _softmax_weights(weights, m, power_bits)
                acc[:] = 0.0
                # four keys per pass over the accumulator (a pass loads and stores every lane); the last m % 4 keys
                # one at a time. How the sum groups depends only on m.
                for t in range(0, m - 3, 4):
                    p0, p1, p2, p3 = weights[t], weights[t + 1], weights[t + 2], weights[t + 3]
                    v0, v1, v2, v3 = vf[visible[t]], vf[visible[t + 1]], vf[visible[t + 2]], vf[visible[t + 3]]
                    for d in range(dim):
                        acc[d] = acc[d] + p0 * v0[d] + p1 * v1[d] + p2 * v2[d] + p3 * v3[d]
                for t in range(m - m % 4, m):
                    p, value = weights[t], vf[visible[t]]
                    for d in range(dim):
                        acc[d] += p * value[d]
                for d in range(dim):
                    acc[d] /= total
                h = kv * group + g
                for d in range(dim):
                    _store(out, r0 + i, h * dim + d, acc, d)

    return kernel


def tree_attention(q: Tensor, k_pool: np.ndarray, v_pool: np.ndarray, layout: "TreeAttentionLayout", *,
                   fp32_out: bool = False) -> Tensor:
    """Attention of packed bf16 queries q [T, H, D] over one layer's paged bf16 K/V (bits); [T, H * D] bf16
    (`fp32_out`: before the final rounding, for tests)."""
    T, H, D = q.shape
    out = np.empty((T, H * D), np.float32 if fp32_out else np.uint16)
    tasks = layout.tasks(k_pool.shape[0], H // k_pool.shape[0])
    _tree_attention_kernel(D)(bf16_bits(q.detach().contiguous()), k_pool, v_pool, layout.row_start, layout.rows,
                              layout.ctx, layout.key_start, layout.key_slots, layout.mask_start, layout.mask, *tasks,
                              H // k_pool.shape[0], np.float32(D ** -0.5), out)
    return torch.from_numpy(out) if fp32_out else torch.from_numpy(out).view(torch.bfloat16)


class TreeAttentionLayout:
    """Where each segment of a packed forward finds its rows, keys and mask (built once per forward, read by every
    layer's `tree_attention`). `segments`: (first packed row, context length, flat slots of its keys
    [ctx + rows], mask over its new tokens [rows, rows] bool)."""

    def __init__(self, segments: list[tuple[int, int, np.ndarray, np.ndarray]]):
        n = [m.shape[0] for _, _, _, m in segments]
        self.row_start = np.array([r for r, _, _, _ in segments], np.int64)
        self.rows = np.array(n, np.int64)
        self.ctx = np.array([c for _, c, _, _ in segments], np.int64)
        self.key_slots = np.concatenate([s.astype(np.int64) for _, _, s, _ in segments])
        self.key_start = np.concatenate([[0], np.cumsum([len(s) for _, _, s, _ in segments])[:-1]]).astype(np.int64)
        self.mask = np.concatenate([m.astype(np.uint8).reshape(-1) for _, _, _, m in segments])
        self.mask_start = np.concatenate([[0], np.cumsum([k * k for k in n])[:-1]]).astype(np.int64)
        if not np.array_equal(self.key_start + self.ctx + self.rows, np.cumsum([len(s) for _, _, s, _ in segments])):
            raise ValueError("each segment needs the flat slots of its context and its new tokens (ctx + rows keys)")
        self._tasks: dict[tuple[int, int], tuple[np.ndarray, ...]] = {}

    def tasks(self, kv_heads: int, group: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The kernel's tasks (segment, KV head, first row, rows), at most `_ROWS_PER_TASK` query rows each: a
        segment's keys are gathered once per task, and a long tree still splits across the cores."""
        if (kv_heads, group) not in self._tasks:
            rows = np.repeat(self.rows * group, kv_heads)  # per (segment, KV head), segment-major
            chunks = -(-rows // _ROWS_PER_TASK)
            pair = np.repeat(np.arange(len(rows)), chunks)
            part = np.arange(len(pair)) - np.repeat(np.cumsum(chunks) - chunks, chunks)  # chunk number in its pair
            first, end = part * rows[pair] // chunks[pair], (part + 1) * rows[pair] // chunks[pair]
            self._tasks[kv_heads, group] = (pair // kv_heads, pair % kv_heads, first, end - first)
        return self._tasks[kv_heads, group]
