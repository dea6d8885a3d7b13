"""What reading a row's keys as one run saves whole prefills: the CPU tree-attention kernel
(`trt_engines.cpu_kernels.tree_attention_bits`) takes a row that sees every new token of its segment up to the
last one it sees (every row of a causal prefill, every row of a chain) through contiguous loops
(`TreeAttentionLayout.one_run`), where it used to gather each row's keys through the mask, one scalar test and
copy per key (`mask_every_row=True`, how every row ran before; the same bits). The default engine (bf16, its numba
kernels) prefills one prompt of 128 to 2048 tokens, no prefix cache hits.

    .venv/bin/python -m benchmarks.prefill_attention [--rounds 8]

The two ways alternate prefill by prefill (which goes first alternating), so background load on this shared
machine hits them alike; times are medians over rounds; attention ms is the prefill's attention calls summed (the
timing wrapper `benchmarks.cpu_attention.TimedAttention`). Both ways must give the same first token (checked here;
the bits are tested in `tests/test_cpu_kernels.py`). Writes benchmarks/results/prefill_attention.{json,md}.
"""

from __future__ import annotations

import statistics
import time

import numba
import numpy as np
import torch

import trt_engines.cpu_forward as cpu_forward
from benchmarks.cpu_attention import TimedAttention
from benchmarks.results_files import rounds_benchmark_main
from trt_engines.cpu_kernels import cpu_description
from trt_engines.torch_engine import TorchEngine

PROMPT_TOKENS = (128, 512, 1024, 2048)
WAYS = ("one run", "masked")


def measure(rounds: int) -> dict:
    engine = TorchEngine("default", dtype=torch.bfloat16, num_blocks=max(PROMPT_TOKENS) // 16 + 8)
    if not engine.kernel_attention:
        raise SystemExit("prefill_attention measures the numba tree-attention kernel; this engine runs PyTorch's "
                         "attention (cpu_kernels='torch')")
    timed = TimedAttention(cpu_forward.tree_attention_bits, WAYS, {"masked": {"mask_every_row": True}})
    cpu_forward.tree_attention_bits = timed
    rng = np.random.default_rng(0)
    rows = []

    def prefill(prompt: np.ndarray, way: str) -> tuple[float, int]:
        timed.label = way
        started = time.perf_counter()
        first = engine.add_request("p", prompt)
        seconds = time.perf_counter() - started
        engine.release("p")
        engine.reset_prefix_cache()  # every prefill computes the whole prompt
        return seconds, first

    try:
        for tokens in PROMPT_TOKENS:
            prompt = rng.integers(100, engine.vocab_size - 100, tokens)
            first = {way: prefill(prompt, way)[1] for way in WAYS}  # compiles; the same first token either way
            seconds: dict[str, list[float]] = {w: [] for w in WAYS}
            timed.reset()
            for r in range(rounds):
                for way in WAYS if r % 2 else WAYS[::-1]:
                    seconds[way].append(prefill(prompt, way)[0])
            run_s, masked_s = (statistics.median(seconds[w]) for w in WAYS)
            rows.append({"prompt_tokens": tokens, "one_run_prefill_ms": 1e3 * run_s,
                         "masked_prefill_ms": 1e3 * masked_s,
                         "one_run_over_masked": statistics.median(a / b for a, b in zip(seconds["one run"],
                                                                                        seconds["masked"])),
                         "one_run_attention_ms": 1e3 * timed.seconds["one run"] / rounds,
                         "masked_attention_ms": 1e3 * timed.seconds["masked"] / rounds,
                         "one_run_tokens_per_s": tokens / run_s, "masked_tokens_per_s": tokens / masked_s,
                         "same_first_token": first["one run"] == first["masked"]})
            print(rows[-1], flush=True)
    finally:
        cpu_forward.tree_attention_bits = timed.kernel
    return {"machine": cpu_description(), "threads": numba.get_num_threads(), "rounds": rounds, "rows": rows}


def write_markdown(path, result: dict) -> None:
    lines = [
        "# prefill_attention: prefill rows read their keys as one run instead of through the mask",
        "",
        f"Command: `python -m benchmarks.prefill_attention --rounds {result['rounds']}` on {result['machine']}, "
        f"{result['threads']} numba threads. Default model, bf16, the default engine's kernels; one prompt, whole "
        "prefill, no prefix cache hits. 'one run': each causal row's softmax and weights run over its keys in "
        "contiguous loops (the kernel now); 'masked': every row's keys go through the mask one by one (before). "
        f"Prefills of the two ways alternate; medians of {result['rounds']} rounds; attention ms: the prefill's "
        "attention calls (one a layer) summed, mean over rounds.",
        "",
        "| prompt tokens | prefill ms (one run) | prefill ms (masked) | one run / masked | attention ms (one run) "
        "| attention ms (masked) | prefill tok/s (one run) | prefill tok/s (masked) | same first token |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [f"| {r['prompt_tokens']} | {r['one_run_prefill_ms']:.0f} | {r['masked_prefill_ms']:.0f} | "
              f"{r['one_run_over_masked']:.3f} | {r['one_run_attention_ms']:.0f} | {r['masked_attention_ms']:.0f} | "
              f"{r['one_run_tokens_per_s']:.0f} | {r['masked_tokens_per_s']:.0f} | "
              f"{'yes' if r['same_first_token'] else 'NO'} |" for r in result["rows"]]
    lines.append("")
    path.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    return rounds_benchmark_main("prefill_attention", __doc__, measure, write_markdown, argv, default_rounds=8)


if __name__ == "__main__":
    raise SystemExit(main())
