"""CPU kernels for bf16 models (numba): batch-invariant linear layers for processors without AMX, and
batch-invariant tree attention for every CPU (`TorchEngine(cpu_kernels=...)`: "numba" runs both, "attention", the
default where the CPU has AMX-BF16 (`auto_cpu_kernels`), runs the attention with PyTorch's linear layers).

Without AVX512-BF16 or AMX, PyTorch's bf16 matmuls on the CPU fall back to a slow path: on a 2-core AVX2 EPYC a
16-row bf16 linear layer ran at ~16 GFLOP/s (one of SmolLM2's MLP projections: 3.5 ms for 16 rows, 0.47 ms for 2),
and its batched attention matmuls likewise, so verifying a 15-node tree cost 6.6x a plain step. These kernels read
the bf16 weights (paired into uint32s, `Bf16Linear`) and KV cache as raw bits, widen them to fp32 in registers and
accumulate in fp32 (what bf16 GEMMs do). Their matrix products run on one register-blocked micro-kernel
(`_tile_products`, in LLVM IR: up to `TILE_ROWS` rows (6 on AVX2, 12 on AVX-512) times 2 x `VECTOR_FLOATS`
outputs, or one or two rows (three over fp32 values) times four or two times that, per pass over the shared
dimension, accumulators in registers; 8-float vectors on AVX2, 16 on AVX-512, the same bits either way), so a verify
step's extra rows cost compute at close to the FMA units' rate rather than loads and horizontal sums;
`verify_cost.md` has the step times. Where the CPU has AVX512-BF16, the linear layers' micro-kernel multiplies the
bf16 values as they are, two input features per instruction (VDPBF16PS: `BF16_DOT_PRODUCTS`), in the same order and
so with the same bits; 16 draft nodes then cost 0.79x and a prefill 0.63x (`bf16_dot.md`, 2-core Zen 4 EPYC).
`TorchEngine(cpu_kernels=...)` decides where they run.

Both are batch-invariant by construction, which is what lossless bf16 speculation needs (`torch_engine` docstring):

- `linear`: every output element is one chain of fused multiply-adds over the input features in order (then the
  bias, then one rounding), never split or reassociated, whatever rows are computed beside it or where a row sits.
- `tree_attention`: each query row attends over exactly the keys it may see (its context, its tree ancestors,
  itself), in slot order. A score is one dot product over head_dim whatever else is computed beside it; the softmax
  runs over the row's visible keys alone (masked keys are left out, and its sums split into vector lanes in a way
  that depends only on how many it sees); the weighted sum of values is one chain of fused multiply-adds in slot
  order, where a masked key's weight is exactly 0 and so adds exactly nothing. A draft token's visible keys are the
  ones plain decoding of its path sees (its ancestors are the tokens plain decoding saw, in the same order), so
  verified anywhere in a draft tree, on any branch, next to any other requests, it gets bitwise the result it gets
  in plain decoding. It runs without fast-math, its orders spelled out in LLVM IR (`_dot_products`,
  `_scaled_lane_sum`), so its bits are the same whether numba compiled it in this process or loaded it from its
  on-disk cache, and on AVX2 and AVX-512.

Shapes (packed tokens, `trt_engines.llama` vocabulary), all bf16 bits (uint16 views, `bf16_bits`): x [T, K];
weights [N, K]; the KV pool of a layer [kv_heads, slots, head_dim]; q [T, heads, head_dim]. Outputs are bf16 (fp32
on request, for tests).
"""

from __future__ import annotations

import functools
import mmap
import os
import platform

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import literally, njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload
from torch import Tensor

# The fused forward's elementwise kernels and RMSNorm (`cpu_forward`) let LLVM vectorise their sums (reassociation)
# and fuse multiply-adds (contraction): neither depends on the data or the batch, so they stay batch-invariant. The
# attention kernel takes neither: it spells out its orders (`_dot_products`), since under reassociation the copy
# of it numba caches on disk added its scores in another order than the copy its compiling process ran.
_FASTMATH = {"reassoc", "contract", "nsz"}


def _vector_floats() -> int:
    """fp32 lanes per vector the matrix-product micro-kernel works in: 16 (zmm) where PyTorch finds AVX-512, else 8
    (ymm). `RETROSPEC_CPU_VECTOR_FLOATS` (8 or 16) overrides it, for tests and comparisons. Bits do not depend on it:
    each output is the same chain of fused multiply-adds whatever vector it sits in."""
    chosen = os.environ.get("RETROSPEC_CPU_VECTOR_FLOATS")
    if chosen is not None:
        if chosen not in ("8", "16"):
            raise ValueError(f"RETROSPEC_CPU_VECTOR_FLOATS must be 8 or 16; got {chosen!r}")
        return int(chosen)
    return 16 if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else 8


VECTOR_FLOATS = _vector_floats()
# numba's on-disk cache is keyed by the CPU, not by module constants: an overridden width compiles afresh, uncached
_CACHE = "RETROSPEC_CPU_VECTOR_FLOATS" not in os.environ
LANES = 2 * VECTOR_FLOATS  # output features per packed weight tile: two vectors
# Input rows per micro-kernel pass: 2 x TILE_ROWS accumulators + 2 weights + 1 broadcast fit the vector registers
# (AVX2 16, AVX-512 32). A pass streams its weights from memory while its rows' FMAs run; the rows of a later pass
# meet cached weights and memory idles (`_times_tiles`): AVX-512's 32 registers hold 12 rows' accumulators, and 7 to
# 12 rows in one pass took 0.84-0.93x the time of 6-row passes plus a pass for the rest over the model's linear
# layers, 17 rows 0.91x (one-off A/B in one process, 2-core Zen 5 EPYC, the same bits).
TILE_ROWS = 12 if VECTOR_FLOATS == 16 else 6


def _bf16_dot_products() -> bool:
    """Whether the linear layers' micro-kernel multiplies with AVX512-BF16's VDPBF16PS (`Bf16Linear`): on 16-float
    vectors, where the CPU has it, unless `RETROSPEC_CPU_BF16_DOT=0` (for comparisons). One VDPBF16PS is, per fp32
    lane, two fused multiply-adds in a fixed order: the products of the high bf16 halves, then of the low ones (Intel's
    definition; on a Zen 4 EPYC its bits matched two `llvm.fma`s so ordered on 4800 random 576-term chains, a one-off
    check, and `tests/test_cpu_kernels.py` compares both widths' outputs). So with input feature k in the high half
    and k + 1 in the low one, each output is the chain of fused multiply-adds the fp32 path computes, bit for bit, at
    half the instructions and with no widening. It reads denormal inputs as 0 and flushes denormal results to 0
    (bf16 weights and activations of a trained model are not that small)."""
    chosen = os.environ.get("RETROSPEC_CPU_BF16_DOT")
    if chosen is not None and chosen not in ("0", "1"):
        raise ValueError(f"RETROSPEC_CPU_BF16_DOT must be 0 or 1; got {chosen!r}")
    flags = _cpu_flags()
    available = VECTOR_FLOATS == 16 and flags is not None and "avx512_bf16" in flags
    if chosen == "1" and not available:
        raise ValueError("RETROSPEC_CPU_BF16_DOT=1 needs AVX512-BF16 and 16-float vectors; this CPU or setting "
                         "has not got them")
    return available and chosen != "0"


_ROW_CHUNK = 64  # input rows per kernel call: a chunk of widened rows stays in L2 while every weight tile streams past
_TASKS_PER_THREAD = 4  # runs of weight tiles per thread and `_linear_kernel` call: balanced however they split
_PREFETCH_BYTES = 2048  # how far ahead of a multi-row pass (`_tile_products`) its weight streams are prefetched
# How many keys ahead the attention's micro-kernels prefetch the pool rows they read through the slots: the score
# blocks their keys' rows, the weighted sums their values' (a value row costs fewer cycles than a key row's block).
# A paged request's keys are 2 KB runs (a block of 16 tokens under one KV head) wherever the pool had room, and the
# hardware prefetcher starts over at every run: where a request's blocks lay at random over a 3 GB pool, a plain
# step at context 1500 took 1.3-1.5x (one request) to 1.8-1.9x (four) the time it took over blocks in a row. Prefetching
# 16 or 32 keys ahead made those steps 0.75-0.86x as long, and 4 or 16 nodes 0.87-0.93x, with blocks in a row
# within the noise (0.96-1.04x; one-off A/B in one process against 731d391's kernel, 2-core AVX2 EPYC, same bits).
_GATHER_AHEAD_KEYS = 32
_GATHER_AHEAD_VALUES = 64


def _checked_threads(threads: int) -> int:
    """A thread count passed in (`Bf16Linear.bits`, `tree_attention_bits`): 0 would split the work into no tasks
    and leave the output unwritten."""
    if threads < 1:
        raise ValueError(f"threads must be >= 1 (numba.get_num_threads()); got {threads}")
    return threads


_HUGE_PAGE = 2 << 20  # bytes of an x86-64 transparent huge page


def huge_page_array(shape: tuple[int, ...], dtype) -> np.ndarray:
    """A zeroed array in anonymous memory the kernel is asked to back with transparent huge pages (madvise
    MADV_HUGEPAGE, start aligned to 2 MB); np.zeros where the platform has no such advice or the array is under 2 MB.

    For the weight streams of `Bf16Linear`: in 4 KB pages, a stream crosses a page every 4 KB, and each crossing
    costs a TLB miss and a restart of the hardware prefetcher. One-off A/B over the default model's linear layers
    (2-core AVX2 EPYC, THP "madvise", 40 paired rounds, against a fresh copy in ordinary pages): one or two rows
    0.95-0.96x the time, four to six rows 0.97-0.99x, eight or more unchanged. In whole verify steps (one request,
    context ~400, 80 paired rounds) a plain step took 0.98x and a 4-node step 0.99x: a small gain, near the noise.
    Where THP is "never" the advice does nothing and the array is ordinary memory."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or not hasattr(mmap, "MAP_ANONYMOUS") or nbytes < _HUGE_PAGE:
        return np.zeros(shape, dtype)
    region = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(advice)
    except OSError:  # a kernel without THP refuses the advice: ordinary pages
        pass
    raw = np.frombuffer(region, np.uint8)  # holds the mapping alive as long as any view of it
    start = -raw.ctypes.data % _HUGE_PAGE
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def bf16_bits(t: Tensor) -> np.ndarray:
    """A uint16 numpy view (no copy) of a contiguous bf16 CPU tensor's bits."""
    if t.dtype != torch.bfloat16 or t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"expected a contiguous bf16 CPU tensor; got {t.dtype} on {t.device}")
    return t.view(torch.int16).numpy().view(np.uint16)


@functools.cache
def _cpu_info() -> dict[str, str] | None:
    """The first processor's fields in /proc/cpuinfo ("flags", "model name", "cpu family", ...; None where there is
    none: not Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return None
    fields: dict[str, str] = {}
    for line in text.split("\n\n", 1)[0].splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields[key.strip()] = value.strip()
    return fields


@functools.cache
def _cpu_flags() -> frozenset[str] | None:
    """This CPU's feature flags from /proc/cpuinfo (None where there is none: not Linux)."""
    info = _cpu_info()
    return None if info is None else frozenset(info.get("flags", "").split())


