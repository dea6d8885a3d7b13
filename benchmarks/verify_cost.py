"""Verify-step cost of TorchEngine (default model, bf16, CPU) and plain greedy decoding vs `transformers` generate.

    .venv/bin/python benchmarks/verify_cost.py [--budget-s 600] [--quick]

Grid: batch {1, 4, 16, 32} x tree nodes per request {0 (plain step), 1, 2, 4, 8, 16, 32, 64} x context
{128, 512, 2048}. Contexts are synthetic (random K/V in the paged cache: step time does not depend on the values).
Each point: one warm-up call, then the median of up to 5 timed calls (3 past 300 ms, 1 past 2 s). Points are run
cheapest first; points over the token bound or past the time budget are skipped and listed.

Paired rounds (the headline ratios): one request at context 512, every tree size once per round, order rotating; before
each round a compute probe times 16 rows through a 1024 x 576 linear layer whose weights stay in cache. On this
project's shared 2-core hosts that arithmetic speed flips between two levels about 3x apart every few seconds while
the memory stream holds still (a one-off probe of both, 2-core Zen 4 EPYC: in-cache 16-row calls p10 79, p50 124,
p90 311 us; a 57 MB one-row layer 1.4-2.1 ms), and a verify step's extra rows are arithmetic: one whole run could
land in either phase. Rounds whose probe took over 1.5x the fastest count as slow-compute rounds; the summary gives
the verify-8 ratio over all rounds and over each kind. The probe does not account for all of the spread between
runs: two runs without a slow-compute round measured the verify-8 ratio at 1.51 and 1.86 (README).

Decoding: the same 5 random 64-token prompts, greedy, N new tokens, batch 1, EOS ignored, tok/s = N / median time, in bf16 and fp32: our
`orchestrator.spec_loop.generate` (plain) vs `LlamaForCausalLM.generate`. Writes benchmarks/results/verify_cost.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script (`python benchmarks/verify_cost.py`)
from benchmarks.results_files import RESULTS, write_results_json  # noqa: E402
from drafter.tree import DraftTree
from orchestrator.spec_loop import generate
from trt_engines.base import VerifyItem
from trt_engines.cpu_kernels import Bf16Linear, cpu_description
from trt_engines.prepare import resolve_model_dir
from trt_engines.torch_engine import TorchEngine

BATCHES = (1, 4, 16, 32)
NODES = (0, 1, 2, 4, 8, 16, 32, 64)
CONTEXTS = (128, 512, 2048)
MAX_TOKENS_PER_STEP = 1100  # skip batch x (nodes + 1) beyond this: > ~5 s per call on 2 cores


def random_tree(n: int, rng: np.random.Generator) -> DraftTree:
    if n == 0:
        return DraftTree.empty()
    parents = [-1] + [int(rng.integers(max(-1, i - 3), i)) for i in range(1, n)]  # bushy, a few levels deep
    return DraftTree.from_arrays(tokens=rng.integers(0, 49152, n), parents=parents)


def _time_step(engine: TorchEngine, items: list[VerifyItem]) -> tuple[float, float]:
    """Median total_ms and forward_ms of a verify call (warm-up excluded)."""
    engine.verify(items)
    totals, forwards = [], []
    for _ in range(5):
        out = engine.verify(items)
        totals.append(out.timings["total_ms"])
        forwards.append(out.timings["forward_ms"])
        if out.timings["total_ms"] > 2000 or (len(totals) >= 3 and out.timings["total_ms"] > 300):
            break
    return statistics.median(totals), statistics.median(forwards)


def grid(engine: TorchEngine, *, budget_s: float, contexts, batches, nodes) -> tuple[list[dict], list[str]]:
    rng = np.random.default_rng(0)
    points = sorted(
        ((b, n, c) for c in contexts for b in batches for n in nodes),
        key=lambda p: (p[0] * (p[1] + 1) * 270e6 + p[0] * p[2] * 4e5, p),  # ~ FLOPs of weights + attention
    )
    rows, skipped = [], []
    start = time.perf_counter()
    active: tuple[int, int] | None = None
    for b, n, c in points:
        if b * (n + 1) > MAX_TOKENS_PER_STEP:
            skipped.append(f"b{b}_n{n}_ctx{c} (token bound {MAX_TOKENS_PER_STEP})")
            continue
        if time.perf_counter() - start > budget_s:
            skipped.append(f"b{b}_n{n}_ctx{c} (time budget)")
            continue
        if active != (b, c):  # synthetic requests for this batch x context
            for rid in list(engine.requests):
                engine.release(rid)
            for i in range(b):
                engine.add_synthetic_request(f"b{i}", c)
            active = (b, c)
        items = [VerifyItem(f"b{i}", random_tree(n, rng)) for i in range(b)]
        total, forward = _time_step(engine, items)
        rows.append({"batch": b, "nodes": n, "ctx": c, "step_ms": total, "forward_ms": forward})
        print(f"b{b:<3} n{n:<3} ctx{c:<5} {total:9.1f} ms", flush=True)
    for rid in list(engine.requests):
        engine.release(rid)
    return rows, skipped


SLOW_COMPUTE = 1.5  # a round whose compute probe took over this times the fastest probe is a slow-compute round


def compute_probe_us(layer: Bf16Linear, x: torch.Tensor, calls: int = 10) -> float:
    """Microseconds per call of a compute-bound kernel: `x`'s rows through `layer`, whose weights stay in cache (the
    host's arithmetic speed at the moment; module docstring)."""
    started = time.perf_counter()
    for _ in range(calls):
        layer(x)
    return (time.perf_counter() - started) / calls * 1e6


