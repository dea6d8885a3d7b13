"""The decoder's batch-invariant verify forward on the CPU kernels, over bf16 bits end to end.

`TorchEngine` runs its bf16 verify steps on the CPU here whenever they use the numba tree attention
(`cpu_kernels` "numba" or "attention"): `trt_engines.llama`'s forward with the same operators and the same bf16
roundings, but every operator is one numba call over uint16 views (`cpu_kernels.bf16_bits`), except the linear
layers where they stay PyTorch's ("attention"). What this adds is the glue between the kernels. On PyTorch that
glue (RMSNorm, RoPE, the KV writes, SwiGLU's activation, the residual adds, and the bf16 <-> fp32 conversions around
each) ran ~60 small PyTorch ops per layer; here it is four calls per layer besides the four linear layers and the
attention. On a 2-core AVX2 CPU with the numba linear layers (SmolLM2-135M, batch 1, context 512, `verify_cost.md`
at c7fd3fb and at 768bb92) a plain step went from 33.9 to 16.5 ms and an 8-node one from 56.8 to 36.6 ms. With the
numba linear layers, the loop over the layers is itself compiled (`_decoder_layers`): one call from Python per
forward instead of nine per layer, the same kernels in the same order, so the same bits. The Python it saves is a
fixed cost per layer: in `one_call.md` (2-core Zen 4 EPYC, paired rounds in one process; its run at 3591045 in
parentheses) a plain step's forward took 0.95x (0.93x) the loop's time, verify steps of 4, 8 and 16 nodes 0.94x,
0.94x and 0.96x (0.92x, 0.95x, 0.94x), and a 512-token prefill, which the kernels' arithmetic dominates, 0.99x
(1.00x).

Every operator works row by row (a row's result never depends on the rows beside it), so the forward stays
batch-invariant (`cpu_kernels` docstring). The roundings are PyTorch's: RMSNorm in fp32, rounded to bf16, then times
its bf16 weight and rounded again; RoPE in fp32 (x cos + rotate_half(x) sin, no fused multiply-add: bitwise
PyTorch's); SiLU in fp32, rounded, times the up projection, rounded; residual adds in fp32, rounded (bitwise). Two
computations differ from PyTorch's and may move a result by one bf16 step: RMSNorm's sum of squares (summed in
vector lanes) and SiLU's exp (Cephes' expf, which vectorises; on 786k random values it gave PyTorch's bits
everywhere). So a hidden state here may part from `Transformer.forward`'s by a bf16 step now and then
(`tests/test_cpu_forward.py`).
"""

from __future__ import annotations

import functools
from typing import Callable

import numba
import numpy as np
import torch
from numba import njit, prange, typed
from torch import Tensor

from trt_engines.cpu_kernels import (_CACHE, _EXP_CEIL, _EXP_FLOOR, _FASTMATH, LANES, Bf16Linear, TreeAttentionLayout,
                                     _exp_exponent, _exp_remainder, _round_bf16, _tree_attention_tasks, _widen,
                                     attention_reads_copies, bf16_bits, linear_bits, tree_attention_bits)
from trt_engines.llama import Linear, Transformer


@njit(inline="always")
def _widened_row(bits, t, out):
    """out (fp32 scratch [K]) <- row t of bf16 `bits` [T, K], widened."""
    wide = out.view(np.uint32)
    for k in range(bits.shape[1]):
        wide[k] = _widen(bits[t, k])


@njit(inline="always")
def _norm_row(h, weight, eps, normed, t, scratch):
    """normed[t] <- RMSNorm of the fp32 row `h` (bf16-exact values) times `weight` (fp32, bf16-exact): PyTorch's
    `RMSNorm.forward` (statistics in fp32, rounded to bf16, times the weight, rounded)."""
    dim = h.shape[0]
    squares = np.float32(0.0)
    for k in range(dim):
        squares += h[k] * h[k]
    scale = np.float32(1.0) / np.sqrt(squares / np.float32(dim) + eps)
    wide = scratch.view(np.uint32)
    for k in range(dim):
        scratch[k] = h[k] * scale
    for k in range(dim):
        wide[k] = _widen(_round_bf16(wide[k]))
    for k in range(dim):
        scratch[k] = weight[k] * scratch[k]
    for k in range(dim):
        normed[t, k] = _round_bf16(wide[k])


@njit(inline="always")
def _part(rows, parts, p):
    """Rows [start, stop) of part p when `rows` rows are cut into `parts` parts of near-equal size."""
    return p * rows // parts, (p + 1) * rows // parts