def _cpu_model() -> str | None:
    """The CPU's name with its family and model numbers, as lscpu shows them ("AMD EPYC, family 23 model 49"):
    a cloud VM's name alone can hide which generation it is, and results on two generations differ."""
    info = _cpu_info()
    if not info or "model name" not in info:
        return None
    numbers = (f", family {info['cpu family']} model {info['model']}"
               if "cpu family" in info and "model" in info else "")
    return info["model name"] + numbers


def cpu_has_native_bf16() -> bool:
    """Whether this CPU has bf16 dot-product instructions (AVX512-BF16 or AMX-BF16): PyTorch's bf16 matmuls run at
    full speed and keep a row's bits whatever the batch (`llama.Linear.transposed`) only on such CPUs."""
    flags = _cpu_flags()
    return True if flags is None else "avx512_bf16" in flags or "amx_bf16" in flags  # not Linux: assume so


def cpu_has_amx_bf16() -> bool:
    """Whether this CPU has AMX tiles for bf16 (Intel Xeons since Sapphire Rapids)."""
    flags = _cpu_flags()
    return flags is not None and "amx_bf16" in flags


def auto_cpu_kernels() -> str:
    """What `TorchEngine(cpu_kernels="auto")` runs bf16 verify steps on here: "attention" (numba attention, PyTorch's
    linear layers) where the CPU has AMX-BF16, else "numba" (numba kernels for the linear layers too).

    PyTorch's linear layers win only with AMX behind them, and only from a few rows on: on a 2-core Xeon with
    AMX-BF16 (`batch_invariance.md` at d63c9b7) a plain step took 22.1 ms with the numba kernels against 29.1 at
    batch 1, but 89.6 against 60.9 at batch 32. On a 2-core EPYC with AVX512-BF16 and no AMX (lscpu family 26, at
    b596c69) the numba kernels took 7.8 ms against 29.8 at batch 1 and 43.0 against 40.8 at batch 32, and 21.1
    against 38.0 for one request with 16 draft nodes; without bf16 instructions at all (AVX2) PyTorch's bf16 matmuls
    take a slow path and are not batch-invariant. One choice per engine, not per step: the two kernels round
    differently, and a token's logits must not depend on the step it is verified in. Where the flags cannot be read
    (not Linux) it keeps "attention", as before: the numba linear kernels were measured on x86_64 Linux only."""
    return "attention" if _cpu_flags() is None or cpu_has_amx_bf16() else "numba"


def cpu_description() -> str:
    """This CPU as CPU benchmarks quote it: architecture, cores, name, family and model (`_cpu_model`), PyTorch's
    vector ISA, its bf16 instructions (which decide where "auto" runs these kernels: `auto_cpu_kernels`) and whose
    linear layers "auto" runs there (on an AMX Xeon PyTorch's, though its VDPBF16PS would serve the numba ones too)."""
    bf16 = ("bf16 dot products and AMX" if cpu_has_amx_bf16() else "bf16 dot products, no AMX" if cpu_has_native_bf16()
            else "no bf16 dot-product instructions")
    if auto_cpu_kernels() == "attention":
        bf16 += "; PyTorch's linear layers"
    elif BF16_DOT_PRODUCTS:
        bf16 += "; numba linear layers on VDPBF16PS"
    model = _cpu_model()
    return (f"{platform.machine()} {os.cpu_count()} cores{f', {model}' if model else ''} "
            f"({torch.backends.cpu.get_cpu_capability()}, {bf16})")


@njit(inline="always")
def _widen(bits: np.uint16) -> np.uint32:
    """bf16 bits -> the bits of the same value in fp32 (its high half)."""
    return np.uint32(bits) << np.uint32(16)