def paired_steps(engine: TorchEngine, *, ctx: int, nodes: tuple[int, ...],
                 rounds: int) -> tuple[dict[int, list[float]], list[float]]:
    """Step times (total_ms) of one request at `ctx` for each tree size, measured in interleaved rounds, and each
    round's compute probe (`compute_probe_us`, timed before the round).

    Each round times every size once (order rotating), so a burst of background load lands on all sizes of a round
    alike: the per-round ratios are what the headline reports, not ratios of medians taken minutes apart.
    """
    rng = np.random.default_rng(2)
    for rid in list(engine.requests):
        engine.release(rid)
    engine.add_synthetic_request("paired", ctx)
    items = {n: [VerifyItem("paired", random_tree(n, rng))] for n in nodes}
    generator = torch.Generator().manual_seed(0)
    probe_layer = Bf16Linear(torch.randn(1024, 576, generator=generator).bfloat16())
    probe_rows = torch.randn(16, 576, generator=generator).bfloat16()
    compute_probe_us(probe_layer, probe_rows)  # warm-up (compiles nothing new: the engine's kernels)
    for n in nodes:
        engine.verify(items[n])  # warm-up
    times: dict[int, list[float]] = {n: [] for n in nodes}
    probes = []
    for r in range(rounds):
        probes.append(compute_probe_us(probe_layer, probe_rows))
        for n in nodes[r % len(nodes):] + nodes[: r % len(nodes)]:
            times[n].append(engine.verify(items[n]).timings["total_ms"])
    engine.release("paired")
    return times, probes


def ratio_by_compute_phase(times: dict[int, list[float]], probes: list[float], n: int) -> dict:
    """The per-round ratio of n nodes to a plain step: its median over every round and over the rounds of each
    compute phase (None where a phase has no round), and how many rounds were slow (`SLOW_COMPUTE`)."""
    slow = [p > SLOW_COMPUTE * min(probes) for p in probes]
    ratios = [a / b for a, b in zip(times[n], times[0])]
    fast_ratios = [r for r, s in zip(ratios, slow) if not s]
    slow_ratios = [r for r, s in zip(ratios, slow) if s]
    return {"all": statistics.median(ratios), "fast": statistics.median(fast_ratios) if fast_ratios else None,
            "slow": statistics.median(slow_ratios) if slow_ratios else None, "slow_rounds": sum(slow)}


