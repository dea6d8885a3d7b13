"""GPU validation of the roofline step-time model: `TorchEngine.verify` on real model shapes with random weights.

    python -m benchmarks.gpu_verify_cost                       # Llama-3.1-8B shape, bf16, on the CUDA device
    python -m benchmarks.gpu_verify_cost --model llama-3.1-8b --budget-s 420

Grid: batch {1, 4, 16, 32, 64} x tree nodes per request {0, 1, 3, 7, 15, 31, 63} x context {512, 2048, 8192},
skipping points whose KV cache (batch x (context + nodes + 1)) exceeds `--max-kv-tokens`. Requests are synthetic
(random K/V: step time does not depend on the values); trees are bushy random trees. Each point: a warm-up call,
then the median of 5 timed calls (the engine synchronises CUDA before reading its clock).

Compared with the roofline of the same shape on the matching datasheet entry (`H100-SXM`, `H200`, ... by device
name) and on the device's measured profile (`orchestrator.profiling.measure_hardware("cuda")`): the pure roofline
(no fitted coefficients) and the fitted model (least squares on even-indexed points, errors on odd-indexed ones).
Without CUDA it says so and exits 0: nothing is measured or written. Inputs are a config JSON only (no weights), so
the command runs on a bare GPU machine with this repository copied over.

Writes benchmarks/results/gpu_verify_cost.json (+ .md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"
BATCHES = (1, 4, 16, 32, 64)
NODES = (0, 1, 3, 7, 15, 31, 63)
CONTEXTS = (512, 2048, 8192)


def datasheet_for(device_name: str) -> str | None:
    name = device_name.upper()
    for key, needle in (("H200", "H200"), ("H100-SXM", "H100"), ("A100-80GB", "A100"), ("L40S", "L40S")):
        if needle in name:
            return key
    return None


def bushy_tree(n: int, rng: np.random.Generator, vocab: int):
    from drafter.tree import DraftTree

    if n == 0:
        return DraftTree.empty()
    parents = [-1] + [int(rng.integers(max(-1, i - 3), i)) for i in range(1, n)]
    return DraftTree.from_arrays(tokens=rng.integers(0, vocab, n), parents=parents)


def run(model_name: str, *, budget_s: float, max_kv_tokens: int) -> dict:
    import torch

    from orchestrator.profiling import measure_hardware
    from orchestrator.roofline import KNOWN_HARDWARE, ModelShape, StepTimeModel
    from tools.simulate import model_config
    from trt_engines.base import VerifyItem
    from trt_engines.llama import Transformer
    from trt_engines.torch_engine import TorchEngine

    config = {"rope_theta": 500000.0, "rms_norm_eps": 1e-5, "model_type": "llama", **model_config(model_name)}
    device = torch.device("cuda")
    model = Transformer.random(config, dtype=torch.bfloat16, device=device)
    max_ctx = max(CONTEXTS) + max(NODES) + 2
    engine = TorchEngine(model, dtype=torch.bfloat16, device=device, max_context=max_ctx,
                         num_blocks=-(-(max_kv_tokens + 64 * (max(NODES) + 1)) // 16))
    rng = np.random.default_rng(0)
    points = sorted(((b, n, c) for c in CONTEXTS for b in BATCHES for n in NODES if b * (c + n + 1) <= max_kv_tokens),
                    key=lambda p: (p[0] * p[2], p[0] * p[1]))
    rows, skipped = [], []
    started = time.perf_counter()
    active = None
    for b, n, c in points:
        if time.perf_counter() - started > budget_s:
            skipped.append(f"b{b}_n{n}_ctx{c}")
            continue
        if active != (b, c):
            for rid in list(engine.requests):
                engine.release(rid)
            for i in range(b):
                engine.add_synthetic_request(f"s{i}", c)
            active = (b, c)
        items = [VerifyItem(f"s{i}", bushy_tree(n, rng, engine.vocab_size)) for i in range(b)]
        engine.verify(items)
        times = [engine.verify(items).timings["total_ms"] for _ in range(5)]
        rows.append({"batch": b, "nodes": n, "context": c, "ms": statistics.median(times)})
        print(f"b={b:<3d} nodes={n:<3d} ctx={c:<5d} {rows[-1]['ms']:8.2f} ms", flush=True)

    shape = ModelShape.from_config(config)
    measured = measure_hardware("cuda")
    profiles = {"measured": measured}
    sheet = datasheet_for(torch.cuda.get_device_name(device))
    if sheet:
        profiles[sheet] = KNOWN_HARDWARE[sheet]
    tokens = [np.full(r["batch"], r["nodes"] + 1.0) for r in rows]
    context = [np.full(r["batch"], float(r["context"])) for r in rows]
    seconds = np.array([r["ms"] / 1e3 for r in rows])
    comparison = {}
    for label, spec in profiles.items():
        pure = StepTimeModel(shape, spec)
        pure_pred = np.array([pure.predict(t, c) for t, c in zip(tokens, context)])
        fitted = StepTimeModel(shape, spec)
        train = list(range(0, len(rows), 2))
        test = list(range(1, len(rows), 2)) or train
        fitted.fit([(tokens[i], context[i], seconds[i]) for i in train])
        fit_pred = np.array([fitted.predict(tokens[i], context[i]) for i in test])
        for r, p in zip(rows, pure_pred):
            r[f"roofline_ms_{label}"] = p * 1e3
        comparison[label] = {
            "hardware": spec.name,
            "pure_roofline_median_abs_rel_err": float(np.median(np.abs(pure_pred / seconds - 1))),
            "pure_roofline_median_ratio_measured_over_predicted": float(np.median(seconds / pure_pred)),
            "fitted_median_abs_rel_err_heldout": float(np.median(np.abs(fit_pred / seconds[test] - 1))),
            "fitted_coefficients": fitted.coefficients.tolist(),
            "free_budget_tokens": pure.free_budget(),
        }
    return {"model": model_name, "device": torch.cuda.get_device_name(device), "torch": torch.__version__,
            "rows": rows, "skipped": skipped, "comparison": comparison,
            "measured_hardware": {"peak_flops": measured.peak_flops, "mem_bandwidth": measured.mem_bandwidth,
                                  "overhead_s": measured.overhead_s}}


def write_markdown(path: Path, result: dict) -> None:
    labels = list(result["comparison"])
    lines = [
        f"# GPU verify cost: TorchEngine on {result['device']} vs the roofline model",
        "",
        f"Command: `{result['command']}`. Model shape {result['model']} (random weights, bf16), torch {result['torch']}.",
        "",
        "| batch | nodes | context | measured ms | " + " | ".join(f"roofline ms ({x})" for x in labels) + " |",
        "|---|---|---|---|" + "---|" * len(labels),
    ]
    for r in result["rows"]:
        lines.append(f"| {r['batch']} | {r['nodes']} | {r['context']} | {r['ms']:.2f} | "
                     + " | ".join(f"{r[f'roofline_ms_{x}']:.2f}" for x in labels) + " |")
    lines += ["", "## Roofline vs measured", "", "```json", json.dumps(result["comparison"], indent=2), "```"]
    if result["skipped"]:
        lines += ["", f"Skipped (time budget): {', '.join(result['skipped'])}"]
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-3.1-8b", help="bundled shape (tools/model_shapes) or config.json")
    parser.add_argument("--budget-s", type=float, default=420.0, help="stop timing new points after this long")
    parser.add_argument("--max-kv-tokens", type=int, default=160_000, help="skip points with a larger KV cache")
    parser.add_argument("--out-dir", default=str(RESULTS))
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu_verify_cost: no CUDA device here (torch.cuda.is_available() is False); nothing was measured. "
              "Run it on a GPU machine: python -m benchmarks.gpu_verify_cost")
        return 0
    result = run(args.model, budget_s=args.budget_s, max_kv_tokens=args.max_kv_tokens)
    result["command"] = "python -m benchmarks.gpu_verify_cost" + (
        f" --model {args.model}" if args.model != "llama-3.1-8b" else "")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_verify_cost.json").write_text(json.dumps(result, indent=2) + "\n")
    write_markdown(out / "gpu_verify_cost.md", result)
    print((out / "gpu_verify_cost.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