@njit(inline="always")
def _round_bf16(bits: np.uint32) -> np.uint16:
    """fp32 bits -> bf16 bits, rounded to nearest even (torch's `.to(torch.bfloat16)` for finite values)."""
    return np.uint16((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


def _store_run(out, i, j, values, start, count):  # pragma: no cover - replaced by the overload inside numba
    """out[i, j:j + count] = values[start:start + count] (a contiguous fp32 scratch row): as bf16 bits when `out` is
    uint16, else as fp32. One loop over contiguous lanes, so it vectorises."""


@overload(_store_run, inline="always")
def _store_run_overload(out, i, j, values, start, count):
    if out.dtype == types.uint16:
        def store_bf16(out, i, j, values, start, count):
            bits = values.view(np.uint32)
            for c in range(count):
                out[i, j + c] = _round_bf16(bits[start + c])
        return store_bf16

    def store_fp32(out, i, j, values, start, count):
        for c in range(count):
            out[i, j + c] = values[start + c]
    return store_fp32


_F32xV = ir.VectorType(ir.FloatType(), VECTOR_FLOATS)
_I32xV = ir.VectorType(ir.IntType(32), VECTOR_FLOATS)
_I16xV = ir.VectorType(ir.IntType(16), VECTOR_FLOATS)
BF16_DOT_PRODUCTS = _bf16_dot_products()
if BF16_DOT_PRODUCTS:
    # VDPBF16PS goes in as inline assembly: llvmlite's IR has no bfloat type for LLVM's intrinsic to take, and numba
    # does not set up the assembler that parses inline assembly
    import llvmlite.binding

    llvmlite.binding.initialize_native_asmparser()


def _bf16_pair_products(builder, x_pairs, w_pairs, acc):
    """acc + the products of x_pairs and w_pairs (LLVM IR, vectors of bf16 pairs in uint32s), per fp32 lane: the high
    halves' product first, then the low halves' (VDPBF16PS, `_bf16_dot_products`)."""
    signature = ir.FunctionType(_F32xV, [_I32xV, _I32xV, _F32xV])
    return builder.asm(signature, "vdpbf16ps $2, $1, $0", "=v,v,v,0", [x_pairs, w_pairs, acc], side_effect=False)


def _widened_bits(builder, raw):
    """A vector of bf16 bits (LLVM IR, <n x i16>) as the fp32 values they hold (<n x float>): zero-extended and
    shifted into the high halves, exactly (`_widen`)."""
    lanes = raw.type.count
    wide = ir.VectorType(ir.IntType(32), lanes)
    shifted = builder.shl(builder.zext(raw, wide), ir.Constant(wide, [16] * lanes))
    return builder.bitcast(shifted, ir.VectorType(ir.FloatType(), lanes))


_MOST_UNROLLED = 12  # accumulators of the largest loop `_accumulating_loop` lets LLVM unroll


def _loop_without_unrolling(module):
    """Loop metadata (LLVM IR) that keeps LLVM from unrolling the loop whose back edge carries it."""
    flag = module.add_metadata([ir.MetaDataString(module, "llvm.loop.unroll.disable")])
    loop_id = ir.values.MDValue(module, [], name=str(len(module.metadata)))  # refers to itself: new, never shared
    loop_id.operands = (loop_id, flag)
    return loop_id


def _accumulating_loop(builder, name: str, vector_type, shape: tuple[int, int], step: int, end, body, *,
                       may_skip: bool = False, start=None):
    """Emits `for k in range(0, end, step)` (LLVM IR; k and end i64) over a grid of shape[0] x shape[1] accumulator
    vectors of `vector_type` that start at zero (or at `start`, a constant of that type): body(k, grid) emits one
    iteration and returns the updated grid, which the next iteration receives. Returns the grid after the loop,
    where the builder is left. The loop runs at least once, unless `may_skip` (then end <= 0 returns the start).
    The IR micro-kernels' one loop shape, so each writes only its body.

    A loop of more than `_MOST_UNROLLED` accumulators is not unrolled: LLVM unrolled 7- to 11-row passes of
    `_tile_products` three times over, and its copies spilled accumulators to the stack (9-33 moves of 64-byte
    vectors, AVX-512), so an 11-row pass took 1.4x a 12-row one, which was too long to be unrolled. Kept rolled, the
    7- to 12-row passes over the model's linear layers took 0.81-0.88x the time of 6-row passes plus a pass for the
    rest (one-off A/B in one process, 2-core Zen 5 EPYC, same bits)."""
    i64 = ir.IntType(64)
    initial = ir.Constant(vector_type, None) if start is None else start
    entry = builder.block
    loop = builder.append_basic_block(f"{name}.loop")
    done = builder.append_basic_block(f"{name}.done")
    if may_skip:
        builder.cbranch(builder.icmp_signed(">", end, ir.Constant(i64, 0)), loop, done)
    else:
        builder.branch(loop)
    builder.position_at_end(loop)
    k = builder.phi(i64)
    k.add_incoming(ir.Constant(i64, 0), entry)
    grid = [[builder.phi(vector_type) for _ in range(shape[1])] for _ in range(shape[0])]
    for phi in (p for row in grid for p in row):
        phi.add_incoming(initial, entry)
    updated = body(k, grid)
    next_k = builder.add(k, ir.Constant(i64, step))
    k.add_incoming(next_k, loop)
    for row, new_row in zip(grid, updated):
        for phi, value in zip(row, new_row):
            phi.add_incoming(value, loop)
    back_edge = builder.cbranch(builder.icmp_signed("<", next_k, end), loop, done)
    if shape[0] * shape[1] > _MOST_UNROLLED:
        back_edge.set_metadata("llvm.loop", _loop_without_unrolling(builder.module))
    builder.position_at_end(done)
    if not may_skip:
        return updated
    merged = [[builder.phi(vector_type) for _ in row] for row in updated]
    for row, new_row in zip(merged, updated):
        for phi, value in zip(row, new_row):
            phi.add_incoming(initial, entry)
            phi.add_incoming(value, loop)
    return merged


def _prefetcher(context, builder, dtype):
    """emit(pointer): a prefetch of the cache line at `pointer` (to an element of `dtype`) for reading, kept in every
    cache level (LLVM IR: llvm.prefetch, a hint that never faults)."""
    i32 = ir.IntType(32)
    function = cgutils.get_or_insert_function(builder.module, ir.FunctionType(
        ir.VoidType(), [context.get_data_type(dtype).as_pointer(), i32, i32, i32]), "llvm.prefetch.p0")
    read_keep_data = [ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)]

    def emit(pointer):
        builder.call(function, [pointer] + read_keep_data)

    return emit


def _tile_products(rows: int, tiles: int = 1):
    """An intrinsic `(b, b_row, b_col, b_row_step, b_col_step, xf, m0, k_dim, out, out_row, out_col, slots) -> None`:
    for r < rows, t < tiles, j < LANES, with tile t's weights at b_row + t * b_row_step, b_col + t * b_col_step,

        out[out_row + r, out_col + t * LANES + j] = sum over k < k_dim of
            xf[m0 + r, k] * b[b_row + t * b_row_step + k, b_col + t * b_col_step + j]

    with b a 2D array whose rows are contiguous, fp32 or bf16 bits paired into uint32s (widened here; the low halves
    hold a tile's first VECTOR_FLOATS columns, the high halves its second, and columns count uint32s), xf
    [M, >= k_dim] fp32, out 2D fp32 and k_dim >= 1 (the loop runs at least once). Written in LLVM IR because it is a
    register-blocked micro-kernel, which numba's arrays cannot express: the 2 x rows x tiles accumulators (vectors
    of VECTOR_FLOATS) stay in registers for the whole loop over k, and per k each tile's LANES values are loaded
    once (one vector), widened to fp32 (a shift for the low halves, a mask for the high ones) and fused into every
    row's accumulators. Each output is one chain of fused multiply-adds in k order (llvm.fma, never reassociated)
    starting from 0, so its bits depend only on its own row of xf and column of b, never on `rows`, `tiles` or what
    is computed beside it; a term whose xf value is 0 adds exactly nothing (for finite b). Several tiles per pass are
    for one or two rows, or three over fp32 b (`_tiles_per_pass`).

    With bf16 pairs (`BF16_DOT_PRODUCTS`: b [rows, 2, VECTOR_FLOATS] uint32, tile t's rows at b_row + t * b_row_step
    (b_col unused), and xf [M, >= k_dim] uint32, each element two input features side by side, the earlier in the
    high half), iteration k multiplies pair k: per lane one VDPBF16PS, the same two fused multiply-adds in feature
    order (`_bf16_dot_products`), so the same bits as over the widened values.

    `slots` is None, or, where b is bf16 bits as they are (uint16, unpaired: a layer's KV pool under one KV head),
    an int64 array naming b's rows: row b_row + ... + k above reads b[slots[b_row + ... + k]] (the values of a
    segment's keys, wherever the paged cache holds them), each vector widened in registers (the same values, so
    the same bits, as a widened copy gives), and each iteration prefetches the row `_GATHER_AHEAD_VALUES` ahead
    (the hardware prefetcher cannot follow the slots)."""

    def typer(typingctx, b, b_row, b_col, b_row_step, b_col_step, xf, m0, k_dim, out, out_row, out_col, slots):
        if not (isinstance(b, types.Array) and isinstance(xf, types.Array) and xf.ndim == 2
                and isinstance(out, types.Array) and out.ndim == 2 and out.dtype == types.float32):
            return None
        # bf16 pairs (VDPBF16PS): b [rows, 2, VECTOR_FLOATS] and xf [M, >= k_dim] uint32, both pairs of features
        pairs = b.ndim == 3 and b.dtype == types.uint32 and xf.dtype == types.uint32
        if not pairs and not (b.ndim == 2 and b.dtype in (types.uint32, types.float32, types.uint16)
                              and xf.dtype == types.float32):
            return None
        if pairs and not BF16_DOT_PRODUCTS:
            return None
        gathered = b.dtype == types.uint16  # bf16 rows through `slots`
        if gathered != (isinstance(slots, types.Array) and slots.ndim == 1 and slots.dtype == types.int64):
            return None
        bf16 = b.dtype == types.uint32 and not pairs  # a tile's two vectors of bf16 bits in the halves of one vector
        stored = _I32xV if bf16 else _F32xV

        def codegen(context, builder, signature, args):
            b_type, x_type, out_type = signature.args[0], signature.args[5], signature.args[8]
            b_view = context.make_array(b_type)(context, builder, args[0])
            x_view = context.make_array(x_type)(context, builder, args[5])
            out_view = context.make_array(out_type)(context, builder, args[8])
            b_row0, b_col0, b_row_step, b_col_step = args[1], args[2], args[3], args[4]
            m0_index, k_dim_value, out_row0, out_col0 = args[6], args[7], args[9], args[10]
            i64 = ir.IntType(64)

            def const(value):
                return ir.Constant(i64, value)

            def item(array_type, view, i, j):
                return cgutils.get_item_pointer(context, builder, array_type, view, [i, j], wraparound=False)

            x_rows = [item(x_type, x_view, builder.add(m0_index, const(r)), const(0)) for r in range(rows)]
            tile_rows = [builder.add(b_row0, builder.mul(b_row_step, const(t))) for t in range(tiles)]
            if gathered:
                slot_type = signature.args[11]
                slot_view = context.make_array(slot_type)(context, builder, args[11])
            tile_cols = [builder.add(b_col0, builder.mul(b_col_step, const(t))) for t in range(tiles)]
            fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_F32xV, [_F32xV] * 3),
                                                 f"llvm.fma.v{VECTOR_FLOATS}f32")
            # A pass over several rows consumes a weight stream several times slower than one row's does, so the
            # few iterations the CPU runs ahead of it cover a fraction of the memory latency the single row's
            # cover, and the hardware prefetcher alone falls behind: each iteration asks for the line
            # `_PREFETCH_BYTES` ahead (bf16 weights; a hint, which never faults past the array's end).
            prefetch = (_PREFETCH_BYTES // (2 * LANES) if bf16 else _PREFETCH_BYTES // (4 * LANES) if pairs
                        else 0) if rows > 1 else 0  # in iterations of k
            prefetch_line = _prefetcher(context, builder, b_type.dtype)
            vectors = 2 * tiles  # accumulator vectors per row: vector v is tile v // 2, half v % 2

            def broadcast(k, r):
                value = builder.load(builder.gep(x_rows[r], [k]), align=4)
                undefined = ir.Constant(_I32xV if pairs else _F32xV, ir.Undefined)
                lane0 = builder.insert_element(undefined, value, ir.Constant(ir.IntType(32), 0))
                return builder.shuffle_vector(lane0, undefined, ir.Constant(_I32xV, [0] * VECTOR_FLOATS))

            def pair_row(row, v):  # b[row, v, 0] (bf16 pairs)
                return cgutils.get_item_pointer(context, builder, b_type, b_view, [row, const(v), const(0)],
                                                wraparound=False)

            def multiply_add(x_value, b_value, acc):
                if pairs:
                    return _bf16_pair_products(builder, x_value, b_value, acc)
                return builder.call(fma, [x_value, b_value, acc])

            def weights(k, v, paired_loads):
                if pairs:  # tile v // 2's row k, its vector v % 2: bf16 pairs, multiplied as they are
                    pointer = pair_row(builder.add(tile_rows[v // 2], k), v % 2)
                    return builder.load(builder.bitcast(pointer, _I32xV.as_pointer()), align=4)
                if gathered:
                    slot = builder.load(cgutils.get_item_pointer(context, builder, slot_type, slot_view,
                                                                 [builder.add(tile_rows[v // 2], k)], wraparound=False))
                    pointer = item(b_type, b_view, slot, builder.add(tile_cols[v // 2], const(VECTOR_FLOATS * (v % 2))))
                    return _widened_bits(builder, builder.load(builder.bitcast(pointer, _I16xV.as_pointer()), align=2))
                if not bf16:
                    pointer = item(b_type, b_view, builder.add(tile_rows[v // 2], k),
                                   builder.add(tile_cols[v // 2], const(VECTOR_FLOATS * (v % 2))))
                    return builder.load(builder.bitcast(pointer, stored.as_pointer()), align=4)
                if v // 2 not in paired_loads:
                    pointer = item(b_type, b_view, builder.add(tile_rows[v // 2], k), tile_cols[v // 2])
                    paired_loads[v // 2] = builder.load(builder.bitcast(pointer, stored.as_pointer()), align=4)
                loaded = paired_loads[v // 2]
                if v % 2:
                    widened = builder.and_(loaded, ir.Constant(_I32xV, [0xFFFF0000] * VECTOR_FLOATS))
                else:
                    widened = builder.shl(loaded, ir.Constant(_I32xV, [16] * VECTOR_FLOATS))
                return builder.bitcast(widened, _F32xV)

            def iteration(k, acc):
                paired_loads = {}  # tile -> its row k, loaded once for both of its vectors (bf16)
                if prefetch and pairs:  # a row of a tile is two vectors: two cache lines at 16 floats
                    ahead = builder.add(k, const(prefetch))
                    for t in range(tiles):
                        for half in range(2):
                            prefetch_line(pair_row(builder.add(tile_rows[t], ahead), half))
                elif prefetch:
                    ahead = builder.add(k, const(prefetch))
                    for t in range(tiles):
                        ahead_of_tile = item(b_type, b_view, builder.add(tile_rows[t], ahead), tile_cols[t])
                        prefetch_line(ahead_of_tile)
                elif gathered:
                    ahead = builder.add(k, const(_GATHER_AHEAD_VALUES))
                    ahead = builder.select(builder.icmp_signed("<", ahead, k_dim_value), ahead,
                                           builder.sub(k_dim_value, const(1)))
                    for t in range(tiles):
                        slot = builder.load(cgutils.get_item_pointer(context, builder, slot_type, slot_view,
                                                                     [builder.add(tile_rows[t], ahead)],
                                                                     wraparound=False))
                        prefetch_line(item(b_type, b_view, slot, tile_cols[t]))
                # emitted in the order that keeps the fewest vectors live besides the accumulators (LLVM keeps it):
                # all the weights and one row's broadcast at a time, or all the broadcasts and one weight at a time
                updated = [[None] * vectors for _ in range(rows)]
                if vectors <= rows:
                    b_values = [weights(k, v, paired_loads) for v in range(vectors)]
                    for r in range(rows):
                        x_value = broadcast(k, r)
                        for v in range(vectors):
                            updated[r][v] = multiply_add(x_value, b_values[v], acc[r][v])
                else:
                    x_values = [broadcast(k, r) for r in range(rows)]
                    for v in range(vectors):
                        b_value = weights(k, v, paired_loads)
                        for r in range(rows):
                            updated[r][v] = multiply_add(x_values[r], b_value, acc[r][v])
                return updated

            updated = _accumulating_loop(builder, "tile_products", _F32xV, (rows, vectors), 1, k_dim_value,
                                         iteration)
            for r in range(rows):
                for v in range(vectors):
                    target = item(out_type, out_view, builder.add(out_row0, const(r)),
                                  builder.add(out_col0, const(VECTOR_FLOATS * v)))
                    builder.store(updated[r][v], builder.bitcast(target, _F32xV.as_pointer()), align=4)
            return context.get_dummy_value()

        return types.void(b, b_row, b_col, b_row_step, b_col_step, xf, m0, k_dim, out, out_row, out_col, slots), codegen

    typer.__name__ = f"_tile_products_{rows}x{tiles}"
    return intrinsic(typer)


(_products_1, _products_2, _products_3, _products_4, _products_5, _products_6, _products_7, _products_8, _products_9,
 _products_10, _products_11, _products_12) = (_tile_products(rows) for rows in range(1, 13))
assert TILE_ROWS <= 12  # the passes `_products` has
TILE_GROUP = 4  # tiles per call of `_times_tiles` from the linear kernel, and per single-row pass
_products_1x4 = _tile_products(1, 4)
_products_2x2 = _tile_products(2, 2)
_products_3x2 = _tile_products(3, 2)


SCORE_LANES = 8  # fp32 lanes of a score's partial sums: fixed, so scores have the same bits on AVX2 and AVX-512
_F32x8 = ir.VectorType(ir.FloatType(), SCORE_LANES)
_I16x8 = ir.VectorType(ir.IntType(16), SCORE_LANES)


def _lanes(builder, vector, picked: list[int]):
    """The vector of `vector`'s lanes `picked` (LLVM IR)."""
    undefined = ir.Constant(vector.type, ir.Undefined)
    return builder.shuffle_vector(vector, undefined, ir.Constant(ir.VectorType(ir.IntType(32), len(picked)), picked))


def _halving_sum(builder, vector, combine=None):
    """The sum of an 8-float vector's lanes in a fixed tree (LLVM IR): lanes 0-3 + 4-7, then 0-1 + 2-3, then 0 + 1.
    No fast-math flag, so this is the order computed. `combine(a, b)` in place of the addition (a max, say)."""
    combine = combine or builder.fadd
    four = combine(_lanes(builder, vector, [0, 1, 2, 3]), _lanes(builder, vector, [4, 5, 6, 7]))
    two = combine(_lanes(builder, four, [0, 1]), _lanes(builder, four, [2, 3]))
    first, second = (builder.extract_element(two, ir.Constant(ir.IntType(32), lane)) for lane in (0, 1))
    return combine(first, second)


def _paired_halving_sums(builder, pairs):
    """`_halving_sum` of each key's SCORE_LANES partial sums, for the SCORE_LANES keys held in pairs by four
    16-float vectors (key 2c in the low half of pairs[c], key 2c + 1 in its high half): one 8-float vector of the
    keys' sums in key order (LLVM IR). Each level adds, lane by lane, exactly the operands `_halving_sum` adds for a
    key (lanes m + m + 4, then m + m + 2, then 0 + 1), so each sum has its bits; the shuffles only regroup the
    keys' lanes, so that each level is one vector addition for all eight keys instead of one per key."""

    def regrouped(x, y, picked):
        return builder.shuffle_vector(x, y, ir.Constant(ir.VectorType(ir.IntType(32), len(picked)), picked))

    def level(x, y, width):  # the first half of each `width`-lane group of x then y, plus its second half
        first = [g + m for g in range(0, 4 * SCORE_LANES, width) for m in range(width // 2)]
        return builder.fadd(regrouped(x, y, first), regrouped(x, y, [t + width // 2 for t in first]))

    fours = [level(pairs[0], pairs[1], SCORE_LANES), level(pairs[2], pairs[3], SCORE_LANES)]  # 4 keys x 4 lanes
    twos = level(fours[0], fours[1], 4)  # 8 keys x 2 lanes
    return builder.fadd(regrouped(twos, twos, list(range(0, 16, 2))), regrouped(twos, twos, list(range(1, 16, 2))))


def _dot_products(rows: int, keys: int, paired: bool = False):
    """An intrinsic `(qf, i0, n_rows, kf, j0, n_keys, width, scores, slots) -> None`: for i = min(i0 + r, n_rows - 1),
    r < rows, and j = min(j0 + c, n_keys - 1), c < keys (odd edges repeat their last row or key),

        scores[i, j] = qf[i, :width] . kf[j, :width]

    qf, kf and scores 2D fp32 with contiguous rows, width a positive multiple of SCORE_LANES (columns past head_dim
    hold zeros). Or kf is bf16 bits (uint16: a layer's KV pool under one KV head, [slots, head_dim]) and `slots`
    (int64) says which of its rows key j is: scores[i, j] = qf[i] . kf[slots[j]], each key widened to fp32 in
    registers (the same values, so the same bits, as a widened copy gives), width then at most head_dim (its first
    two cache lines, the rows of keys `_GATHER_AHEAD_KEYS` ahead, are prefetched: the hardware prefetcher cannot
    follow the slots); `slots` is None for fp32 kf.

    In LLVM IR, like `_tile_products`, so that no fast-math flag is needed: each dot product is one vector of
    SCORE_LANES partial sums, each a chain of fused multiply-adds (llvm.fma) over every SCORE_LANES-th element in
    order, then halved twice and summed (lanes 0-3 + 4-7, then 0-1 + 2-3, then 0 + 1). Every order is spelled out,
    so no optimisation may change a bit, and a score's bits depend only on its two vectors, never on the block
    shape. Under `reassoc` (the attention kernel's flags before 57c7bf6) the kernel numba loaded from its on-disk
    cache added scores in another order than the copy its compiling process ran, so a process that found the cache
    decoded other bf16 texts than one that compiled the kernel
    (`test_a_process_that_compiles_the_kernels_and_one_that_loads_them_from_numbas_cache_agree`). The rows x keys
    accumulators stay in registers over the loop; per step the fewer of the rows' and keys' vectors are held and
    the others streamed past them (rows x keys + min(rows, keys) + 1 of AVX2's 16 vector registers).

    `paired` (blocks of SCORE_LANES keys; for 16-float vectors, AVX-512): two keys share each accumulator, key
    2c's SCORE_LANES partial sums in its low half and key 2c + 1's in its high half, against the row's vector in
    both halves, so one 16-lane fused multiply-add does the work of two 8-lane ones (the 8-lane loop ran AVX-512
    cores at half their FMA width: at 2048 keys and 17 new tokens the scores were 60% of a call), and a row's eight
    sums are reduced together (`_paired_halving_sums`) and stored as one vector at scores[i, j0:j0 + 8], so scores
    needs those columns even past n_keys (the repeated last key's sums land there). Each lane is the same chain as
    unpaired and each key's lanes are added in the same tree, so every score keeps its bits."""
    if paired and keys != SCORE_LANES:
        raise ValueError(f"paired dot products take blocks of {SCORE_LANES} keys; got {keys}")
    lanes = 2 * SCORE_LANES if paired else SCORE_LANES  # of an accumulator
    vector_type = ir.VectorType(ir.FloatType(), lanes)
    columns = keys // 2 if paired else keys  # accumulators per row

    def typer(typingctx, qf, i0, n_rows, kf, j0, n_keys, width, scores, slots):
        if not (all(isinstance(a, types.Array) and a.ndim == 2 and a.layout == "C" for a in (qf, kf, scores))
                and qf.dtype == scores.dtype == types.float32 and kf.dtype in (types.float32, types.uint16)):
            return None
        bits = kf.dtype == types.uint16
        if bits != (isinstance(slots, types.Array) and slots.ndim == 1 and slots.dtype == types.int64):
            return None  # bf16 keys come from a pool through their slots; fp32 keys are rows of their own

        def codegen(context, builder, signature, args):
            q_type, k_type, s_type = signature.args[0], signature.args[3], signature.args[7]
            i64 = ir.IntType(64)
            q_view = context.make_array(q_type)(context, builder, args[0])
            k_view = context.make_array(k_type)(context, builder, args[3])
            s_view = context.make_array(s_type)(context, builder, args[7])
            first_row, row_end, first_key, key_end, width = (
                context.cast(builder, args[n], signature.args[n], types.int64) for n in (1, 2, 4, 5, 6))

            def clamped(first, offset, end):
                index = builder.add(first, ir.Constant(i64, offset))
                return builder.select(builder.icmp_signed("<", index, end), index,
                                      builder.sub(end, ir.Constant(i64, 1)))

            def item(array_type, view, i, j):
                return cgutils.get_item_pointer(context, builder, array_type, view, [i, j], wraparound=False)

            row_index = [clamped(first_row, r, row_end) for r in range(rows)]
            key_index = [clamped(first_key, c, key_end) for c in range(keys)]
            q_rows = [item(q_type, q_view, i, ir.Constant(i64, 0)) for i in row_index]
            if bits:  # key j is row slots[j] of the pool
                slot_type = signature.args[8]
                slot_view = context.make_array(slot_type)(context, builder, args[8])
                key_rows = [builder.load(cgutils.get_item_pointer(context, builder, slot_type, slot_view, [j],
                                                                  wraparound=False)) for j in key_index]
            else:
                key_rows = key_index
            k_rows = [item(k_type, k_view, j, ir.Constant(i64, 0)) for j in key_rows]
            if bits:
                prefetch_line = _prefetcher(context, builder, k_type.dtype)
                for c in range(keys):
                    ahead = clamped(first_key, c + _GATHER_AHEAD_KEYS, key_end)
                    slot = builder.load(cgutils.get_item_pointer(context, builder, slot_type, slot_view, [ahead],
                                                                 wraparound=False))
                    row = item(k_type, k_view, slot, ir.Constant(i64, 0))
                    for line in range(2):  # 64-byte lines of bf16 values
                        prefetch_line(builder.gep(row, [ir.Constant(i64, 32 * line)]))
            fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vector_type, [vector_type] * 3),
                                                 f"llvm.fma.v{lanes}f32")
            both_halves = list(range(SCORE_LANES)) * 2
            concatenated = list(range(2 * SCORE_LANES))

            def iteration(k, acc):
                def load(pointer):
                    return builder.load(builder.bitcast(builder.gep(pointer, [k]), _F32x8.as_pointer()), align=4)

                def load_key(pointer):
                    if not bits:
                        return load(pointer)
                    return builder.load(builder.bitcast(builder.gep(pointer, [k]), _I16x8.as_pointer()), align=2)

                def load_row(pointer):  # in both halves where keys are paired
                    value = load(pointer)
                    if not paired:
                        return value
                    return builder.shuffle_vector(value, value, ir.Constant(ir.VectorType(ir.IntType(32), lanes),
                                                                            both_halves))

                def load_column(c):  # key c's vector, or keys 2c and 2c + 1 side by side
                    if not paired:
                        value = load_key(k_rows[c])
                    else:
                        low, high = load_key(k_rows[2 * c]), load_key(k_rows[2 * c + 1])
                        value = builder.shuffle_vector(low, high, ir.Constant(
                            ir.VectorType(ir.IntType(32), lanes), concatenated))
                    return _widened_bits(builder, value) if bits else value

                updated = [[None] * columns for _ in range(rows)]
                if columns <= rows:  # the keys' vectors held, each row's streamed past them
                    k_values = [load_column(c) for c in range(columns)]
                    for r, q_row in enumerate(q_rows):
                        q_value = load_row(q_row)
                        for c, k_value in enumerate(k_values):
                            updated[r][c] = builder.call(fma, [q_value, k_value, acc[r][c]])
                else:  # the rows' vectors held, each key's streamed past them
                    q_values = [load_row(p) for p in q_rows]
                    for c in range(columns):
                        k_value = load_column(c)
                        for r, q_value in enumerate(q_values):
                            updated[r][c] = builder.call(fma, [q_value, k_value, acc[r][c]])
                return updated

            updated = _accumulating_loop(builder, "dot_products", vector_type, (rows, columns), SCORE_LANES, width,
                                         iteration)
            for r, i in enumerate(row_index):
                if paired:  # the block's scores of this row side by side, in one vector from j0 on
                    target = item(s_type, s_view, i, first_key)
                    builder.store(_paired_halving_sums(builder, updated[r]), builder.bitcast(
                        target, _F32x8.as_pointer()), align=4)
                    continue
                for c, j in enumerate(key_index):
                    builder.store(_halving_sum(builder, updated[r][c]), item(s_type, s_view, i, j))
            return context.get_dummy_value()

        return types.void(qf, i0, n_rows, kf, j0, n_keys, width, scores, slots), codegen

    typer.__name__ = f"_dot_products_{rows}x{keys}{'_paired' if paired else ''}"
    return intrinsic(typer)


_dot_products_4x3 = _dot_products(4, 3)  # the score loop's block (`_scores`) ...
_dot_products_3x4 = _dot_products(3, 4)  # ... and its last rows': three (a plain step's task: 3 heads a KV head) ...
_dot_products_2x4 = _dot_products(2, 4)  # ... or one or two
# With 16-float vectors, keys in pairs (`_dot_products(paired=True)`): the same blocks in keys' terms, twice the keys
_PAIRED_SCORES = VECTOR_FLOATS == 2 * SCORE_LANES
_dot_products_6x8p = _dot_products(6, SCORE_LANES, paired=True)
_dot_products_4x8p = _dot_products(4, SCORE_LANES, paired=True)
_dot_products_3x8p = _dot_products(3, SCORE_LANES, paired=True)
_dot_products_2x8p = _dot_products(2, SCORE_LANES, paired=True)


def _tiles_per_pass(b, rows, from_memory):  # pragma: no cover - replaced by the overload inside numba
    raise NotImplementedError


@overload(_tiles_per_pass, inline="always")
def _tiles_per_pass_overload(b, rows, from_memory):
    """Tiles a pass of `rows` rows of xf takes at once over weights b: enough independent chains (2 x rows x tiles, at
    most the 12 accumulators) to cover a fused multiply-add's latency (8 chains on AVX2 cores: two units, four
    cycles). Three rows over paired weights (uint32, `Bf16Linear`) take one tile: two would need a 17th register
    (AVX2 has 16) for the zero vector that splits each weight vector's halves, and with the spills three rows took
    1.11-1.19x the unpaired 3 x 2 pass's time over the model's linear layers; with one tile, 0.98-1.11x (four
    paired A/B runs, AVX2 EPYC: this host's noise). A paired 3 x 2 pass that fits the 16 registers by broadcasting
    each row's value afresh at every use (an asm block apiece, which LLVM cannot merge; no spills in its loop) was no
    faster: over the model's linear layers three rows took 0.979-1.015x four rows' time with it, 0.985-0.998x with
    one tile (three fresh-process pairs of 20 interleaved rounds, the same bits; a one-off at 5cb0ed2, 2-core Zen 2
    EPYC, `benchmarks/results/zen2_oneoffs.txt`). There the weight stream, not the chains' latency, sets a
    three-row pass's time.

    Over bf16 pairs (VDPBF16PS: a 3D b), two or three rows that stream their weights from memory (`from_memory`: all
    of a call's rows, not the rest after full groups of TILE_ROWS, whose tiles come from cache) take one tile a pass
    too. There the stream, not the chains, sets the time: with two tiles a pass, two and three rows took longer over
    the model's linear layers than four (`linear_rows.md` at 6b737dc: 12.3 and 12.8 ms against 11.9). One tile took
    0.82-0.94x the time for two and three rows; as the rest after 12 rows (14 and 15 rows), from cache, where the
    chains set the time, 1.02-1.05x, so that rest keeps two (one-off A/Bs in one process, four runs of 30-40
    interleaved rounds, 2-core Zen 4 EPYC, the same bits)."""
    three_rows_tiles = 1 if b.dtype == types.uint32 and b.ndim == 2 else 2  # bf16 pairs need no zero vector
    pairs = b.ndim == 3

    def tiles_per_pass(b, rows, from_memory):
        if rows == 1:
            return 4
        if pairs and from_memory:
            return 1
        if rows == 2:
            return 2
        if rows == 3:
            return three_rows_tiles
        return 1

    return tiles_per_pass


@njit(inline="always")
def _products(b, b_row, b_col, b_row_step, b_col_step, xf, m0, k_dim, out, out_col, rows, tiles, slots):
    """`_tile_products(rows, tiles)` over rows m0.. of xf into the same rows of out, for the (rows, tiles) pairs
    `_times_tiles` uses (numba needs each instance named)."""
    if tiles == 4:
        _products_1x4(b, b_row, b_col, b_row_step, b_col_step, xf, m0, k_dim, out, m0, out_col, slots)
    elif tiles == 2:
        if rows == 3:
            _products_3x2(b, b_row, b_col, b_row_step, b_col_step, xf, m0, k_dim, out, m0, out_col, slots)
        else:
            _products_2x2(b, b_row, b_col, b_row_step, b_col_step, xf, m0, k_dim, out, m0, out_col, slots)
    elif TILE_ROWS > 6 and rows > 6:  # AVX-512's passes (folded away where TILE_ROWS is 6)
        if rows == 12:
            _products_12(b, b_row, b_col, 0, 0, xf, m0, k_dim, out, m0, out_col, slots)
        elif rows == 11:
            _products_11(b, b_row, b_col, 0, 0, xf, m0, k_dim, out, m0, out_col, slots)
        elif rows == 10:
            _products_10(b, b_row, b_col, 0, 0, xf, m0, k_dim, out, m0, out_col, slots)
        elif rows == 9:
            _products_9(b, b_row, b_col, 0, 0, xf, m0, k_dim, out, m0, out_col, slots)
        elif rows == 8:
            _products_8(b, b_row, b_col, 0, 0, xf, m0, k_dim, out, m0, out_col, slots)
        else:
            _products_7(b, b_row, b_col, 0, 0, xf, m0, k_dim, out, m0, out_col, slots)
    elif rows == 6:
        _products_6(b, b_row, b_col, 0, 0, xf, m0, k_dim, out, m0, out_col, slots)
    elif rows == 5:
        _products_5(b, b_row, b_col, 0, 0, xf, m0, k_dim, out, m0, out_col, slots)
    elif rows == 4:
        _products_4(b, b_row, b_col, 0, 0, xf, m0, k_dim, out, m0, out_col, slots)
    elif rows == 3:
        _products_3(b, b_row, b_col, 0, 0, xf, m0, k_dim, out, m0, out_col, slots)
    elif rows == 2:
        _products_2(b, b_row, b_col, 0, 0, xf, m0, k_dim, out, m0, out_col, slots)
    else:
        _products_1(b, b_row, b_col, 0, 0, xf, m0, k_dim, out, m0, out_col, slots)


@njit(inline="always")
def _times_tiles(xf, b, b_row, b_col, b_row_step, b_col_step, tiles, k_dim, out, out_col, slots):
    """For t < tiles: out[:, out_col + t * LANES:][:, :LANES] = xf[:, :k_dim] @ (tile t of b: k_dim rows from
    b_row + t * b_row_step, LANES columns from b_col + t * b_col_step), for every row of xf.

    Up to TILE_ROWS rows go in one pass per tile, or per two or four tiles where they are one or two rows, or three
    over fp32 b (`_tiles_per_pass`: fewer chains would leave the FMA units waiting on each one's latency, and
    several weight streams at once also read memory faster; over bf16 pairs, two or three rows that read the
    weights from memory take one tile a pass). More rows go TILE_ROWS at a time, each tile meeting
    every group in turn: the first reads it from memory, the rest from L1; then the remaining rows go over the tiles
    as a group of their own, as many tiles per pass as that many rows take alone (from L2). One tile per pass for
    them made a seventh row cost 5.4 ms over the model's linear layers, about three rows' arithmetic: a lone row's
    pass is two FMA chains, latency-bound (`linear_rows.md` at 6810b85). (Splitting rows evenly, 9 as 5 + 4, was
    5-10% slower than 6 + 3 in a one-off A/B at 03d16e1, AVX2.) Every output is the same chain whichever pass
    computes it, so TILE_ROWS (6 on AVX2, 12 on AVX-512) changes no bit."""
    rows = xf.shape[0]
    if rows <= TILE_ROWS:
        _rows_times_tiles(xf, b, b_row, b_col, b_row_step, b_col_step, tiles, k_dim, out, out_col, 0, rows, True,
                          slots)
        return
    full = rows - rows % TILE_ROWS
    for t in range(tiles):
        for m0 in range(0, full, TILE_ROWS):
            _products(b, b_row + t * b_row_step, b_col + t * b_col_step, 0, 0, xf, m0, k_dim, out,
                      out_col + t * LANES, TILE_ROWS, 1, slots)
    if full < rows:  # the rest as a group of its own (one or two rows, or three over fp32: several tiles a pass)
        _rows_times_tiles(xf, b, b_row, b_col, b_row_step, b_col_step, tiles, k_dim, out, out_col, full, rows - full,
                          False, slots)


@njit(inline="always")
def _rows_times_tiles(xf, b, b_row, b_col, b_row_step, b_col_step, tiles, k_dim, out, out_col, m0, rows, from_memory,
                      slots):
    """`_times_tiles` for rows m0 .. m0 + rows - 1 (at most TILE_ROWS), `_tiles_per_pass` tiles per pass
    (`from_memory`: these rows are the call's first to read the tiles)."""
    per_pass = _tiles_per_pass(b, rows, from_memory)
    t = 0
    while t < tiles:
        take = per_pass if t + per_pass <= tiles else 1
        _products(b, b_row + t * b_row_step, b_col + t * b_col_step, b_row_step, b_col_step, xf, m0, k_dim,
                  out, out_col + t * LANES, rows, take, slots)
        t += take


def _kernel_rows(x, packed):  # pragma: no cover - replaced by the overload inside numba
    """x [M, K] bf16 bits as the micro-kernel reads them over `packed`: widened to fp32 [M, K], or, over bf16 pairs
    (a 3D `packed`, `BF16_DOT_PRODUCTS`), as pairs [M, ceil(K / 2)] uint32 (feature 2p in the high half, 2p + 1 in
    the low one, a 0 after an odd K's last)."""


@overload(_kernel_rows, inline="always")
def _kernel_rows_overload(x, packed):
    if packed.ndim == 3:
        def pairs(x, packed):
            rows, k_dim = x.shape
            xp = np.zeros((rows, (k_dim + 1) // 2), np.uint32)
            for m in range(rows):
                for k in range(k_dim):
                    xp[m, k // 2] |= np.uint32(x[m, k]) << np.uint32(16 * (1 - k % 2))
            return xp
        return pairs

    def widened(x, packed):
        rows, k_dim = x.shape
        xw = np.empty((rows, k_dim), np.uint32)
        for m in range(rows):
            for k in range(k_dim):
                xw[m, k] = _widen(x[m, k])
        return xw.view(np.float32)
    return widened


@njit(parallel=True, boundscheck=False, cache=_CACHE)
def _linear_kernel(x: np.ndarray, packed: np.ndarray, bias: np.ndarray, out: np.ndarray, tasks: int) -> None:
    """out = x w^T + bias, accumulated in fp32: x [M, K] bf16 bits, packed [N / LANES * K, VECTOR_FLOATS] uint32 the
    weight's bf16 bits in tiles of K rows, paired (`Bf16Linear`), bias [N] fp32, out [M, N] bf16 bits (or fp32).
    `tasks` runs of consecutive tiles share the threads; they go TILE_GROUP tiles at a time through `_times_tiles`,
    where each tile's LANES x K weights are read from memory once and from cache by the later row groups.

    Every output is one fused multiply-add chain over K in order, then + bias, then one rounding: the same bits
    whatever M is, where its row sits and which group it falls in (what makes rows batch-invariant). One row
    streams the weights at memory speed; from about five rows on, the rows' FMAs set the time and the streaming
    hides behind them (`benchmarks/results/linear_rows.md`). With `BF16_DOT_PRODUCTS`, packed is [N / LANES *
    ceil(K / 2), 2, VECTOR_FLOATS]: the same tiles in pairs of input features, multiplied by VDPBF16PS, the same bits.
    """
    rows = x.shape[0]
    xf = _kernel_rows(x, packed)
    k_dim = xf.shape[1]  # iterations of the micro-kernel: features, or pairs of them
    tiles = packed.shape[0] // k_dim
    for task in prange(tasks):
        acc = np.empty((rows, TILE_GROUP * LANES), np.float32)
        end = (task + 1) * tiles // tasks
        for first in range(task * tiles // tasks, end, TILE_GROUP):
            group = min(TILE_GROUP, end - first)
            _times_tiles(xf, packed, first * k_dim, 0, k_dim, 0, group, k_dim, acc, 0, None)
            for t in range(group):
                n0 = (first + t) * LANES
                for m in range(rows):
                    for j in range(LANES):
                        acc[m, t * LANES + j] += bias[n0 + j]
                    _store_run(out, m, n0, acc[m], t * LANES, LANES)


@njit(boundscheck=False, cache=_CACHE)
def _linear_rows(x: np.ndarray, packed: np.ndarray, bias: np.ndarray, out: np.ndarray, threads: int) -> None:
    """out = x w^T + bias (`_linear_kernel`) for `threads` numba threads, `_ROW_CHUNK` rows of x per call."""
    tasks = min(bias.shape[0] // LANES, threads * _TASKS_PER_THREAD)
    for start in range(0, x.shape[0], _ROW_CHUNK):
        _linear_kernel(x[start:start + _ROW_CHUNK], packed, bias, out[start:start + _ROW_CHUNK], tasks)


@njit(boundscheck=False, cache=_CACHE)
def linear_bits(x: np.ndarray, packed: np.ndarray, bias: np.ndarray, threads: int) -> np.ndarray:
    """`Bf16Linear.bits` from compiled code (`cpu_forward.FusedCpuDecoder` drives a whole forward from one numba
    call): x [T, K] bf16 bits times a layer's `packed` weight plus its `bias` -> [T, N] bf16 bits, N padded to whole
    tiles."""
    out = np.empty((x.shape[0], bias.shape[0]), np.uint16)
    _linear_rows(x, packed, bias, out, threads)
    return out


class Bf16Linear:
    """A bf16 weight [N, K] (and optional bias) applied with `_linear_kernel`; `__call__(x [T, K] bf16) -> [T, N]
    bf16`. Holds the weight's bits repacked into tiles of LANES output features, feature-major within a tile, so a
    tile is one contiguous stream (a copy: N * K * 2 bytes, N padded with zeros to a multiple of LANES). Within a
    tile's row the two vectors' bf16 values are paired into uint32s, so the micro-kernel widens a whole row with one
    load, one shift (the low halves) and one mask (the high halves) rather than a zero-extension and a shift per
    vector. The fp32 values are the same, so the bits are; over the model's linear layers on a 2-core AVX2 EPYC
    (paired A/B against the unpaired layout of 14efb41, 20 rounds) five to twelve rows took 0.90-0.98x the time and
    64 rows 0.91x, while one to four rows, which wait on memory, stayed within the noise (0.97-1.03x)."""

    def __init__(self, weight: Tensor, bias: Tensor | None = None):
        if weight.ndim != 2 or weight.shape[1] < 1:
            raise ValueError("Bf16Linear needs a weight [out_features, in_features >= 1]; "
                             f"got shape {tuple(weight.shape)}")
        self.out_features, self.in_features = weight.shape
        bits = bf16_bits(weight.detach())
        pad = -self.out_features % LANES
        if pad:
            bits = np.concatenate([bits, np.zeros((pad, self.in_features), np.uint16)])
        tiles = bits.shape[0] // LANES
        # [tiles * K, LANES] bf16: row t * K + k holds input feature k of tile t's LANES output features ...
        features = np.ascontiguousarray(bits.reshape(tiles, LANES, self.in_features).transpose(0, 2, 1))
        if BF16_DOT_PRODUCTS:
            # ... in pairs of input features: uint32 j of vector v of row t * ceil(K / 2) + p holds output feature
            # v * VECTOR_FLOATS + j's weights for input features 2p (high half) and 2p + 1 (low half, 0 past K)
            if self.in_features % 2:
                features = np.concatenate([features, np.zeros((tiles, 1, LANES), np.uint16)], axis=1)
            high, low = features[:, 0::2].astype(np.uint32), features[:, 1::2].astype(np.uint32)
            self.packed = huge_page_array((high.shape[0] * high.shape[1], 2, VECTOR_FLOATS), np.uint32)
            self.packed[...] = ((high << np.uint32(16)) | low).reshape(-1, 2, VECTOR_FLOATS)
        else:
            # ... paired: uint32 j of a row holds feature j in its low half and feature j + VECTOR_FLOATS in its high
            first = features[..., :VECTOR_FLOATS].astype(np.uint32)
            second = features[..., VECTOR_FLOATS:].astype(np.uint32)
            self.packed = huge_page_array((tiles * self.in_features, VECTOR_FLOATS), np.uint32)  # streamed every call
            self.packed[...] = (first | (second << np.uint32(16))).reshape(-1, VECTOR_FLOATS)
        self.bias = np.zeros(bits.shape[0], np.float32)
        if bias is not None:
            self.bias[: self.out_features] = bias.detach().float().numpy()

    def __call__(self, x: Tensor, *, fp32_out: bool = False) -> Tensor:
        """x [T, K] bf16 -> [T, N] bf16 (`fp32_out`: the fp32 accumulations before rounding, for tests)."""
        if x.dtype != torch.bfloat16:
            raise TypeError(f"Bf16Linear takes bf16 inputs; got {x.dtype}")
        if x.ndim != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"Bf16Linear expects x [T, {self.in_features}]; got shape {tuple(x.shape)}")
        out = self.bits(bf16_bits(x.detach().contiguous()), fp32_out=fp32_out)
        return torch.from_numpy(out) if fp32_out else torch.from_numpy(out).view(torch.bfloat16)

    def bits(self, xb: np.ndarray, *, fp32_out: bool = False, threads: int | None = None) -> np.ndarray:
        """`__call__` on bf16 bits: xb [T, K] uint16 -> [T, N] uint16 (a view when N is padded). `threads`: numba's
        thread count where the caller has it already (`FusedCpuDecoder` asks once per forward for its 120 layers:
        `numba.get_num_threads` takes a lock: ~1.5 us a call, one-off on a 2-core AVX2 EPYC)."""
        out = np.empty((xb.shape[0], self.bias.shape[0]), np.float32 if fp32_out else np.uint16)
        threads = numba.get_num_threads() if threads is None else _checked_threads(threads)
        _linear_rows(xb, self.packed, self.bias, out, threads)
        return out if out.shape[1] == self.out_features else out[:, : self.out_features]


# exp(x) for x <= 0 (Cephes' expf: x = n ln2 + r, a degree-7 polynomial in r, times 2^n): within 1 ulp of the C
# library's expf, and written so that LLVM vectorises it.
_LOG2E = np.float32(1.4426950408889634)
_LN2_HI, _LN2_LO = np.float32(0.693359375), np.float32(-2.12194440e-4)
_EXP_POLY = tuple(np.float32(c) for c in (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2,
                                          1.6666665459e-1, 5.0000001201e-1))
_EXP_FLOOR = np.float32(-87.0)  # below it exp underflows to (nearly) 0 and 2^n would leave the normal range
_EXP_CEIL = np.float32(88.72283)  # above it expf overflows to inf
_MAX_LANES = 2 * SCORE_LANES  # running maxima and partial sums in the softmax (`_softmax_weights`)
_ROWS_PER_TASK = 16  # query rows (tokens x heads of a KV group) per task of `_tree_attention_tasks`


@njit(inline="always")
def _gather_widened(pool, kv, slots, out, dim):
    """out[j] = pool[kv, slots[j]] widened to fp32 (bits): a segment's keys or values, contiguous."""
    for j in range(slots.shape[0]):
        slot = slots[j]
        for d in range(dim):
            out[j, d] = _widen(pool[kv, slot, d])


@njit(inline="always")
def _scores(qf, kf, scores, width, keys, slots):
    """scores[i, j] = qf[i] . kf[j] (or kf[slots[j]], bf16 kf: `_dot_products`) for every query row and key
    j < keys, over the first `width` columns (a multiple of SCORE_LANES; zeros past head_dim). With 8-float vectors
    (AVX2) rows go four at a time, three keys a block; the last one to three rows in one pass of blocks of four keys.
    With 16-float vectors (AVX-512) keys go in pairs, eight a block (`_dot_products(paired=True)`), rows six at a
    time, then four, then the last three or one or two; scores needs columns up to `keys` rounded up to a multiple
    of SCORE_LANES. A score is the same chain whichever block computes it (`_dot_products`), so it depends only on
    its two vectors. Twelve dot products a block instead of eight (two rows x four keys, the only block at 8a52e3f)
    made attention calls 0.86-0.95x as long, with the same bits (one-off A/B in one process against 8a52e3f's
    kernel, 2-core AVX2 EPYC: contexts 128-2048, 1-64 new tokens; plain steps 0.93-0.95x). The paired blocks made
    them 0.74-0.86x as long for 2 to 17 new tokens over 512 or 2048 keys, 0.81-0.93x over 128, and plain steps
    0.88-0.96x, with the same bits (one-off A/B in one process against 99944c7's kernel, 2-core Zen 5 EPYC)."""
    rows = qf.shape[0]
    full = rows - rows % 4
    if _PAIRED_SCORES:
        six = rows - rows % 6
        for i in range(0, six, 6):
            for j in range(0, keys, SCORE_LANES):
                _dot_products_6x8p(qf, i, rows, kf, j, keys, width, scores, slots)
        i = six
        if rows - i >= 4:
            for j in range(0, keys, SCORE_LANES):
                _dot_products_4x8p(qf, i, rows, kf, j, keys, width, scores, slots)
            i += 4
        if rows - i == 3:
            for j in range(0, keys, SCORE_LANES):
                _dot_products_3x8p(qf, i, rows, kf, j, keys, width, scores, slots)
        elif rows > i:
            for j in range(0, keys, SCORE_LANES):
                _dot_products_2x8p(qf, i, rows, kf, j, keys, width, scores, slots)
        return
    for i in range(0, full, 4):
        for j in range(0, keys, 3):
            _dot_products_4x3(qf, i, rows, kf, j, keys, width, scores, slots)
    if rows - full == 3:
        for j in range(0, keys, 4):
            _dot_products_3x4(qf, full, rows, kf, j, keys, width, scores, slots)
    elif rows > full:
        for j in range(0, keys, 4):
            _dot_products_2x4(qf, full, rows, kf, j, keys, width, scores, slots)


@njit(inline="always")
def _exp_exponent(y):
    """k of exp(y) = e^r * 2^k, r = y - k ln2, |r| <= ln2 / 2 (Cephes' expf), as a float: the caller builds 2^k from
    its bits into a scratch array, which keeps its loop vectorised."""
    return np.floor(y * _LOG2E + np.float32(0.5))


@intrinsic
def _fma(typingctx, a, b, c):
    """a * b + c in one rounding (llvm.fma; loops of it vectorise): a multiply-add that no compiler flag decides,
    for the kernels that run without fast-math contraction."""
    if not all(x == types.float32 for x in (a, b, c)):
        return None

    def codegen(context, builder, signature, args):
        f32 = ir.FloatType()
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f32, [f32] * 3), "llvm.fma.f32")
        return builder.call(fma, args)

    return types.float32(a, b, c), codegen


@njit(inline="always")
def _exp_remainder(y, k):
    """e^r for r = y - k ln2 (k from `_exp_exponent`): Cephes' degree-7 polynomial, for y in
    [_EXP_FLOOR, _EXP_CEIL]; its multiply-adds fused explicitly (`_fma`)."""
    p0, p1, p2, p3, p4, p5 = _EXP_POLY
    r = _fma(k, -_LN2_LO, _fma(k, -_LN2_HI, y))
    poly = _fma(_fma(_fma(_fma(_fma(p0, r, p1), r, p2), r, p3), r, p4), r, p5)
    return _fma(poly, r * r, r) + np.float32(1.0)


@intrinsic
def _scaled_lane_sum(typingctx, weights, powers, whole):
    """weights[:whole] *= powers[:whole] in place; returns their sum as 2 * SCORE_LANES (= _MAX_LANES) partial
    sums, element t in partial t % 16, each in order, then summed in a fixed tree (16 -> 8, `_halving_sum`). weights
    and powers contiguous 1D fp32, whole a multiple of 16 (0 gives 0). In LLVM IR so the partial sums stay in two
    vector registers without fast-math (a numba array of them went through memory at a tenth of the speed)."""
    if not all(isinstance(a, types.Array) and a.ndim == 1 and a.dtype == types.float32 and a.layout == "C"
               for a in (weights, powers)):
        return None

    def codegen(context, builder, signature, args):
        w_type, p_type = signature.args[0], signature.args[1]
        i64 = ir.IntType(64)
        w_view = context.make_array(w_type)(context, builder, args[0])
        p_view = context.make_array(p_type)(context, builder, args[1])
        whole = context.cast(builder, args[2], signature.args[2], types.int64)
        w0 = cgutils.get_item_pointer(context, builder, w_type, w_view, [ir.Constant(i64, 0)], wraparound=False)
        p0 = cgutils.get_item_pointer(context, builder, p_type, p_view, [ir.Constant(i64, 0)], wraparound=False)

        def iteration(t, acc):
            updated = []
            for half, phi in enumerate(acc[0]):
                at = builder.add(t, ir.Constant(i64, SCORE_LANES * half))
                w_at = builder.bitcast(builder.gep(w0, [at]), _F32x8.as_pointer())
                product = builder.fmul(builder.load(w_at, align=4), builder.load(
                    builder.bitcast(builder.gep(p0, [at]), _F32x8.as_pointer()), align=4))
                builder.store(product, w_at, align=4)
                updated.append(builder.fadd(phi, product))
            return [updated]

        [(low, high)] = _accumulating_loop(builder, "lane_sum", _F32x8, (1, 2), 2 * SCORE_LANES, whole, iteration,
                                           may_skip=True)
        return _halving_sum(builder, builder.fadd(low, high))  # partial t + partial t + 8, then the tree

    return types.float32(weights, powers, whole), codegen


@intrinsic
def _lane_max(typingctx, weights, whole):
    """The largest of weights[:whole] (-inf for whole 0), `whole` a multiple of 16: running maxima in two vectors of
    SCORE_LANES lanes (each keeps the larger of itself and the next value, as numba's max(a, b) does: a NaN never
    wins), then the lanes. A max is exact in whatever order, so this is max(weights[:whole]) however it is split. In
    LLVM IR because numba kept its array of 16 running maxima in memory: 1.0 ns a key per query row of the softmax,
    most of it (one-off, 705 keys, 2-core AVX2 EPYC)."""
    if not (isinstance(weights, types.Array) and weights.ndim == 1 and weights.dtype == types.float32
            and weights.layout == "C"):
        return None

    def codegen(context, builder, signature, args):
        w_type = signature.args[0]
        i64 = ir.IntType(64)
        w_view = context.make_array(w_type)(context, builder, args[0])
        whole = context.cast(builder, args[1], signature.args[1], types.int64)
        w0 = cgutils.get_item_pointer(context, builder, w_type, w_view, [ir.Constant(i64, 0)], wraparound=False)

        def larger(a, b):  # b where b > a, else a
            return builder.select(builder.fcmp_ordered(">", b, a), b, a)

        def iteration(t, acc):
            loads = [builder.load(builder.bitcast(builder.gep(w0, [builder.add(t, ir.Constant(i64, SCORE_LANES * h))]),
                                                  _F32x8.as_pointer()), align=4) for h in range(2)]
            return [[larger(top, value) for top, value in zip(acc[0], loads)]]

        lowest = ir.Constant(_F32x8, [float("-inf")] * SCORE_LANES)
        [(low, high)] = _accumulating_loop(builder, "lane_max", _F32x8, (1, 2), 2 * SCORE_LANES, whole, iteration,
                                           may_skip=True, start=lowest)
        return _halving_sum(builder, larger(low, high), combine=larger)  # the lanes' max, in the sum's tree

    return types.float32(weights, whole), codegen


@njit(inline="always")
def _softmax_weights(weights, m, power_bits):
    """weights[:m] <- exp(weights[:m] - max) in place (Cephes' expf, above; 0 below `_EXP_FLOOR`); returns their sum.
    `power_bits`: uint32 scratch [>= m] for the 2^k factors."""
    whole = m - m % _MAX_LANES
    top = _lane_max(weights, whole)  # a max is exact in any order: lanes, then the rest in turn
    for t in range(whole, m):
        top = max(top, weights[t])
    for t in range(m):
        x = weights[t] - top
        clamped = max(x, _EXP_FLOOR)
        k = _exp_exponent(clamped)
        power_bits[t] = np.uint32(np.int32(k) + np.int32(127)) << np.uint32(23)  # the bits of 2^k
        weights[t] = _exp_remainder(clamped, k) if x > _EXP_FLOOR else np.float32(0.0)
    powers = power_bits.view(np.float32)
    # times 2^k, and their sum: the first m - m % _MAX_LANES in _MAX_LANES partial sums and a fixed tree
    # (`_scaled_lane_sum`), then the rest in order. The kernel runs without fast-math, so this is the order
    # computed, and it depends only on m.
    total = _scaled_lane_sum(weights, powers, whole)
    for t in range(whole, m):
        weights[t] *= powers[t]
        total += weights[t]
    return total


# No fast-math (see `_dot_products`). The numpy error model, as a parallel loop's body has: a division by zero gives
# inf or nan rather than raising, and divisions carry no check.
@njit(boundscheck=False, error_model="numpy", cache=_CACHE)
def _attention_task(head_dim, copied, q, k_pool, v_pool, s, kv, first, count, row_start, rows, ctx, key_start,
                    key_slots, mask_start, mask, reach, one_run, group, scale, out):
    """One task of `_tree_attention_tasks`: `count` (> 0) query rows from `first` of segment s's rows under the
    heads that share KV head kv. `head_dim` is compiled in as a constant (`literally`), so the loops over it unroll.
    `copied`: None where the micro-kernels read the keys and values from the pool through their slots, True where
    the task computes on widened copies of them (`attention_reads_copies`); a None argument is a type of its own, so
    numba compiles only the way taken.

    A function of its own rather than the body of the kernel's `prange` loop: numba's parallel passes copy and
    rewrite a loop's whole body several times, and with the micro-kernels inlined there that was most of the engine's
    compiling on a fresh install: the kernel for head_dim 64 compiled in 41.9 s, 18.4 s with this task function, to
    the same bits and within 0.96-1.09x the time (one-off A/B in one process, 2-core AVX2 EPYC)."""
    dim = literally(head_dim)
    value_width = (dim + LANES - 1) // LANES * LANES
    score_width = (dim + SCORE_LANES - 1) // SCORE_LANES * SCORE_LANES  # <= value_width
    n, c, r0 = rows[s], ctx[s], row_start[s]
    # only the keys some row of the task sees: a prefill's early rows skip the later tokens' keys (half of a
    # causal prefill's work); keys past a row's reach weigh exactly 0 for it, so dropping them changes no bit
    last = 0
    for row in range(count):
        last = max(last, reach[r0 + (first + row) % n])
    keys = c + last + 1
    slots = key_slots[key_start[s]:key_start[s] + keys]
    q_bits = np.zeros((count, score_width), np.uint32)
    for row in range(count):
        g, i = divmod(first + row, n)
        for d in range(dim):
            q_bits[row, d] = _widen(q[r0 + i, kv * group + g, d])
    scores = np.empty((count, (keys + SCORE_LANES - 1) // SCORE_LANES * SCORE_LANES), np.float32)
    if copied is None:  # keys and values read from the pool through their slots, widened in registers
        _scores(q_bits.view(np.float32), k_pool[kv], scores, score_width, keys, slots)
    else:
        kv_bits = np.empty((keys, value_width), np.uint32)
        kv_bits[:, dim:] = 0  # the spare lanes of keys and values hold 0
        _gather_widened(k_pool, kv, slots, kv_bits, dim)
        _scores(q_bits.view(np.float32), kv_bits.view(np.float32), scores, score_width, keys, None)
        _gather_widened(v_pool, kv, slots, kv_bits, dim)  # the keys are done with: the buffer takes the values
    # each row's softmax weights over all the segment's keys, exactly 0 where it may not look: a weight-0
    # key adds exactly nothing to a chain of fused multiply-adds, so the weighted sum below equals the chain
    # over the row's visible keys alone, in slot order
    probs = np.zeros((count, keys), np.float32)
    totals = np.empty(count, np.float32)
    visible = np.arange(keys)
    weights = np.empty(keys, np.float32)
    power_bits = np.empty(keys, np.uint32)
    for row in range(count):
        g, i = divmod(first + row, n)
        # the keys this row sees, in slot order: its context, then its ancestors and itself. For a draft
        # token that is exactly the key list plain decoding of its path sees, so everything below, which
        # depends only on that list (its length fixes how the softmax's sums split into vector lanes),
        # matches plain decoding bitwise. The leading keys it sees without a gap (its context, and all of
        # them where it sees its segment's new tokens 0 .. reach: a causal prefill's rows, a chain's) are
        # contiguous, so their copies vectorise; only the rest go through the mask, one by one. Through the
        # mask, a prefill's rows spent a third or more of its attention there: with the one run, prefills
        # of 512 / 2048 tokens took 0.94x / 0.82x the time, their attention 0.66x / 0.61x
        # (`prefill_attention.md`, AVX2 EPYC).
        run = c + reach[r0 + i] + 1 if one_run[r0 + i] else c
        for t in range(run):
            weights[t] = scores[row, t] * scale
        m = run
        for j in range(0 if one_run[r0 + i] else reach[r0 + i] + 1):
            if mask[mask_start[s] + i * n + j]:
                visible[m] = c + j
                weights[m] = scores[row, c + j] * scale
                m += 1
        totals[row] = _softmax_weights(weights, m, power_bits)
        for t in range(run):
            probs[row, t] = weights[t]
        for t in range(run, m):
            probs[row, visible[t]] = weights[t]
    weighted = np.empty((count, value_width), np.float32)
    if copied is None:
        _times_tiles(probs, v_pool[kv], 0, 0, 0, LANES, value_width // LANES, keys, weighted, 0, slots)
    else:
        _times_tiles(probs, kv_bits.view(np.float32), 0, 0, 0, LANES, value_width // LANES, keys, weighted,
                     0, None)
    for row in range(count):
        g, i = divmod(first + row, n)
        h = kv * group + g
        for d in range(dim):
            weighted[row, d] /= totals[row]
        _store_run(out, r0 + i, h * dim, weighted[row], 0, dim)


@njit(parallel=True, boundscheck=False, cache=_CACHE)
def _tree_attention_tasks(head_dim, copied, q, k_pool, v_pool, row_start, rows, ctx, key_start, key_slots, mask_start,
                          mask, reach, one_run, task_segment, task_kv, task_first, task_rows, group, scale, out):
    """softmax(q k^T * scale) v for every query row, over its visible keys only (module docstring). A task is a run
    of `task_rows` query rows from `task_first` of segment `task_segment`'s rows under the heads that share KV head
    `task_kv`, counted head-major (row g * n + i is token i under head task_kv * group + g). `head_dim` and `copied`
    come in as constants of the caller (`_tree_attention_kernel`, `cpu_forward._decoder_layers`): see
    `_attention_task`.

    q [T, H, D], k_pool and v_pool [KV, slots, D], out [T, H * D]: all bf16 bits. Per segment s: its first packed row
    `row_start[s]`, `rows[s]` query rows, `ctx[s]` cached keys, its keys' flat slots `key_slots[key_start[s]:][:ctx +
    rows]`, and its [rows, rows] mask over its own new tokens at `mask[mask_start[s]:]` (uint8, row-major); per packed
    row, `reach` is the last of its segment's new tokens it sees, and `one_run` is 1 where it sees all of them up to
    there (a prefill's or a chain's rows). Scores, softmax and the weighted sum run in fp32; `out` may be fp32. A task
    of 0 rows is padding (`TreeAttentionLayout.tasks`)."""
    for task in prange(task_segment.shape[0]):
        if task_rows[task] > 0:
            _attention_task(head_dim, copied, q, k_pool, v_pool, task_segment[task], task_kv[task], task_first[task],
                            task_rows[task], row_start, rows, ctx, key_start, key_slots, mask_start, mask, reach,
                            one_run, group, scale, out)


def attention_reads_copies(head_dim: int, widened_copy: bool = False) -> bool | None:
    """`_attention_task`'s `copied` for `head_dim`: None where head_dim is a whole number of value tiles (64, 128) and
    the micro-kernels read the pool's bf16 rows through the slots, widened in registers; True where each task widens
    its keys and values into a copy padded with zeros, or where `widened_copy` asks for that (for comparisons: the same
    bits). Writing that copy and reading it back cost more than reading the pool: in whole verify steps
    (`benchmarks/results/cpu_attention.md`, AVX2 EPYC) the pool's attention took 0.73-0.92x the copies', a plain
    step's at 2048 keys 5.1 ms against 6.9."""
    return None if head_dim % LANES == 0 and not widened_copy else True


@functools.cache
def _tree_attention_kernel(head_dim: int, widened_copy: bool = False):
    """The attention kernel compiled for one head_dim: a constant there, so the loops over it unroll.
    `widened_copy`: each task copies its keys and values out of the pool, widened to fp32, and computes on the copy,
    as every task did before the micro-kernels learnt to read the pool (for comparisons: the same bits)."""
    copied = attention_reads_copies(head_dim, widened_copy)

    @njit(boundscheck=False, cache=_CACHE)
    def kernel(q, k_pool, v_pool, row_start, rows, ctx, key_start, key_slots, mask_start, mask, reach, one_run,
               task_segment, task_kv, task_first, task_rows, group, scale, out):
        """`_tree_attention_tasks` for this head_dim and way of reading the pool. Only constants are closed over,
        so numba's cache keys on them (a closure over a compiled function pickles differently in every process and
        would compile afresh in each)."""
        _tree_attention_tasks(head_dim, copied, q, k_pool, v_pool, row_start, rows, ctx, key_start, key_slots,
                              mask_start, mask, reach, one_run, task_segment, task_kv, task_first, task_rows, group,
                              scale, out)

    return kernel


def tree_attention(q: Tensor, k_pool: np.ndarray, v_pool: np.ndarray, layout: "TreeAttentionLayout", *,
                   fp32_out: bool = False) -> Tensor:
    """Attention of packed bf16 queries q [T, H, D] over one layer's paged bf16 K/V (bits); [T, H * D] bf16
    (`fp32_out`: before the final rounding, for tests)."""
    out = tree_attention_bits(bf16_bits(q.detach().contiguous()), k_pool, v_pool, layout, fp32_out=fp32_out)
    return torch.from_numpy(out) if fp32_out else torch.from_numpy(out).view(torch.bfloat16)


def tree_attention_bits(q: np.ndarray, k_pool: np.ndarray, v_pool: np.ndarray, layout: "TreeAttentionLayout", *,
                        fp32_out: bool = False, threads: int | None = None, widened_copy: bool = False,
                        mask_every_row: bool = False) -> np.ndarray:
    """`tree_attention` on bf16 bits: q [T, H, D] uint16 -> [T, H * D] uint16. `threads`: numba's thread count
    where the caller has it already (`Bf16Linear.bits`). For comparisons, the same bits, slower: `widened_copy`
    computes on widened copies of the keys and values (`_tree_attention_kernel`); `mask_every_row` reads every
    row's keys through the mask, also the rows that see them as one run (`TreeAttentionLayout.one_run`)."""
    T, H, D = q.shape
    out = np.empty((T, H * D), np.float32 if fp32_out else np.uint16)
    threads = numba.get_num_threads() if threads is None else _checked_threads(threads)
    tasks = layout.tasks(k_pool.shape[0], H // k_pool.shape[0], threads)
    kernel = _tree_attention_kernel(D, widened_copy)
    one_run = np.zeros_like(layout.one_run) if mask_every_row else layout.one_run
    kernel(q, k_pool, v_pool, layout.row_start, layout.rows, layout.ctx, layout.key_start, layout.key_slots,
           layout.mask_start, layout.mask, layout.reach, one_run, *tasks, H // k_pool.shape[0], np.float32(D ** -0.5),
           out)
    return out


@njit(cache=_CACHE)
def _attention_tasks(segment_rows: np.ndarray, kv_heads: int, group: int, workers: int, most: int):
    """`TreeAttentionLayout.tasks` (its docstring): (segment, KV head, first row, rows) per task, each run of tasks
    padded with empty ones to the longest run's count. One numba call instead of a dozen numpy ones per forward:
    for one request of 5 rows, 3 KV heads and 2 threads, 4.7 instead of 126 us (one-off, 2-core AVX2 EPYC; the
    same tasks as the numpy version on 3000 random layouts)."""
    pairs = segment_rows.shape[0] * kv_heads
    pair_start = np.zeros(pairs + 1, np.int64)  # (segment, KV head) pairs, segment-major: their first query rows
    for p in range(pairs):
        pair_start[p + 1] = pair_start[p] + segment_rows[p // kv_heads] * group
    total = pair_start[pairs]
    # pieces: the nonempty intersections of a pair's rows and a run's (run w holds rows w * total // workers ..),
    # walked in row order; a piece of `length` rows takes ceil(length / most) tasks of near-equal size
    count = np.zeros(workers, np.int64)
    for stage in range(2):  # count each run's tasks, then fill them in
        if stage == 1:
            width = count.max()
            columns = np.zeros((4, workers * width), np.int64)
            count[:] = 0
        p, w, low = 0, 0, 0
        while low < total:
            while pair_start[p + 1] <= low:
                p += 1
            while (w + 1) * total // workers <= low:
                w += 1
            high = min(pair_start[p + 1], (w + 1) * total // workers)
            length = high - low
            chunks = -(-length // most)
            offset = low - pair_start[p]
            for part in range(chunks):
                if stage == 1:
                    at = w * width + count[w]
                    columns[0, at] = p // kv_heads
                    columns[1, at] = p % kv_heads
                    columns[2, at] = offset + part * length // chunks
                    columns[3, at] = offset + (part + 1) * length // chunks - columns[2, at]
                count[w] += 1
            low = high
    return columns[0], columns[1], columns[2], columns[3]


@njit(cache=_CACHE)
def _reach_and_runs(mask, mask_start, row_start, rows, packed_rows):
    """`TreeAttentionLayout`'s `reach` and `one_run` per packed row, from the segments' flat masks. Compiled: with two
    numpy calls per segment, a batch-16 plain step's layout took 202 us; 38 us now (`zen4_oneoffs.txt` §8)."""
    reach = np.zeros(packed_rows, np.int64)
    one_run = np.zeros(packed_rows, np.uint8)
    for s in range(rows.shape[0]):
        k, base, first = rows[s], mask_start[s], row_start[s]
        for i in range(k):
            last, seen = k - 1, 0  # a row that saw nothing would reach the last token, as argmax of no True gives
            for j in range(k - 1, -1, -1):
                if mask[base + i * k + j]:
                    if seen == 0:
                        last = j
                    seen += 1
            reach[first + i] = last
            one_run[first + i] = seen == last + 1
    return reach, one_run


class TreeAttentionLayout:
    """Where each segment of a packed forward finds its rows, keys and mask (built once per forward, read by every
    layer's `tree_attention`). `segments`: (first packed row, context length, flat slots of its keys
    [ctx + rows], mask over its new tokens [rows, rows] bool)."""

    def __init__(self, segments: list[tuple[int, int, np.ndarray, np.ndarray]]):
        n = [m.shape[0] for _, _, _, m in segments]
        self.row_start = np.array([r for r, _, _, _ in segments], np.int64)
        self.rows = np.array(n, np.int64)
        self.ctx = np.array([c for _, c, _, _ in segments], np.int64)
        self.key_slots = np.concatenate([s for _, _, s, _ in segments], dtype=np.int64)
        self.key_start = np.concatenate([[0], np.cumsum([len(s) for _, _, s, _ in segments])[:-1]]).astype(np.int64)
        self.mask = np.concatenate([m.reshape(-1) for _, _, _, m in segments]).astype(np.uint8, copy=False)
        self.mask_start = np.concatenate([[0], np.cumsum([k * k for k in n])[:-1]]).astype(np.int64)
        # per packed row (segments in row order), the last of its segment's new tokens it sees
        # per packed row, 1 where it sees every new token of its segment up to its reach (a causal prefill's rows,
        # a chain's): the kernel then reads its keys as one run instead of through the mask
        packed_rows = max((first + k for (first, _, _, _), k in zip(segments, n)), default=0)
        self.reach, self.one_run = _reach_and_runs(self.mask, self.mask_start, self.row_start, self.rows, packed_rows)
        if not np.array_equal(self.key_start + self.ctx + self.rows, np.cumsum([len(s) for _, _, s, _ in segments])):
            raise ValueError("each segment needs the flat slots of its context and its new tokens (ctx + rows keys)")
        self._tasks: dict[tuple[int, int, int], tuple[np.ndarray, ...]] = {}

    def tasks(self, kv_heads: int, group: int, workers: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The kernel's tasks (segment, KV head, first row, rows) for `workers` threads, each at most
        `_ROWS_PER_TASK` query rows of one (segment, KV head) pair: a task gathers its pair's keys once, and a long
        tree still splits across the cores.

        The pairs' rows, in order, are cut into `workers` runs of equal length (a pair may be cut in two, which
        costs one more gather), each run into its tasks, and every run padded with empty tasks (0 rows) to the same
        count: numba's prange hands each thread an equal, contiguous share of the tasks, so each thread gets one
        run. Cut per pair instead, one request's three KV heads left one of two threads with a third of the rows
        and the other with two thirds. One-off on a 2-core AVX2 EPYC (one layer, 30 interleaved rounds, thread
        count passed in as the engine does): a 5-token tree over 400 keys took 0.84x the per-pair layout's time;
        one token over 400 or 800 keys 0.95x; one token for each of 4 or 16 requests 0.98x and 1.01x. Which task
        computes a row changes none of its bits (`_tree_attention_kernel`)."""
        key = (kv_heads, group, workers)
        if key not in self._tasks:
            self._tasks[key] = _attention_tasks(self.rows, kv_heads, group, workers, _ROWS_PER_TASK)
        return self._tasks[key]
