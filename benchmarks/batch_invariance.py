"""What batch-invariant bf16 verification buys and costs on the CPU (`TorchEngine.batch_invariant`).

    python -m benchmarks.batch_invariance        # about 10 minutes on 2 CPU cores

1. Identical outputs: 32 prompts (8 spread over each prompt set's eval prompts), 128 new tokens each, served at
   cap 8 by every speculating policy and by `none`, in bf16, once with batch-invariant numerics and once with the
   fused SDPA kernel; counts the outputs identical to `none`'s, token for token, and for each differing output the
   top-2 logit gap at the first differing position (`benchmarks.throughput.first_divergence_gap`).
2. Cost: plain greedy decoding of real prompts (growing contexts, commits) at batch 1, 4 and 32, both settings
   interleaved step by step in one process (this machine's noise hits both alike); verify seconds only.

Writes benchmarks/results/batch_invariance.json and .md.
"""

from __future__ import annotations

import argparse
import os
import platform
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
from trt_engines.torch_engine import TorchEngine


def decode_cost(prompts: list[np.ndarray], batches: list[int], steps: int) -> list[dict]:
    engines = {flag: TorchEngine("default", dtype=torch.bfloat16, num_blocks=4096, batch_invariant=flag)
               for flag in (False, True)}
    rows = []
    for b in batches:
        seconds = {flag: 0.0 for flag in engines}
        group = prompts[:b]
        for flag, engine in engines.items():
            for i, p in enumerate(group):
                engine.add_request(i, [int(t) for t in p])
        for _ in range(steps):
            for flag, engine in engines.items():
                started = time.perf_counter()
                out = engine.verify([VerifyItem(i, DraftTree.empty()) for i in range(b)])
                seconds[flag] += time.perf_counter() - started
                for r in out.results:
                    engine.commit(r.request_id, [], next_root=int(r.target_tokens[0]))
        for engine in engines.values():
            for i in range(b):
                engine.release(i)
        row = {"batch": b, "steps": steps, "fused_tokens_per_s": b * steps / seconds[False],
               "invariant_tokens_per_s": b * steps / seconds[True],
               "invariant_over_fused_time": seconds[True] / seconds[False]}
        rows.append(row)
        print(f"plain decoding, batch {b}: fused {row['fused_tokens_per_s']:.1f} tok/s, batch-invariant "
              f"{row['invariant_tokens_per_s']:.1f} tok/s (time x{row['invariant_over_fused_time']:.3f})", flush=True)
    return rows


def write_markdown(path: Path, result: dict) -> None:
    lines = ["# Batch-invariant bf16 verification: identical outputs and cost", "",
             f"Command: `{result['command']}` on {result['machine']}. Model: SmolLM2-135M-Instruct, bf16, TorchEngine.",
             f"{result['prompts']} prompts ({result['prompts'] // len(result['sets'])} spread over each of "
             f"{', '.join(result['sets'])}), {result['max_tokens']} new tokens, cap {result['cap']}.", "",
             "## Outputs identical to plain decoding (`none`), token for token", "",
             "| policy | batch-invariant | fused SDPA |", "|---|---|---|"]
    on, off = result["identity"]["invariant"], result["identity"]["fused"]
    for policy in on["per_policy"]:
        a, b = on["per_policy"][policy], off["per_policy"][policy]
        lines.append(f"| {policy} | {a['identical']}/{a['compared']} | {b['identical']}/{b['compared']} |")
    lines.append(f"| all | {on['identical']}/{on['compared']} ({on['identical_outputs_fraction']:.0%}) | "
                 f"{off['identical']}/{off['compared']} ({off['identical_outputs_fraction']:.0%}) |")
    for name, part in (("batch-invariant", on), ("fused", off)):
        gaps = part["first_divergence_top2_gaps"]
        if gaps:
            lines.append(f"\n{name}: top-2 logit gap at the first differing position: median {np.median(gaps):.3f}, "
                         f"max {max(gaps):.3f} over {len(gaps)} differing outputs.")
    lines += ["", "Batch-invariant outputs still differ where an accepted path left its tree's first-child chain "
              "(its keys then sit behind masked siblings, see `trt_engines/torch_engine.py`).", "",
              "## Cost: plain decoding, both settings interleaved step by step", "",
              "| batch | fused tok/s | batch-invariant tok/s | time ratio |", "|---|---|---|---|"]
    for row in result["cost"]:
        lines.append(f"| {row['batch']} | {row['fused_tokens_per_s']:.1f} | {row['invariant_tokens_per_s']:.1f} | "
                     f"{row['invariant_over_fused_time']:.3f} |")
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-set", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--cap", type=int, default=8)
    parser.add_argument("--decode-steps", type=int, default=64)
    args = parser.parse_args(argv)
    torch.set_num_threads(os.cpu_count() or 2)
    sets = list(PROMPT_SETS)
    prompts = [t.prompt_ids for name in sets
               for t in spread(load_trajectories(trajectory_path(name, "eval")), args.per_set)]
    started = time.perf_counter()
    result = {
        "sets": sets, "prompts": len(prompts), "max_tokens": args.max_tokens, "cap": args.cap,
        "identity": {name: identity_check(prompts, list(POLICIES), max_tokens=args.max_tokens, cap=args.cap,
                                          dtype=torch.bfloat16, batch_invariant=flag)
                     for name, flag in (("invariant", True), ("fused", False))},
        "cost": decode_cost(prompts, [1, 4, 32], args.decode_steps),
    }
    result["summary"] = {
        "identical_fraction_invariant": result["identity"]["invariant"]["identical_outputs_fraction"],
        "identical_fraction_fused": result["identity"]["fused"]["identical_outputs_fraction"],
        **{f"plain_time_ratio_b{row['batch']}": row["invariant_over_fused_time"] for row in result["cost"]},
    }
    result["seconds"] = round(time.perf_counter() - started, 1)
    result["command"] = shlex.join(["python", "-m", "benchmarks.batch_invariance",
                                    *(argv if argv is not None else sys.argv[1:])])
    result["machine"] = f"{platform.machine()} {os.cpu_count()} cores"
    print(save_results("batch_invariance", result, write_markdown).read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