def decode_throughput(dtype: torch.dtype, prompts: list[list[int]], max_new: int) -> dict:
    from transformers import LlamaForCausalLM

    engine = TorchEngine("default", dtype=dtype, num_blocks=256)
    hf = LlamaForCausalLM.from_pretrained(resolve_model_dir("default"), dtype=dtype).eval()
    ours_s, hf_s = [], []
    generate(engine, prompts[:1], max_new_tokens=4, stop_at_eos=False)  # warm-up
    with torch.no_grad():
        hf.generate(torch.tensor([prompts[0]]), max_new_tokens=4, do_sample=False, pad_token_id=2)
    for p in prompts:  # interleaved so background load hits both alike
        t = time.perf_counter()
        out, _ = generate(engine, [p], max_new_tokens=max_new, stop_at_eos=False)
        ours_s.append(time.perf_counter() - t)
        assert len(out[0]) == max_new
        t = time.perf_counter()
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([p]), max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False, pad_token_id=2
            )
        hf_s.append(time.perf_counter() - t)
        assert ref.shape[1] - len(p) == max_new
    # median over prompts: one prompt hit by another job's burst on this shared machine does not decide the result
    return {
        "ours_tokens_per_s": max_new / statistics.median(ours_s),
        "hf_tokens_per_s": max_new / statistics.median(hf_s),
        "ours_s": ours_s,
        "hf_s": hf_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-s", type=float, default=420.0, help="time budget for the grid")
    ap.add_argument("--quick", action="store_true", help="tiny grid (smoke test)")
    ap.add_argument("--max-new", type=int, default=48)
    args = ap.parse_args()
    torch.set_num_threads(2)
    rng = np.random.default_rng(1)
    prompts = [[1] + rng.integers(2, 49152, 63).tolist() for _ in range(5 if not args.quick else 1)]

    decode = {}
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        decode[name] = decode_throughput(dtype, prompts, args.max_new if not args.quick else 8)
        print(name, {k: v for k, v in decode[name].items() if k.endswith("per_s")}, flush=True)

    engine = TorchEngine("default", dtype=torch.bfloat16, num_blocks=32 * (2048 + 128) // 16 + 64)
    kw = dict(contexts=(512,), batches=(1,), nodes=(0, 1, 8, 32)) if args.quick else dict(
        contexts=CONTEXTS, batches=BATCHES, nodes=NODES
    )
    paired, probes = paired_steps(engine, ctx=512, nodes=(0, 1, 8, 32), rounds=9 if args.quick else 41)
    rows, skipped = grid(engine, budget_s=args.budget_s, **kw)
    # fp32 for the headline point only, to report whether bf16 pays on this CPU
    fp32 = TorchEngine("default", dtype=torch.float32, num_blocks=64)
    fp32_rows, _ = grid(fp32, budget_s=60, contexts=(512,), batches=(1,), nodes=(0, 8))

    def at(rs, b, n, c):
        return next((r["step_ms"] for r in rs if (r["batch"], r["nodes"], r["ctx"]) == (b, n, c)), None)

    med = {n: statistics.median(ts) for n, ts in paired.items()}
    phases8 = ratio_by_compute_phase(paired, probes, 8)
    summary = {
        "ar_tokens_per_s": decode["bf16"]["ours_tokens_per_s"],
        "hf_generate_tokens_per_s": decode["bf16"]["hf_tokens_per_s"],
        "ar_tokens_per_s_fp32": decode["fp32"]["ours_tokens_per_s"],
        "hf_generate_tokens_per_s_fp32": decode["fp32"]["hf_tokens_per_s"],
        "plain_step_ms_b1_ctx512": med[0],
        "step_ms_b1_n1_ctx512": med[1],
        "step_ms_b1_n8_ctx512": med[8],
        "step_ms_b1_n32_ctx512": med[32],
        "verify8_over_plain_b1_ctx512": phases8["all"],
        "paired_rounds": len(paired[0]),
        "compute_probe_us_median": statistics.median(probes),
        "slow_compute_rounds": phases8["slow_rounds"],
        "verify8_over_plain_fast_compute_rounds": phases8["fast"],
        "verify8_over_plain_slow_compute_rounds": phases8["slow"],
        "fp32_plain_step_ms_b1_ctx512": at(fp32_rows, 1, 0, 512),
        "fp32_step_ms_b1_n8_ctx512": at(fp32_rows, 1, 8, 512),
    }
    summary["goal_ar_ge_hf"] = summary["ar_tokens_per_s"] >= summary["hf_generate_tokens_per_s"]
    summary["goal_verify8_le_1p3_plain"] = bool(summary["verify8_over_plain_b1_ctx512"] and summary["verify8_over_plain_b1_ctx512"] <= 1.3)
    meta = {
        "model": "default (SmolLM2-135M-Instruct)", "dtype": "bfloat16", "device": str(engine.device),
        "threads": torch.get_num_threads(), "torch": torch.__version__, "cpu": cpu_description(),
        "cpu_kernels": engine.cpu_kernels,
        "decode_prompts": len(prompts), "decode_prompt_len": len(prompts[0]), "decode_new_tokens": args.max_new,
        "nodes_meaning": "draft-tree nodes per request; each request feeds root + nodes tokens (nodes 0 = plain step)",
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    write_results_json(RESULTS / "verify_cost.json",
                       {"summary": summary, "meta": meta, "decode": decode, "paired_b1_ctx512": paired,
                        "paired_compute_probe_us": probes, "grid": rows, "fp32_grid": fp32_rows, "skipped": skipped})
    (RESULTS / "verify_cost.md").write_text(_markdown(summary, meta, rows, skipped))
    print(json.dumps(summary, indent=2))


def _ms_per_extra_token(summary: dict) -> float:
    return (summary["step_ms_b1_n32_ctx512"] - summary["plain_step_ms_b1_ctx512"]) / 32


def _markdown(summary: dict, meta: dict, rows: list[dict], skipped: list[str]) -> str:
    fmt = lambda v: "—" if v is None else f"{v:.3g}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = [
        "# verify_cost: TorchEngine step time (bf16, CPU) and plain decoding vs transformers generate", "",
        f"Model {meta['model']}, {meta['dtype']} on {meta['device']} ({meta['cpu']}), {meta['threads']} threads, "
        f"torch {meta['torch']}. Nodes = draft-tree nodes per request (each request feeds root + nodes tokens; "
        "0 = plain decoding step). Grid: medians of up to 5 calls after a warm-up (decoding: median over 5 prompts); the "
        "machine is shared with other jobs, so expect noise of 10-30% between grid points. The summary's batch-1 "
        f"ctx-512 step times come from {summary['paired_rounds']} interleaved rounds (every tree size once per round, "
        "order rotating); the verify-8 ratio is the median of the per-round ratios. Before each round a compute probe "
        "timed 16 rows through a 1024 x 576 layer in cache; rounds whose probe took over "
        f"{SLOW_COMPUTE:g}x the fastest are slow-compute rounds (this host's arithmetic speed moves by about 3x "
        "between seconds while its memory speed holds: the module docstring), and the ratio is also given over each "
        "kind.", "",
        "## Summary", "", "| key | value |", "|---|---|",
        *[f"| {k} | {fmt(v)} |" for k, v in summary.items()], "",
        "## Goals", "",
        f"- plain decoding >= transformers generate (bf16): {'met' if summary['goal_ar_ge_hf'] else 'MISSED'} "
        f"({fmt(summary['ar_tokens_per_s'])} vs {fmt(summary['hf_generate_tokens_per_s'])} tok/s).",
        f"- verifying 8 nodes at batch 1 <= 1.3x a plain step (ctx 512): "
        f"{'met' if summary['goal_verify8_le_1p3_plain'] else 'MISSED'} (ratio {fmt(summary['verify8_over_plain_b1_ctx512'])})"
        + ("" if summary["goal_verify8_le_1p3_plain"] else
           ". Where the numba kernels run (CPUs without AMX-BF16) every extra token is compute-bound: "
           f"about {fmt(_ms_per_extra_token(summary))} ms each at batch 1 (2 x 135M FLOPs at the kernels' FLOP/s), "
           "against a plain step that streams the weights once"
           if meta.get("cpu_kernels") in (True, "numba") else
           ". Where it is missed, the extra time is the tree path: SDPA with a mask over 9 tokens x 3 query heads "
           "per KV head instead of the mask-free single-row decode path, GEMMs of 9 rows instead of GEMVs, and the "
           "fp32 RoPE/RMSNorm on 9 rows") + ".",
        f"- bf16 vs fp32 on this CPU: plain step {fmt(summary['plain_step_ms_b1_ctx512'])} vs "
        f"{fmt(summary['fp32_plain_step_ms_b1_ctx512'])} ms; 8 nodes {fmt(summary['step_ms_b1_n8_ctx512'])} vs "
        f"{fmt(summary['fp32_step_ms_b1_n8_ctx512'])} ms; decoding {fmt(summary['ar_tokens_per_s'])} vs "
        f"{fmt(summary['ar_tokens_per_s_fp32'])} tok/s.", "",
        "## Step time (ms) by batch x nodes, per context", "",
    ]
    nodes = sorted({r["nodes"] for r in rows})
    for ctx in sorted({r["ctx"] for r in rows}):
        lines += [f"### ctx {ctx}", "", "| batch | " + " | ".join(f"n{n}" for n in nodes) + " |",
                  "|---|" + "---|" * len(nodes)]
        for b in sorted({r["batch"] for r in rows if r["ctx"] == ctx}):
            cells = [next((f"{r['step_ms']:.1f}" for r in rows if (r["batch"], r["nodes"], r["ctx"]) == (b, n, ctx)), "skip")
                     for n in nodes]
            lines.append(f"| {b} | " + " | ".join(cells) + " |")
        lines.append("")
    if skipped:
        lines += ["## Skipped points", "", ", ".join(skipped), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
