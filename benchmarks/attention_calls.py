"""How eagerly `TorchEngine` should split a step's attention into SDPA calls: verify-step time under each
candidate `CALL_COST` of `trt_engines.attention_groups` (the planner's price of one more call).

    python -m benchmarks.attention_calls [--repeats 15]

Shapes: plain steps at batch 16 and 32 over spread contexts; batch 4 with mixed and with equal trees; batch 8 with
one deep tree among plain or 1-node requests; batch 16 with random trees of 0-8 nodes; batch 2 with one deep tree.
Contexts are synthetic (random K/V in the paged cache). For each shape, every candidate is timed in turn within each
repeat (interleaved, so a burst of background load hits them alike); the table reports the median verify-call time
and the number of calls the planner made. `one` never splits. Writes benchmarks/results/attention_calls.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from pathlib import Path

import numpy as np

import trt_engines.attention_groups as attention_groups
from benchmarks.verify_cost import random_tree
from trt_engines.base import VerifyItem
from trt_engines.cpu_kernels import cpu_description
from trt_engines.torch_engine import TorchEngine

RESULTS = Path(__file__).parent / "results"
CANDIDATES = (1024.0, 4096.0, 8192.0, 16384.0, float("inf"))


def shapes(rng: np.random.Generator) -> dict[str, tuple[list[int], list[int]]]:
    """name -> (draft nodes per request, context per request)."""
    return {
        "b16 plain, ctx 150-600": ([0] * 16, rng.integers(150, 600, 16).tolist()),
        "b32 plain, ctx 100-700": ([0] * 32, rng.integers(100, 700, 32).tolist()),
        "b4 trees 8/4/2/2": ([8, 4, 2, 2], [420, 380, 300, 350]),
        "b4 trees 4/4/4/4": ([4] * 4, [420, 380, 300, 350]),
        "b8 one 32-node tree, rest plain": ([32] + [0] * 7, rng.integers(300, 600, 8).tolist()),
        "b8 one 16-node tree, rest 1": ([16] + [1] * 7, rng.integers(300, 600, 8).tolist()),
        "b16 trees 0-8": (rng.integers(0, 9, 16).tolist(), rng.integers(150, 600, 16).tolist()),
        "b2 one 24-node tree, one plain": ([24, 0], [500, 500]),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)
    engine = TorchEngine("default")
    rng = np.random.default_rng(1)
    default = attention_groups.CALL_COST
    rows = []
    try:
        for name, (nodes, context) in shapes(rng).items():
            for rid in list(engine.requests):
                engine.release(rid)
            for i, c in enumerate(context):
                engine.add_synthetic_request(f"r{i}", int(c))
            items = [VerifyItem(f"r{i}", random_tree(int(n), rng)) for i, n in enumerate(nodes)]
            rows_per_request = np.asarray(nodes) + 1
            keys = np.asarray(context) + rows_per_request
            times: dict[float, list[float]] = {c: [] for c in CANDIDATES}
            calls = {}
            for cost in CANDIDATES:  # warm-up, and the planner's split under each candidate
                attention_groups.CALL_COST = cost
                engine.verify(items)
                calls[cost] = len(attention_groups.plan_attention_groups(rows_per_request, keys))
            for _ in range(args.repeats):
                for cost in CANDIDATES:
                    attention_groups.CALL_COST = cost
                    times[cost].append(engine.verify(items).timings["total_ms"])
            medians = {c: statistics.median(t) for c, t in times.items()}
            best = min(medians.values())
            row = {"shape": name, "nodes": nodes, "context": context,
                   "candidates": [{"call_cost": None if c == float("inf") else c, "calls": calls[c],
                                   "median_ms": medians[c], "vs_fastest": medians[c] / best} for c in CANDIDATES]}
            rows.append(row)
            print(name, "  ".join(f"{_label(c)}: {calls[c]} calls {medians[c]:.1f} ms" for c in CANDIDATES), flush=True)
    finally:
        attention_groups.CALL_COST = default
    command = shlex.join(["python", "-m", "benchmarks.attention_calls", *(argv if argv is not None else sys.argv[1:])])
    result = {"command": command, "machine": cpu_description(),
              "repeats": args.repeats, "default_call_cost": default, "rows": rows}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "attention_calls.json").write_text(json.dumps(result, indent=1) + "\n")
    (RESULTS / "attention_calls.md").write_text(markdown(result))
    print(markdown(result))


def _label(cost: float | None) -> str:
    return "one" if cost is None or cost == float("inf") else str(int(cost))


def markdown(result: dict) -> str:
    labels = [_label(c["call_cost"]) for c in result["rows"][0]["candidates"]]
    lines = [
        "# Attention calls: verify-step time by the planner's price of one more SDPA call",
        "",
        f"Command: `{result['command']}`. Model: SmolLM2-135M-Instruct, bf16, TorchEngine (grouped attention) on "
        f"{result['machine']}. Median of {result['repeats']} interleaved verify calls per cell, in ms, with the "
        f"number of attention calls per layer; ratio to the row's fastest in brackets. `one` never splits. "
        f"The engine's default: CALL_COST = {int(result['default_call_cost'])}.",
        "",
        "| shape | " + " | ".join(f"CALL_COST {lab}" for lab in labels) + " |",
        "|---|" + "---|" * len(labels),
    ]
    for row in result["rows"]:
        cells = [f"{c['median_ms']:.1f} ms, {c['calls']} calls ({c['vs_fastest']:.2f})" for c in row["candidates"]]
        lines.append(f"| {row['shape']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