@njit(inline="always")
def _rms_norm_rows(x, weight, eps, normed, start, stop):
    h = np.empty(x.shape[1], np.float32)
    scratch = np.empty(x.shape[1], np.float32)
    for t in range(start, stop):
        _widened_row(x, t, h)
        _norm_row(h, weight, eps, normed, t, scratch)


@njit(parallel=True, fastmath=_FASTMATH, boundscheck=False, cache=_CACHE)
def rms_norm(x, weight, eps, normed, parts=1):
    """normed <- RMSNorm(x) * weight: bf16 bits [T, K], weight [K] fp32. `parts` > 1: the rows in that many parts
    across numba's threads (`row_parts`); each row is computed alike either way."""
    if parts == 1:
        _rms_norm_rows(x, weight, eps, normed, 0, x.shape[0])
    else:
        for p in prange(parts):
            start, stop = _part(x.shape[0], parts, p)
            _rms_norm_rows(x, weight, eps, normed, start, stop)


@njit(inline="always")
def _add_row(x, delta, t, h, d):
    """x[t] <- x[t] + delta[t] rounded to bf16 (the residual add), leaving its fp32 value in the scratch row `h`."""
    _widened_row(x, t, h)
    _widened_row(delta, t, d)
    for k in range(x.shape[1]):
        h[k] = h[k] + d[k]
    wide = h.view(np.uint32)
    for k in range(x.shape[1]):
        x[t, k] = _round_bf16(wide[k])
        wide[k] = _widen(x[t, k])


@njit(inline="always")
def _add_rms_norm_rows(x, delta, weight, eps, normed, start, stop):
    h = np.empty(x.shape[1], np.float32)
    d = np.empty(x.shape[1], np.float32)
    scratch = np.empty(x.shape[1], np.float32)
    for t in range(start, stop):
        _add_row(x, delta, t, h, d)
        _norm_row(h, weight, eps, normed, t, scratch)


@njit(parallel=True, fastmath=_FASTMATH, boundscheck=False, cache=_CACHE)
def add_rms_norm(x, delta, weight, eps, normed, parts=1):
    """x <- x + delta (the residual add, rounded to bf16), then normed <- RMSNorm(x) * weight: bf16 bits [T, K],
    weight [K] fp32; `parts` as in `rms_norm`."""
    if parts == 1:
        _add_rms_norm_rows(x, delta, weight, eps, normed, 0, x.shape[0])
    else:
        for p in prange(parts):
            start, stop = _part(x.shape[0], parts, p)
            _add_rms_norm_rows(x, delta, weight, eps, normed, start, stop)


@njit(boundscheck=False, cache=_CACHE)
def residual_add(x, delta):
    """x <- x + delta, rounded to bf16 (bits [T, K]): the last layer's add, which no norm follows."""
    h = np.empty(x.shape[1], np.float32)
    d = np.empty(x.shape[1], np.float32)
    for t in range(x.shape[0]):
        _add_row(x, delta, t, h, d)


@njit(inline="always")
def _rope_rows(qkv, cos, sin, n_heads, n_kv_heads, q, k_pool, v_pool, slots, start, stop):
    dim = q.shape[2]
    half = dim // 2
    heads = n_heads + n_kv_heads
    x = np.empty((heads, dim), np.float32)
    rotated = np.empty((heads, dim), np.float32)
    wide = x.view(np.uint32).reshape(heads * dim)
    out = rotated.view(np.uint32)
    for t in range(start, stop):
        for j in range(heads * dim):
            wide[j] = _widen(qkv[t, j])
        for head in range(heads):
            for d in range(half):
                # x cos + rotate_half(x) sin, rotate_half(x) = (-x2, x1): a + (-b) s is a - b s exactly
                rotated[head, d] = x[head, d] * cos[t, d] - x[head, d + half] * sin[t, d]
                rotated[head, d + half] = x[head, d + half] * cos[t, d + half] + x[head, d] * sin[t, d + half]
        for head in range(n_heads):
            for d in range(dim):
                q[t, head, d] = _round_bf16(out[head, d])
        for kv in range(n_kv_heads):
            for d in range(dim):
                k_pool[kv, slots[t], d] = _round_bf16(out[n_heads + kv, d])
            for d in range(dim):
                v_pool[kv, slots[t], d] = qkv[t, (heads + kv) * dim + d]


