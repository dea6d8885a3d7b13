"""How eagerly `TorchEngine` should split a step's attention into SDPA calls: verify-step time under each
candidate price of one more call (`TorchEngine.attention_call_cost`, `trt_engines.attention_groups.call_cost_for`).

    python -m benchmarks.attention_calls [--repeats 15]                          # SmolLM2, bf16, this CPU
    python -m benchmarks.attention_calls --device cuda --model llama-3.1-8b      # random weights, on a GPU

Shapes: plain steps at batch 16 and 32 over spread contexts; batch 4 with mixed and with equal trees; batch 8 with
one deep tree among plain or 1-node requests; batch 16 with random trees of 0-8 nodes; batch 2 with one deep tree;
batch 32 with one 63-node tree among plain requests at 2k keys (where splitting must pay on any device). Contexts
are synthetic (random K/V in the paged cache). For each shape, every candidate is timed in turn within each repeat
(interleaved, so a burst of background load hits them alike); the table reports the median verify-call time and the
number of calls the planner made. `one` never splits. On the CPU the engine runs PyTorch's attention
(`cpu_kernels="torch"`): the numba kernels attend each request alone and never plan calls. Writes
benchmarks/results/attention_calls.{json,md} (`attention_calls_cuda.*` on a GPU).
"""

from __future__ import annotations

import argparse
import shlex
import statistics
from pathlib import Path

import numpy as np

from benchmarks.gpu_verify_cost import bushy_tree, random_weight_config
from benchmarks.results_files import RESULTS, write_results_json
from trt_engines.attention_groups import call_cost_for, plan_attention_groups
from trt_engines.base import VerifyItem

CANDIDATES = {"cpu": (1024.0, 4096.0, 8192.0, 16384.0, float("inf")),
              "cuda": (8192.0, 65536.0, 2.0**19, 2.0**21, float("inf"))}


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
        "b32 one 63-node tree, rest plain, ctx 2k": ([63] + [0] * 31, rng.integers(1900, 2100, 32).tolist()),
    }


def build_engine(device: str, model: str | None):
    """The default model on the CPU (PyTorch attention), or a bundled shape with random weights."""
    import torch

    from trt_engines.torch_engine import TorchEngine

    if model is None:
        return TorchEngine("default", device=device, cpu_kernels="torch"), "SmolLM2-135M-Instruct"
    from trt_engines.llama import Transformer

    weights = Transformer.random(random_weight_config(model), dtype=torch.bfloat16, device=torch.device(device))
    engine = TorchEngine(weights, dtype=torch.bfloat16, device=device, num_blocks=32 * 2200 // 16 + 64,
                         max_context=2200, cpu_kernels="torch" if device == "cpu" else "auto")
    return engine, f"{model} (random weights)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--model", default=None, help="a bundled shape (e.g. llama-3.1-8b) with random weights; "
                                                      "default: the default model's own weights")
    parser.add_argument("--out-dir", default=str(RESULTS))
    args = parser.parse_args(argv)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("no CUDA device: nothing measured")
            return 0
    engine, model_label = build_engine(args.device, args.model)
    candidates = CANDIDATES[args.device]
    rng = np.random.default_rng(1)
    default = engine.attention_call_cost
    rows = []
    try:
        for name, (nodes, context) in shapes(rng).items():
            for rid in list(engine.requests):
                engine.release(rid)
            for i, c in enumerate(context):
                engine.add_synthetic_request(f"r{i}", int(c))
            items = [VerifyItem(f"r{i}", bushy_tree(int(n), rng, engine.vocab_size)) for i, n in enumerate(nodes)]
            rows_per_request = np.asarray(nodes) + 1
            keys = np.asarray(context) + rows_per_request
            times: dict[float, list[float]] = {c: [] for c in candidates}
            calls = {}
            for cost in candidates:  # warm-up, and the planner's split under each candidate
                engine.attention_call_cost = cost
                engine.verify(items)
                calls[cost] = len(plan_attention_groups(rows_per_request, keys, call_cost=cost))
            for _ in range(args.repeats):
                for cost in candidates:
                    engine.attention_call_cost = cost
                    times[cost].append(engine.verify(items).timings["total_ms"])
            medians = {c: statistics.median(t) for c, t in times.items()}
            best = min(medians.values())
            row = {"shape": name, "nodes": nodes, "context": context,
                   "candidates": [{"call_cost": None if c == float("inf") else c, "calls": calls[c],
                                   "median_ms": medians[c], "vs_fastest": medians[c] / best} for c in candidates]}
            rows.append(row)
            print(name, "  ".join(f"{_label(c)}: {calls[c]} calls {medians[c]:.1f} ms" for c in candidates), flush=True)
    finally:
        engine.attention_call_cost = default
    flags = [f"--repeats={args.repeats}", f"--device={args.device}"] + ([f"--model={args.model}"] if args.model else [])
    command = shlex.join(["python", "-m", "benchmarks.attention_calls", *flags])
    result = {"command": command, "machine": machine(args.device), "model": model_label, "device": args.device,
              "repeats": args.repeats, "default_call_cost": call_cost_for(args.device), "rows": rows}
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = "attention_calls" if args.device == "cpu" else f"attention_calls_{args.device}"
    write_results_json(out / f"{stem}.json", result, indent=1)
    (out / f"{stem}.md").write_text(markdown(result))
    print(markdown(result))
    return 0


def machine(device: str) -> str:
    if device == "cuda":
        import torch

        return torch.cuda.get_device_name()
    from trt_engines.cpu_kernels import cpu_description

    return cpu_description()


def _label(cost: float | None) -> str:
    return "one" if cost is None or cost == float("inf") else str(int(cost))


def markdown(result: dict) -> str:
    labels = [_label(c["call_cost"]) for c in result["rows"][0]["candidates"]]
    lines = [
        "# Attention calls: verify-step time by the planner's price of one more SDPA call",
        "",
        f"Command: `{result['command']}`. Model: {result.get('model', 'SmolLM2-135M-Instruct')}, bf16, TorchEngine "
        f"(grouped attention) on {result['machine']}. Median of {result['repeats']} interleaved verify calls per cell, "
        f"in ms, with the number of attention calls per layer; ratio to the row's fastest in brackets. "
        f"`one` never splits. The engine's price on this device: {int(result['default_call_cost'])} units "
        f"(`attention_groups.call_cost_for`).",
        "",
        "| shape | " + " | ".join(f"call cost {lab}" for lab in labels) + " |",
        "|---|" + "---|" * len(labels),
    ]
    for row in result["rows"]:
        cells = [f"{c['median_ms']:.1f} ms, {c['calls']} calls ({c['vs_fastest']:.2f})" for c in row["candidates"]]
        lines.append(f"| {row['shape']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
