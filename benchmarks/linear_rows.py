"""What each extra row costs the CPU linear kernel (`trt_engines.cpu_kernels.Bf16Linear`): every linear layer of the
default model (its shapes, random bf16 weights: values do not change the time) at 1..12 input rows, i.e. a verify
step of 0..11 draft tokens for one request (or a few requests' small trees), and one gate/up projection with its
weights in cache (3.5 MB, in L3), where the rows' FMAs alone set the time (a smaller layer would time the threads'
start-up instead).

    .venv/bin/python -m benchmarks.linear_rows [--rounds 40]

Rounds interleave the row counts (order rotating), so background load on this shared machine hits them alike;
reported times are medians over rounds. Writes benchmarks/results/linear_rows.{json,md}.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.results_files import rounds_benchmark_main
from orchestrator.roofline import ModelShape
from trt_engines.cpu_kernels import Bf16Linear, bf16_bits, cpu_description
from trt_engines.prepare import resolve_model_dir

ROWS = tuple(range(1, 13))
IN_CACHE_CALLS = 50


def model_linears(shape: ModelShape) -> list[Bf16Linear]:
    """The decoder's linear layers as the engine fuses them (q/k/v, o, gate/up, down per layer) and the LM head."""
    h, f = shape.hidden, shape.intermediate
    qkv = (shape.n_heads + 2 * shape.n_kv_heads) * shape.head_dim
    per_layer = [(qkv, h), (h, shape.n_heads * shape.head_dim), (2 * f, h), (h, f)]
    generator = torch.Generator().manual_seed(0)

    def layer(n: int, k: int) -> Bf16Linear:
        return Bf16Linear((torch.randn(n, k, generator=generator) * 0.02).to(torch.bfloat16))

    return [layer(n, k) for _ in range(shape.n_layers) for n, k in per_layer] + [layer(shape.vocab, h)]


def _inputs(rows: int, widths: set[int]) -> dict[int, np.ndarray]:
    return {k: bf16_bits(torch.randn(rows, k).to(torch.bfloat16)) for k in widths}


def measure(rounds: int) -> dict:
    shape = ModelShape.from_config(resolve_model_dir("default"))
    linears = model_linears(shape)
    weights = sum(layer.packed.nbytes for layer in linears)
    flops_per_row = sum(2 * layer.in_features * layer.out_features for layer in linears)
    inputs = {r: _inputs(r, {layer.in_features for layer in linears}) for r in ROWS}

    def model_pass(rows: int) -> float:
        started = time.perf_counter()
        for layer in linears:
            layer.bits(inputs[rows][layer.in_features])
        return time.perf_counter() - started

    for r in ROWS:  # compile every row count's kernels before timing
        model_pass(r)
    passes: dict[int, list[float]] = {r: [] for r in ROWS}
    for i in range(rounds):
        for r in ROWS[i % len(ROWS):] + ROWS[:i % len(ROWS)]:
            passes[r].append(model_pass(r))

    cached = Bf16Linear((torch.randn(2 * shape.intermediate, shape.hidden) * 0.02).to(torch.bfloat16))
    cached_rate: dict[int, list[float]] = {r: [] for r in ROWS}
    for i in range(rounds):
        for r in ROWS:
            x = inputs[r][shape.hidden]
            cached.bits(x)
            started = time.perf_counter()
            for _ in range(IN_CACHE_CALLS):
                cached.bits(x)
            seconds = (time.perf_counter() - started) / IN_CACHE_CALLS
            cached_rate[r].append(2 * cached.in_features * cached.out_features * r / seconds)

    one = statistics.median(passes[1])
    rows = [{"rows": r, "model_ms": 1e3 * statistics.median(passes[r]),
             "over_one_row": statistics.median(passes[r]) / one,
             "weight_stream_gb_per_s": weights / statistics.median(passes[r]) / 1e9,
             "model_gflop_per_s": flops_per_row * r / statistics.median(passes[r]) / 1e9,
             "in_cache_gflop_per_s": statistics.median(cached_rate[r]) / 1e9,
             "fma_only_model_ms": 1e3 * flops_per_row * r / statistics.median(cached_rate[r])}
            for r in ROWS]
    return {"machine": cpu_description(), "threads": torch.get_num_threads(), "rounds": rounds,
            "weight_mb": weights / 1e6, "gflop_per_row": flops_per_row / 1e9, "rows": rows}


def write_markdown(path: Path, result: dict) -> None:
    lines = [
        "# linear_rows: the CPU linear kernel's cost per input row",
        "",
        f"Command: `python -m benchmarks.linear_rows --rounds {result['rounds']}` on {result['machine']}. Every linear "
        f"layer of the default model (SmolLM2-135M's shapes, random bf16 weights, {result['weight_mb']:.0f} MB, "
        f"{result['gflop_per_row']:.2f} GFLOP per row) through `Bf16Linear`, medians of {result['rounds']} "
        "interleaved rounds. In cache: one gate/up projection, its weights in cache, "
        f"{IN_CACHE_CALLS} calls per round; 'FMAs alone' is the model's FLOPs at that rate.",
        "",
        "| rows | model ms | / 1 row | weights GB/s | model GFLOP/s | in-cache GFLOP/s | FMAs alone ms |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [f"| {r['rows']} | {r['model_ms']:.1f} | {r['over_one_row']:.2f} | {r['weight_stream_gb_per_s']:.1f} | "
              f"{r['model_gflop_per_s']:.0f} | {r['in_cache_gflop_per_s']:.0f} | {r['fma_only_model_ms']:.1f} |"
              for r in result["rows"]]
    lines += ["", "One row streams the weights from memory; further rows add their FMAs. Where 'model ms' is near the "
              "larger of the one-row time and 'FMAs alone', the streaming and the arithmetic overlap; where it is "
              "near their sum, they do not.", ""]
    path.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    return rounds_benchmark_main("linear_rows", __doc__, measure, write_markdown, argv)


if __name__ == "__main__":
    raise SystemExit(main())