@njit(parallel=True, boundscheck=False, cache=_CACHE)
def rope_and_store(qkv, cos, sin, n_heads, n_kv_heads, q, k_pool, v_pool, slots, parts=1):
    """Split the fused q/k/v projection `qkv` [T, (H + 2 KV) D] (bf16 bits), rotate q and k (`llama.apply_rope`:
    fp32, x cos + rotate_half(x) sin, one rounding), write q [T, H, D] and each token's k and v into its flat slot
    `slots[t]` of the layer's pools [KV, slots, D]. No multiply-add is fused here (no fastmath): bitwise PyTorch's.
    `parts` as in `rms_norm`."""
    if parts == 1:
        _rope_rows(qkv, cos, sin, n_heads, n_kv_heads, q, k_pool, v_pool, slots, 0, qkv.shape[0])
    else:
        for p in prange(parts):
            start, stop = _part(qkv.shape[0], parts, p)
            _rope_rows(qkv, cos, sin, n_heads, n_kv_heads, q, k_pool, v_pool, slots, start, stop)


@njit(inline="always")
def _silu_rows(gate_up, out, start, stop):
    inner = out.shape[1]
    g = np.empty(inner, np.float32)
    u = np.empty(inner, np.float32)
    power = np.empty(inner, np.float32)
    e = np.empty(inner, np.float32)
    gw, uw, power_bits = g.view(np.uint32), u.view(np.uint32), power.view(np.uint32)
    for t in range(start, stop):
        for j in range(inner):
            gw[j] = _widen(gate_up[t, j])
            uw[j] = _widen(gate_up[t, inner + j])
        for j in range(inner):
            # 2^k as 2^(k - 1) * 2, so that k = 128 (y near the ceiling) stays finite
            y = min(max(-g[j], _EXP_FLOOR), _EXP_CEIL)
            k = _exp_exponent(y)
            power_bits[j] = np.uint32(np.int32(k) + np.int32(126)) << np.uint32(23)
            e[j] = _exp_remainder(y, k)
        for j in range(inner):
            exp = e[j] * power[j] * np.float32(2.0)
            exp = np.float32(np.inf) if -g[j] > _EXP_CEIL else exp
            g[j] = g[j] / (np.float32(1.0) + exp)
        for j in range(inner):
            gw[j] = _widen(_round_bf16(gw[j]))
        for j in range(inner):
            g[j] = g[j] * u[j]
        for j in range(inner):
            out[t, j] = _round_bf16(gw[j])


@njit(parallel=True, fastmath=_FASTMATH, boundscheck=False, error_model="numpy", cache=_CACHE)
def silu_and_mul(gate_up, out, parts=1):
    """out <- silu(gate) * up, gate and up the halves of `gate_up` [T, 2 I] (bf16 bits): SiLU in fp32,
    gate / (1 + exp(-gate)), rounded (PyTorch's bf16 `F.silu`), then the product rounded. exp is Cephes' expf (as in
    the attention's softmax) rather than the C library's, so that the loop vectorises (the C library's is a call per
    element). `parts` as in `rms_norm`."""
    if parts == 1:
        _silu_rows(gate_up, out, 0, gate_up.shape[0])
    else:
        for p in prange(parts):
            start, stop = _part(gate_up.shape[0], parts, p)
            _silu_rows(gate_up, out, start, stop)


# Elements (rows x row width) from which a row-wise kernel shares its rows out across numba's threads
# (`row_parts`). Fewer run on the calling thread: waking the pool costs a few microseconds, about 3k elements of
# SiLU (1.4 ns each on a 2-core AVX2 EPYC, where two threads took 0.61x the time of one at 20 rows x 1536 and
# 0.50-0.55x from 80 rows on) or more of the norms, which are cheaper per element.
PARALLEL_ELEMENTS = 16384


def row_parts(rows: int, width: int, threads: int) -> int:
    """How many parts the row-wise kernels (`rms_norm`, `add_rms_norm`, `rope_and_store`, `silu_and_mul`) cut
    `rows` rows of `width` elements into with `threads` numba threads: one below `PARALLEL_ELEMENTS`, else one
    per thread. A row comes out the same either way (`tests/test_cpu_forward.py`)."""
    return min(threads, rows) if rows * width >= PARALLEL_ELEMENTS else 1


