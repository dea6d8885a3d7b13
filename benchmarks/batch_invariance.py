"""Lossless bf16 speculation on the CPU, and what it costs: the engine's four ways to verify in bf16.

    python -m benchmarks.batch_invariance        # about 30 minutes on 2 CPU cores

Configurations (`TorchEngine` arguments):
- `numba`: the numba CPU kernels (`trt_engines.cpu_kernels`), batch-invariant by construction on every branch of a
  tree; the default on CPUs without AMX-BF16 (`cpu_kernels.auto_cpu_kernels`);
- `attention`: the numba attention kernel with PyTorch's linear layers (in the form whose rows oneDNN keeps
  batch-invariant, `llama.Linear.transposed`), likewise invariant on every branch; the default on CPUs with AMX-BF16;
- `invariant`: PyTorch's kernels in batch-invariant numerics (first-child chains only);
- `fused`: PyTorch's fused kernels (`batch_invariant=False`).

1. Identical outputs: 32 prompts (8 spread over each prompt set's eval prompts), 128 new tokens each, served at
   cap 8 by every speculating policy and by `none`, in bf16, in each configuration; counts the outputs identical to
   `none`'s, token for token, and for each differing output the top-2 logit gap at the first differing position
   (`benchmarks.throughput.first_divergence_gap`).
2. Cost: verify steps on real prompts (growing contexts, commits), plain at batch 1, 4 and 32 and with random
   draft trees (batch 1 with 4 and 16 nodes, batch 4 with 8), every configuration interleaved step by step in one
   process (this machine's noise hits all alike); verify seconds only.

Writes benchmarks/results/batch_invariance.json and .md.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.results_files import save_results
from benchmarks.throughput import POLICIES, identity_check
from drafter.tree import DraftTree
from tools.prompt_sets import PROMPT_SETS
from tools.trajectories import load_trajectories, spread, trajectory_path
from trt_engines.base import VerifyItem
from trt_engines.cpu_kernels import cpu_description
from trt_engines.torch_engine import TorchEngine

CONFIGS = {  # name -> TorchEngine arguments
    "numba": {"cpu_kernels": "numba", "batch_invariant": True},
    "attention": {"cpu_kernels": "attention", "batch_invariant": True},
    "invariant": {"cpu_kernels": "torch", "batch_invariant": True},
    "fused": {"cpu_kernels": "torch", "batch_invariant": False},
}
LABELS = {"numba": "numba kernels", "attention": "numba attention, PyTorch linear", "invariant": "PyTorch, batch-invariant",
          "fused": "PyTorch, fused"}
STEP_SHAPES = ((1, 0), (4, 0), (32, 0), (1, 4), (1, 16), (4, 8))  # (batch, draft nodes per request)


def _random_tree(n: int, rng: np.random.Generator) -> DraftTree:
    if n == 0:
        return DraftTree.empty()
    parents = [-1] + [int(rng.integers(max(-1, i - 3), i)) for i in range(1, n)]  # bushy, a few levels deep
    return DraftTree.from_arrays(tokens=rng.integers(0, 49152, n), parents=parents)


def step_cost(prompts: list[np.ndarray], shapes, steps: int) -> list[dict]:
    engines = {name: TorchEngine("default", dtype=torch.bfloat16, num_blocks=4096, **kwargs)
               for name, kwargs in CONFIGS.items()}
    rows = []
    for b, nodes in shapes:
        seconds = dict.fromkeys(engines, 0.0)
        group = [prompts[i % len(prompts)] for i in range(b)]  # fewer prompts than the batch: reuse them
        for engine in engines.values():
            for i, p in enumerate(group):
                engine.add_request(i, [int(t) for t in p])
        rng = np.random.default_rng(b * 100 + nodes)
        for _ in range(steps):
            trees = [_random_tree(nodes, rng) for _ in range(b)]  # the same trees for every configuration
            for name, engine in engines.items():
                started = time.perf_counter()
                out = engine.verify([VerifyItem(i, t) for i, t in zip(range(b), trees)])
                seconds[name] += time.perf_counter() - started
                for r in out.results:
                    engine.commit(r.request_id, [], next_root=int(r.target_tokens[0]))
        for engine in engines.values():
            for i in range(b):
                engine.release(i)
        row = {"batch": b, "nodes": nodes, "steps": steps,
               **{f"{name}_ms_per_step": 1e3 * seconds[name] / steps for name in engines},
               **{f"{name}_over_numba_time": seconds[name] / seconds["numba"] for name in engines}}
        rows.append(row)
        print(f"batch {b}, {nodes} nodes: " + ", ".join(f"{name} {row[f'{name}_ms_per_step']:.1f} ms" for name in engines),
              flush=True)
    return rows


def write_markdown(path: Path, result: dict) -> None:
    names = list(result["identity"])
    lines = ["# Lossless bf16 verification on the CPU: identical outputs and cost", "",
             f"Command: `{result['command']}` on {result['machine']}. Model: SmolLM2-135M-Instruct, bf16, TorchEngine.",
             f"{result['prompts']} prompts ({result['prompts'] // len(result['sets'])} spread over each of "
             f"{', '.join(result['sets'])}; for the configurations with PyTorch's linear layers "
             f"{result['identity']['fused']['prompts'] // len(result['sets'])} spread over each), "
             f"{result['max_tokens']} new tokens, cap {result['cap']}. Configurations: "
             "numba kernels (`trt_engines/cpu_kernels.py`: every row attends over exactly its visible keys, in order), "
             "the numba attention kernel with PyTorch's linear layers, PyTorch's kernels in batch-invariant numerics, "
             "PyTorch's fused kernels.", "",
             "## Outputs identical to plain decoding (`none`), token for token", "",
             "| policy | " + " | ".join(LABELS[n] for n in names) + " |", "|---" * (len(names) + 1) + "|"]
    first = result["identity"][names[0]]
    for policy in first["per_policy"]:
        cells = [result["identity"][n]["per_policy"][policy] for n in names]
        lines.append(f"| {policy} | " + " | ".join(f"{c['identical']}/{c['compared']}" for c in cells) + " |")
    lines.append("| all | " + " | ".join(
        f"{result['identity'][n]['identical']}/{result['identity'][n]['compared']} "
        f"({result['identity'][n]['identical_outputs_fraction']:.0%})" for n in names) + " |")
    for n in names:
        gaps = result["identity"][n]["first_divergence_top2_gaps"]
        if gaps:
            lines.append(f"\n{LABELS[n]}: top-2 logit gap at the first differing position: median "
                         f"{np.median(gaps):.3f}, max {max(gaps):.3f} over {len(gaps)} differing outputs.")
    lines += ["", "PyTorch's batch-invariant outputs still differ where an accepted path left its tree's first-child "
              "chain (its keys then sit behind masked siblings, see `trt_engines/torch_engine.py`).", "",
              "## Cost: verify steps, every configuration interleaved step by step", "",
              "| batch | nodes | " + " | ".join(f"{LABELS[n]} ms" for n in names) + " | "
              + " | ".join(f"{LABELS[n]} / numba" for n in names if n != "numba") + " |",
              "|---" * (2 + 2 * len(names) - 1) + "|"]
    for row in result["cost"]:
        lines.append(f"| {row['batch']} | {row['nodes']} | "
                     + " | ".join(f"{row[f'{n}_ms_per_step']:.1f}" for n in names) + " | "
                     + " | ".join(f"{row[f'{n}_over_numba_time']:.2f}" for n in names if n != "numba") + " |")
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-set", type=int, default=8)
    parser.add_argument("--per-set-torch", type=int, help="prompts per set for the configurations with PyTorch's linear "
                        "layers (default: --per-set); on a CPU without bf16 dot-product instructions their bf16 matmuls "
                        "are slow")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--cap", type=int, default=8)
    parser.add_argument("--decode-steps", type=int, default=48)
    args = parser.parse_args(argv)
    torch.set_num_threads(os.cpu_count() or 2)
    sets = list(PROMPT_SETS)

    def prompts_of(per_set: int) -> list[np.ndarray]:
        return [t.prompt_ids for name in sets for t in spread(load_trajectories(trajectory_path(name, "eval")), per_set)]

    prompts = prompts_of(args.per_set)
    torch_prompts = prompts_of(args.per_set_torch or args.per_set)
    started = time.perf_counter()
    result = {
        "sets": sets, "prompts": len(prompts), "max_tokens": args.max_tokens, "cap": args.cap,
        "identity": {name: identity_check(prompts if name == "numba" else torch_prompts, list(POLICIES),
                                          max_tokens=args.max_tokens, cap=args.cap, dtype=torch.bfloat16, **kwargs)
                     for name, kwargs in CONFIGS.items()},
        "cost": step_cost(prompts, STEP_SHAPES, args.decode_steps),
    }
    plain = {row["batch"]: row for row in result["cost"] if row["nodes"] == 0}
    result["summary"] = {
        **{f"identical_fraction_{name}": part["identical_outputs_fraction"] for name, part in result["identity"].items()},
        **{f"plain_ms_b{b}_{name}": row[f"{name}_ms_per_step"] for b, row in plain.items() for name in CONFIGS},
        **{f"step_ms_b{row['batch']}_n{row['nodes']}_{name}": row[f"{name}_ms_per_step"]
           for row in result["cost"] if row["nodes"] for name in CONFIGS},
    }
    result["seconds"] = round(time.perf_counter() - started, 1)
    result["command"] = shlex.join(["python", "-m", "benchmarks.batch_invariance",
                                    *(argv if argv is not None else sys.argv[1:])])
    result["machine"] = cpu_description()
    print(save_results("batch_invariance", result, write_markdown).read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
