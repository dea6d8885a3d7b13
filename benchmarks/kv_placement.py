"""What it costs a CPU verify step when a request's KV blocks lie scattered over the paged pool rather than in a row:
the default engine (bf16, its numba attention kernel), one or four requests at contexts 512 and 2048, plain steps
and draft trees of 4 and 16 nodes, each point once with every request's blocks contiguous (as the allocator places
them: `trt_engines.kv_cache`) and once with them moved to random blocks of a large pool (8192 blocks, 3 GB), as a
free list handed them out after serving many requests for a while, before the allocator kept tables in runs.

    .venv/bin/python -m benchmarks.kv_placement [--rounds 20]

A block holds 16 tokens, i.e. 2 KB of one layer's keys (or values) under one KV head, so a scattered request's keys
are 2 KB runs at random addresses: the hardware prefetcher starts over at every run, and a page (4 KB) holds one
run. The attention kernel prefetches the pool rows it gathers some keys ahead (`cpu_kernels._GATHER_AHEAD_KEYS`);
this measures what scattering still costs. The two placements' requests live in the same engine, their steps
alternate (which goes first alternating), so background load on this shared machine hits them alike; times are
medians over rounds; attention ms is the step's attention calls summed (mean over rounds). Where blocks lie changes
no bit (the kernel reads each key through its slot; `tests/test_cpu_kernels.py`). Writes
benchmarks/results/kv_placement.{json,md}.
"""

from __future__ import annotations

import statistics

import numba
import numpy as np
import torch

import trt_engines.cpu_forward as cpu_forward
from benchmarks.cpu_attention import TimedAttention
from benchmarks.results_files import rounds_benchmark_main
from drafter.tree import DraftTree
from trt_engines.base import VerifyItem
from trt_engines.cpu_kernels import cpu_description
from trt_engines.torch_engine import TorchEngine

CONTEXTS = (512, 2048)
SHAPES = ((1, 0), (1, 4), (1, 16), (4, 0), (4, 4))  # (requests, nodes per request)
PLACEMENTS = ("contiguous", "scattered")
POOL_BLOCKS = 8192


def _chain(nodes: int) -> DraftTree:
    return DraftTree.chain(np.arange(1, nodes + 1)) if nodes else DraftTree.empty()


def _scatter(kv, request_id, rng) -> None:
    """Move a request's blocks to random free blocks of the pool, as a pool that has served many requests for a
    while might have handed them out. It edits the cache's private bookkeeping (no public call places blocks), and
    leaves the K/V behind: a synthetic request's values do not change a step's time."""
    table = kv.tables[request_id]
    picked = rng.choice(np.flatnonzero(kv._is_free), len(table), replace=False)
    kv._is_free[picked], kv._is_free[table] = False, True
    kv._refs[picked], kv._refs[table] = 1, 0
    kv.tables[request_id] = [int(b) for b in picked]


def measure(rounds: int) -> dict:
    engine = TorchEngine("default", dtype=torch.bfloat16, num_blocks=POOL_BLOCKS)
    if not engine.kernel_attention:
        raise SystemExit("kv_placement measures the numba tree-attention kernel; this engine runs PyTorch's "
                         "attention (cpu_kernels='torch')")
    timed = TimedAttention(cpu_forward.tree_attention_bits, PLACEMENTS)
    cpu_forward.tree_attention_bits = timed
    most = max(b for b, _ in SHAPES)
    rows = []
    try:
        for context in CONTEXTS:
            # every request's blocks come as one run (the allocator keeps a table's blocks in runs); the scattered
            # ones are then moved to random free blocks
            rng = np.random.default_rng(context)
            for i in range(most):
                engine.add_synthetic_request(f"contiguous{i}", context)
            for i in range(most):
                engine.add_synthetic_request(f"scattered{i}", context)
                _scatter(engine.kv, f"scattered{i}", rng)
            for batch, nodes in SHAPES:
                items = {p: [VerifyItem(f"{p}{i}", _chain(nodes)) for i in range(batch)] for p in PLACEMENTS}
                for placement in PLACEMENTS:  # warm-up
                    engine.verify(items[placement])
                steps: dict[str, list[float]] = {p: [] for p in PLACEMENTS}
                timed.reset()
                for r in range(rounds):
                    for placement in PLACEMENTS if r % 2 else PLACEMENTS[::-1]:
                        timed.label = placement
                        steps[placement].append(engine.verify(items[placement]).timings["total_ms"])
                contiguous_ms, scattered_ms = (statistics.median(steps[p]) for p in PLACEMENTS)
                rows.append({"context": context, "requests": batch, "nodes": nodes,
                             "contiguous_step_ms": contiguous_ms, "scattered_step_ms": scattered_ms,
                             "scattered_over_contiguous": statistics.median(
                                 s / c for c, s in zip(steps["contiguous"], steps["scattered"])),
                             "contiguous_attention_ms": 1e3 * timed.seconds["contiguous"] / rounds,
                             "scattered_attention_ms": 1e3 * timed.seconds["scattered"] / rounds})
                print(rows[-1], flush=True)
            for rid in list(engine.requests):
                engine.release(rid)
    finally:
        cpu_forward.tree_attention_bits = timed.kernel
    return {"machine": cpu_description(), "threads": numba.get_num_threads(), "rounds": rounds,
            "pool_blocks": POOL_BLOCKS, "rows": rows}


def write_markdown(path, result: dict) -> None:
    lines = [
        "# kv_placement: a verify step over scattered KV blocks against contiguous ones (CPU)",
        "",
        f"Command: `python -m benchmarks.kv_placement --rounds {result['rounds']}` on {result['machine']}, "
        f"{result['threads']} numba threads. Default model, bf16, the default engine's kernels; a pool of "
        f"{result['pool_blocks']} blocks of 16 tokens; 'contiguous': each request's blocks in a row; 'scattered': "
        "handed out in a random order over the pool. Steps of the two placements alternate; medians of "
        f"{result['rounds']} rounds ('scattered / contiguous': median of the per-round ratios); attention ms: the "
        "step's attention calls summed, mean over rounds.",
        "",
        "| context | requests | nodes | step ms contiguous | step ms scattered | scattered / contiguous "
        "| attention ms contiguous | attention ms scattered |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [f"| {r['context']} | {r['requests']} | {r['nodes']} | {r['contiguous_step_ms']:.2f} | "
              f"{r['scattered_step_ms']:.2f} | {r['scattered_over_contiguous']:.3f} | "
              f"{r['contiguous_attention_ms']:.2f} | {r['scattered_attention_ms']:.2f} |" for r in result["rows"]]
    lines.append("")
    path.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    return rounds_benchmark_main("kv_placement", __doc__, measure, write_markdown, argv, default_rounds=20)


if __name__ == "__main__":
    raise SystemExit(main())