@functools.cache
def _decoder_layers(head_dim: int):
    """The decoder layers of `FusedCpuDecoder.__call__` as one compiled function, for the numba linear layers (the
    attention kernel of `head_dim` is compiled in): the same kernel calls in the same order, so the same bits, with
    none of the Python between them (~20 us a layer: `Bf16Linear.bits`' own Python, the attention's wrapper, the
    dispatch of each call). It closes over constants only, so numba's cache keys on them (a closure over a compiled
    function pickles differently in every process, and each process would compile it afresh)."""
    copied = attention_reads_copies(head_dim)

    @njit(boundscheck=False, cache=_CACHE)
    def layers(x, normed, q, cos, sin, slots, attention_norms, ffn_norms, qkv_w, qkv_b, o_w, o_b, up_w, up_b, down_w,
               down_b, k_pools, v_pools, row_start, rows, ctx, key_start, key_slots, mask_start, mask, reach, one_run,
               task_segment, task_kv, task_first, task_rows, scale, eps, threads, norm_parts, rope_parts, silu_parts,
               n_kv_heads, intermediate):
        """x (the residual stream, bf16 bits [T, dim], updated in place) through every layer; per layer i its norms'
        weights, its four linear layers' packed weights and biases (`Bf16Linear`), its K/V pools, and the step's
        attention layout and tasks (`tree_attention_bits`)."""
        tokens, n_heads = q.shape[0], q.shape[1]
        rms_norm(x, attention_norms[0], eps, normed, norm_parts)
        for i in range(len(attention_norms)):
            rope_and_store(linear_bits(normed, qkv_w[i], qkv_b[i], threads), cos, sin, n_heads, n_kv_heads, q,
                           k_pools[i], v_pools[i], slots, rope_parts)
            attended = np.empty((tokens, n_heads * head_dim), np.uint16)
            _tree_attention_tasks(head_dim, copied, q, k_pools[i], v_pools[i], row_start, rows, ctx, key_start,
                                  key_slots, mask_start, mask, reach, one_run, task_segment, task_kv, task_first,
                                  task_rows, n_heads // n_kv_heads, scale, attended)
            add_rms_norm(x, linear_bits(attended, o_w[i], o_b[i], threads), ffn_norms[i], eps, normed, norm_parts)
            act = np.empty((tokens, intermediate), np.uint16)
            silu_and_mul(linear_bits(normed, up_w[i], up_b[i], threads), act, silu_parts)
            down = linear_bits(act, down_w[i], down_b[i], threads)
            if i + 1 < len(attention_norms):
                add_rms_norm(x, down, attention_norms[i + 1], eps, normed, norm_parts)
            else:
                residual_add(x, down)

    return layers


class FusedCpuDecoder:
    """`Transformer.forward` for batch-invariant bf16 verify steps on the CPU (module docstring). Built once per
    engine from a bf16 model; holds views of its weights. Linear layers run where the engine put them: `Bf16Linear`
    kernels on their bits (`cpu_kernels="numba"`), else the model's own `Linear` on a bf16 view of the bits
    (`"attention"`: PyTorch's, in their batch-invariant form). With `Bf16Linear` kernels whose outputs need no
    padding (every layer's out_features a multiple of LANES), the layers run as one compiled call
    (`_decoder_layers`) unless `one_call` is False (for comparisons: the same bits)."""

    def __init__(self, model: Transformer, *, one_call: bool = True):
        a = model.args
        if model.tok_embeddings.weight.dtype != torch.bfloat16:
            raise ValueError(f"FusedCpuDecoder runs bf16 models; this one is {model.tok_embeddings.weight.dtype}")
        if a.head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim; got {a.head_dim}")
        self.model = model
        self.n_heads, self.n_kv_heads, self.head_dim = a.n_heads, a.n_kv_heads, a.head_dim
        self.intermediate = a.intermediate_size
        self.eps = np.float32(a.norm_eps)
        self.embeddings = bf16_bits(model.tok_embeddings.weight.detach())
        self.layers = []
        kernels = []  # every layer's q/k/v, o, gate/up and down kernels, layer by layer
        for block in model.layers:
            linears = (block.attention.wqkv, block.attention.wo, block.feed_forward.w13, block.feed_forward.w2)
            self.layers.append((_widened(block.attention_norm.weight), _widened(block.ffn_norm.weight),
                                *(_on_bits(layer) for layer in linears)))
            kernels += [layer.kernel for layer in linears]
        self.one_call = one_call and all(isinstance(k, Bf16Linear) and k.out_features % LANES == 0 for k in kernels)
        if self.one_call:
            self._norms = tuple(typed.List(layer[j] for layer in self.layers) for j in (0, 1))
            # per kind (q/k/v, o, gate/up, down): every layer's packed weights, then every layer's biases
            self._weights = tuple(typed.List(k.packed for k in kernels[j::4]) for j in range(4))
            self._biases = tuple(typed.List(k.bias for k in kernels[j::4]) for j in range(4))
            self._pools: tuple = (None, None, None)  # (the engine's pool list, its K pools, its V pools)

    def __call__(self, tokens: Tensor, positions: Tensor, layout: TreeAttentionLayout,
                 pool_bits: list[tuple[np.ndarray, np.ndarray]], write_slots: np.ndarray) -> Tensor:
        """Hidden states [T, dim] bf16 (before the final norm) of the packed `tokens` at `positions`; each token's
        keys and values go to its flat slot `write_slots[t]` of every layer's pools (`pool_bits`: bf16 bits of
        `PagedKVCache.flat`), and `layout` says what each token attends to."""
        cos, sin = (table.numpy() for table in self.model.rope_tables(positions))
        x = self.embeddings[tokens.numpy()]  # a copy: the residual stream, updated in place
        T, H, D = x.shape[0], self.n_heads, self.head_dim
        normed = np.empty_like(x)
        q = np.empty((T, H, D), np.uint16)
        slots = np.ascontiguousarray(write_slots, dtype=np.int64)
        threads = numba.get_num_threads()  # once: each kernel call would ask (`Bf16Linear.bits`)
        norm_parts = row_parts(T, x.shape[1], threads)
        rope_parts = row_parts(T, (H + 2 * self.n_kv_heads) * D, threads)
        silu_parts = row_parts(T, self.intermediate, threads)
        if self.one_call:
            if self._pools[0] is not pool_bits:  # the engine's list, built once: its typed copies are kept
                self._pools = (pool_bits, typed.List(k for k, _ in pool_bits), typed.List(v for _, v in pool_bits))
            (qkv_w, o_w, up_w, down_w), (qkv_b, o_b, up_b, down_b) = self._weights, self._biases
            _decoder_layers(D)(x, normed, q, cos, sin, slots, *self._norms, qkv_w, qkv_b, o_w, o_b, up_w, up_b, down_w,
                               down_b, *self._pools[1:], layout.row_start, layout.rows, layout.ctx, layout.key_start,
                               layout.key_slots, layout.mask_start, layout.mask, layout.reach, layout.one_run,
                               *layout.tasks(self.n_kv_heads, H // self.n_kv_heads, threads), np.float32(D ** -0.5),
                               self.eps, threads, norm_parts, rope_parts, silu_parts, self.n_kv_heads,
                               self.intermediate)
            return torch.from_numpy(x).view(torch.bfloat16)
        rms_norm(x, self.layers[0][0], self.eps, normed, norm_parts)
        for i, (_, ffn_norm, wqkv, wo, w13, w2) in enumerate(self.layers):  # the attention norm ran with the add
            k_pool, v_pool = pool_bits[i]
            rope_and_store(wqkv(normed, threads), cos, sin, H, self.n_kv_heads, q, k_pool, v_pool, slots, rope_parts)
            attended = tree_attention_bits(q, k_pool, v_pool, layout, threads=threads)
            add_rms_norm(x, wo(attended, threads), ffn_norm, self.eps, normed, norm_parts)
            gate_up = w13(normed, threads)
            act = np.empty((T, self.intermediate), np.uint16)
            silu_and_mul(gate_up, act, silu_parts)
            down = w2(act, threads)
            if i + 1 < len(self.layers):
                add_rms_norm(x, down, self.layers[i + 1][0], self.eps, normed, norm_parts)
            else:
                residual_add(x, down)
        return torch.from_numpy(x).view(torch.bfloat16)


def _widened(weight: Tensor) -> np.ndarray:
    """A bf16 vector's values as fp32 (exact)."""
    return weight.detach().float().numpy().copy()


def _on_bits(layer: Linear) -> Callable[[np.ndarray, int], np.ndarray]:
    """A linear layer as (bf16 bits [T, K], numba's thread count) -> bits [T, N]: its `Bf16Linear` kernel, or the
    layer itself (PyTorch's threads: the count goes unused)."""
    if isinstance(layer.kernel, Bf16Linear):
        kernel = layer.kernel

        def on_kernel(x: np.ndarray, threads: int) -> np.ndarray:
            return kernel.bits(x, threads=threads)

        return on_kernel

    def apply(x: np.ndarray, threads: int) -> np.ndarray:
        y = layer(torch.from_numpy(x).view(torch.bfloat16))
        return bf16_bits(y.contiguous())  # `Linear.transposed` returns a transposed view

    return apply
