"""Start-up fit of the step-time model on the engine it will schedule for (a few seconds of verify steps).

The roofline gives the shape of the cost curve; the fit gives this engine's constants (kernel efficiency, framework
overhead per step and per token). Afterwards the orchestrator keeps refitting online from every measured step.
"""

from __future__ import annotations

import itertools
import time
import warnings
from collections.abc import Sequence

import numpy as np

from drafter.tree import DraftTree
from orchestrator.roofline import HardwareSpec, StepTimeModel, check_row_table_rows
from trt_engines.base import TargetEngine, VerifyItem


SWEEP_BATCHES, SWEEP_NODES, SWEEP_CONTEXTS = (1, 4, 16), (0, 3, 15, 31), (128, 512)  # the start-up sweep's grid
# The row table's steps: 1..ROW_TABLE_ROWS rows of one request at ROW_TABLE_CONTEXT cached tokens (short, so that
# the table holds the cost of rows, not of attention over a long context, which the attention feature prices)
ROW_TABLE_ROWS, ROW_TABLE_CONTEXT, ROW_TABLE_ROUNDS = 48, 32, 5


def fit_step_model(
    engine: TargetEngine,
    model: StepTimeModel,
    *,
    batches: tuple[int, ...] = SWEEP_BATCHES,
    nodes: tuple[int, ...] = SWEEP_NODES,
    contexts: tuple[int, ...] = SWEEP_CONTEXTS,
    repeats: int = 3,
    table_rows: int = 0,
    seed: int = 0,
) -> float:
    """Measure the row table (`measure_row_seconds`, `table_rows` rows, e.g. ROW_TABLE_ROWS; 0: none, the
    roofline's row terms), then time verify steps over a grid of (batch, nodes per request, context) (one warm-up
    run, then the median of `repeats` runs per point), fit `model`; return the median relative error of the fitted
    model on those points.

    No table by default: on a Zen 4 and a Zen 2 EPYC (numba's linear kernels, whose cost is close to a line in the
    rows) a 48-row table served goodput at 1.000x and 1.003x (medians; 0.988x at worst on both) the roofline's rows
    and predicted held-out steps about as well (8.4% against 7.9%, 2.8% against 3.3%; `benchmarks/results/
    row_table.md`, `row_table_avx2.md`). It is for GEMM libraries that price rows in steps (oneDNN's AMX kernels,
    `verify_rows_amx_oneoff.md`), where `python -m benchmarks.row_table` measures both forms side by side. Where
    the engine cannot hold the table's steps it warns and keeps the roofline's rows."""
    rng = np.random.default_rng(seed)
    synthetic = hasattr(engine, "add_synthetic_request")  # random KV instead of a real prefill: same cost
    if check_row_table_rows(table_rows):
        # at least ROW_TABLE_ROUNDS rounds even for a quick start-up fit: an entry from one round is one step's
        # difference, and a burst of background load during it would read as a cliff the budget then steers around
        table = measure_row_seconds(engine, rows=table_rows, rounds=max(repeats, ROW_TABLE_ROUNDS), seed=seed)
        if table is None:  # asked for, so say why the model prices rows by the roofline after all
            warnings.warn(f"no row table: the engine cannot hold {ROW_TABLE_CONTEXT} cached tokens + {table_rows} "
                          f"rows for one request (max_context {engine.max_context}, {engine.free_blocks()} free "
                          "blocks); the roofline prices rows. Lower table_rows (--row-table-rows) or give the "
                          "engine more room", RuntimeWarning, stacklevel=2)
        model.set_row_seconds(table)
    samples = []
    for batch, context in itertools.product(batches, contexts):
        ids = [f"__profile-{batch}-{context}-{i}" for i in range(batch)]
        # every request rounds up to whole KV blocks of its own (one sequence of batch x context tokens would not)
        if batch * engine.blocks_needed(context + max(nodes) + 1) > engine.free_blocks():
            continue
        try:
            for rid in ids:
                if synthetic:
                    engine.add_synthetic_request(rid, context)
                else:
                    engine.add_request(rid, rng.integers(0, engine.vocab_size, context).tolist(), _greedy())
            for n in nodes:
                trees = [DraftTree.chain(rng.integers(0, engine.vocab_size, n)) for _ in ids]
                seconds = []
                for repeat in range(repeats + 1):
                    out = engine.verify([VerifyItem(rid, tree) for rid, tree in zip(ids, trees)])
                    if repeat:  # the first run warms caches and allocator
                        seconds.append(out.timings["total_ms"] / 1e3)
                # one sample per shape, its median run: a run slowed 2x by background load on a shared machine
                # would otherwise count as much as a clean one in the fit
                samples.append((np.full(batch, n + 1.0), np.full(batch, float(context)), float(np.median(seconds))))
        finally:
            for rid in ids:
                if rid in getattr(engine, "requests", ids):
                    engine.release(rid)
    if not samples:
        raise RuntimeError("the engine could not hold any profiling batch; give it more KV blocks")
    model.fit(samples)
    errors = [abs(model.predict(t, c) - m) / m for t, c, m in samples]
    return float(np.median(errors))


