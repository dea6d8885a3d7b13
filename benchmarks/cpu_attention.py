"""What the CPU tree-attention kernel costs whole verify steps, reading the KV pool's bf16 rows in its micro-kernels
(`trt_engines.cpu_kernels.tree_attention_bits`) against computing on widened fp32 copies of them, as every task did
before (`widened_copy=True`): the default engine (bf16, its numba attention kernel), one request at contexts 128,
512 and 2048, plain steps and draft trees of 4 and 16 nodes.

    .venv/bin/python -m benchmarks.cpu_attention [--rounds 40]

Inside real steps the keys and values come from wherever the step left them (the linear layers stream the weights
past every cache between two layers' attention), which a loop over the attention call alone does not reproduce.
The two ways alternate step by step (which goes first alternating), so background load on this shared machine hits
them alike; times are medians over rounds; attention ms is the step's attention calls summed (a timing wrapper
around the engine's `tree_attention_bits`). Both ways give the same bits (`tests/test_cpu_kernels.py`; the steps'
target tokens are checked equal here too). Writes benchmarks/results/cpu_attention.{json,md}.
"""

from __future__ import annotations

import statistics
import time

import numba
import numpy as np
import torch

import trt_engines.cpu_forward as cpu_forward
from benchmarks.results_files import rounds_benchmark_main
from benchmarks.verify_cost import random_tree
from trt_engines.base import VerifyItem
from trt_engines.cpu_kernels import cpu_description
from trt_engines.torch_engine import TorchEngine

CONTEXTS = (128, 512, 2048)
NODES = (0, 4, 16)
WAYS = ("pool", "copy")


class TimedAttention:
    """Stands in for `cpu_forward.tree_attention_bits` while a benchmark runs: the kernel, called with the keyword
    arguments `options[label]` of the way being measured (`label`), its seconds summed per label."""

    def __init__(self, kernel, labels: tuple[str, ...], options: dict[str, dict] | None = None):
        self.kernel, self.labels, self.options = kernel, labels, options or {}
        self.label = labels[0]
        self.seconds = dict.fromkeys(labels, 0.0)

    def reset(self) -> None:
        self.seconds = dict.fromkeys(self.labels, 0.0)

    def __call__(self, *args, **kwargs):
        started = time.perf_counter()
        out = self.kernel(*args, **self.options.get(self.label, {}), **kwargs)
        self.seconds[self.label] += time.perf_counter() - started
        return out


def measure(rounds: int) -> dict:
    engine = TorchEngine("default", dtype=torch.bfloat16, num_blocks=(max(CONTEXTS) + max(NODES) + 32) // 16 + 8)
    if not engine.kernel_attention:
        raise SystemExit("cpu_attention measures the numba tree-attention kernel; this engine runs PyTorch's "
                         "attention (cpu_kernels='torch')")
    timed = TimedAttention(cpu_forward.tree_attention_bits, WAYS,
                           {way: {"widened_copy": way == "copy"} for way in WAYS})
    cpu_forward.tree_attention_bits = timed
    rng = np.random.default_rng(0)
    rows = []
    try:
        for context in CONTEXTS:
            engine.add_synthetic_request("r", context)
            for nodes in NODES:
                items = [VerifyItem("r", random_tree(nodes, rng))]
                tokens = {}
                for way in WAYS:  # compiles both kernels; the same target tokens either way
                    timed.label = way
                    tokens[way] = engine.verify(items).results[0].target_tokens
                steps: dict[str, list[float]] = {w: [] for w in WAYS}
                timed.reset()
                for r in range(rounds):
                    for way in WAYS if r % 2 else WAYS[::-1]:
                        timed.label = way
                        steps[way].append(engine.verify(items).timings["total_ms"])
                pool_ms, copy_ms = (statistics.median(steps[w]) for w in WAYS)
                rows.append({"context": context, "nodes": nodes, "pool_step_ms": pool_ms, "copy_step_ms": copy_ms,
                             "pool_over_copy": pool_ms / copy_ms,
                             "pool_attention_ms": 1e3 * timed.seconds["pool"] / rounds,
                             "copy_attention_ms": 1e3 * timed.seconds["copy"] / rounds,
                             "same_tokens": bool(np.array_equal(tokens["pool"], tokens["copy"]))})
                print(rows[-1], flush=True)
            engine.release("r")
    finally:
        cpu_forward.tree_attention_bits = timed.kernel
    return {"machine": cpu_description(), "threads": numba.get_num_threads(), "rounds": rounds, "rows": rows}


def write_markdown(path, result: dict) -> None:
    lines = [
        "# cpu_attention: CPU tree attention reading the KV pool against widened copies, in whole verify steps",
        "",
        f"Command: `python -m benchmarks.cpu_attention --rounds {result['rounds']}` on {result['machine']}, "
        f"{result['threads']} numba threads. Default model, bf16, the default engine's kernels; one request; "
        "nodes = draft-tree nodes (0: a plain step). 'pool': the attention's micro-kernels read the pool's bf16 "
        "rows through the slots (the kernel now); 'copy': each task first widens its keys and values into fp32 "
        f"copies (before). Steps of the two ways alternate; medians of {result['rounds']} rounds; attention ms: the "
        "step's attention calls (one a layer) summed, mean over rounds.",
        "",
        "| context | nodes | step ms (pool) | step ms (copy) | pool / copy | attention ms (pool) | attention ms (copy) "
        "| same tokens |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [f"| {r['context']} | {r['nodes']} | {r['pool_step_ms']:.2f} | {r['copy_step_ms']:.2f} | "
              f"{r['pool_over_copy']:.3f} | {r['pool_attention_ms']:.2f} | {r['copy_attention_ms']:.2f} | "
              f"{'yes' if r['same_tokens'] else 'NO'} |" for r in result["rows"]]
    lines.append("")
    path.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    return rounds_benchmark_main("cpu_attention", __doc__, measure, write_markdown, argv)


if __name__ == "__main__":
    raise SystemExit(main())