def measure_row_seconds(engine: TargetEngine, *, rows: int = ROW_TABLE_ROWS, context: int = ROW_TABLE_CONTEXT,
                        rounds: int = ROW_TABLE_ROUNDS, seed: int = 0) -> np.ndarray | None:
    """The extra seconds of a verify step of T rows over a step of one row, T = 1..`rows`
    (`StepTimeModel.row_seconds`): one request at `context` cached tokens verifying a chain of T - 1 nodes. Every
    size runs once per round, the order rotating, after a warm-up round; each entry is the median over rounds of
    its step's time minus that round's one-row step, so background load that slows a whole round cancels out,
    then the median of each entry and its two neighbours: on a shared host a burst of load can still land on one
    size in most rounds, and a median of three removes such a lone spike where it keeps the edge of a real step
    (oneDNN's 16 -> 17 rows on a Xeon holds for many rows in a row).
    None where the engine cannot hold `context + rows` tokens for one request (then the roofline prices rows)."""
    if rows < 2 or rounds < 1:
        raise ValueError(f"a row table needs rows >= 2 and rounds >= 1; got rows={rows}, rounds={rounds}")
    if context + rows + 1 > engine.max_context or engine.blocks_needed(context + rows + 1) > engine.free_blocks():
        return None
    rng = np.random.default_rng(seed)
    rid = "__profile-rows"
    if hasattr(engine, "add_synthetic_request"):
        engine.add_synthetic_request(rid, context)
    else:
        engine.add_request(rid, rng.integers(0, engine.vocab_size, context).tolist(), _greedy())
    chains = [DraftTree.chain(rng.integers(0, engine.vocab_size, n)) for n in range(rows)]
    seconds = np.zeros((rounds, rows))
    try:
        for r in range(rounds + 1):
            order = np.roll(np.arange(rows), -r)
            for n in order:
                out = engine.verify([VerifyItem(rid, chains[n])])
                if r:  # the first round warms caches and allocator (and compiles, where a size is new)
                    seconds[r - 1, n] = out.timings["total_ms"] / 1e3
    finally:
        engine.release(rid)
    extra = np.median(seconds - seconds[:, :1], axis=0)
    smoothed = extra.copy()
    smoothed[1:-1] = np.median(np.stack([extra[:-2], extra[1:-1], extra[2:]]), axis=0)
    return np.maximum(smoothed, 0.0)  # a step of more rows is never cheaper than one row; below 0 is noise


def _greedy():
    from trt_engines.base import SamplingParams

    return SamplingParams()


def _timed(fn, sync, repeats: int) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - started)
    return best


MEASURABLE_DTYPES = ("float32", "bfloat16", "float16")


def measure_hardware(device: str = "cpu", *, size: int | None = None, stream_mb: int = 512, repeats: int = 5,
                     cpu_kernels: bool | None = None, dtypes: Sequence[str] = ("float32", "bfloat16")) -> HardwareSpec:
    """Matmul FLOP/s per dtype (best of square matmuls), streaming bandwidth (`a + b -> c`, 3 transfers, SSSD's
    method) and a tiny matmul's wall time as the per-step overhead, on `device` (CPU or CUDA).

    `size` defaults to 2048 on a CPU and 8192 on a GPU, where a 2048 matmul is too short to reach peak.
    `cpu_kernels` (CPU): time bf16 through the engine's numba linear kernel (`trt_engines.cpu_kernels`, what
    `TorchEngine.kernel_linears` runs) instead of PyTorch's matmul; None: where "auto" would pick it.
    `dtypes`: which of `MEASURABLE_DTYPES` to time; a step-time model reads only its engine's. Asking for just
    that one matters on a CPU without bf16 instructions when the engine runs fp32: PyTorch's bf16 matmul takes its
    slow path there (`trt_engines.cpu_kernels`), and timing it, for a dtype the engine never runs, took minutes."""
    import torch

    from trt_engines.cpu_kernels import Bf16Linear, auto_cpu_kernels

    if not dtypes or set(dtypes) - set(MEASURABLE_DTYPES):
        raise ValueError(f"measure_hardware(dtypes=...) takes one or more of {list(MEASURABLE_DTYPES)}; "
                         f"got {list(dtypes)}")
    dev = torch.device(device)
    size = size or (8192 if dev.type == "cuda" else 2048)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    if cpu_kernels is None:
        cpu_kernels = dev.type == "cpu" and auto_cpu_kernels() == "numba"
    flops = {}
    for name in dict.fromkeys(dtypes):
        dtype = getattr(torch, name)
        a = torch.randn(size, size, device=dev, dtype=dtype)
        b = torch.randn(size, size, device=dev, dtype=dtype)
        matmul = Bf16Linear(b) if cpu_kernels and dtype == torch.bfloat16 else (lambda x: x @ b)
        seconds = _timed(lambda: matmul(a), sync, repeats)
        flops[name] = 2 * size**3 / seconds
    n = stream_mb * (1 << 20) // 4
    x, y = torch.ones(n, device=dev), torch.ones(n, device=dev)
    out = torch.empty(n, device=dev)
    seconds = _timed(lambda: torch.add(x, y, out=out), sync, repeats)
    bandwidth = 3 * n * 4 / seconds
    small = torch.randn(8, 8, device=dev)
    overhead = _timed(lambda: small @ small, sync, 50)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu-{torch.get_num_threads()}threads"
    return HardwareSpec(name=f"measured:{name}", peak_flops=flops, mem_bandwidth=bandwidth, overhead_s=overhead)
