"""GPU validation of the roofline step-time model: `TorchEngine.verify` on real model shapes with random weights.

    python -m benchmarks.gpu_verify_cost                       # Llama-3.1-8B shape, bf16, on the CUDA device
    python -m benchmarks.gpu_verify_cost --model llama-3.1-8b --budget-s 420
    python -m benchmarks.gpu_verify_cost --device cpu --model smollm2-135m --quick --out-dir /tmp/x   # dry run

Grid: batch {1, 4, 16, 32, 64} x tree nodes per request {0, 1, 3, 7, 15, 31, 63} x context {512, 2048, 8192},
skipping points whose KV cache (batch x (context + nodes + 1)) exceeds `--max-kv-tokens`. Requests are synthetic
(random K/V: step time does not depend on the values); trees are bushy random trees. Each point: a warm-up call,
then the median of 5 timed calls (the engine synchronises CUDA before reading its clock).

Compared with the roofline of the same shape on the matching datasheet entry (`H100-SXM`, `H200`, ... by device
name) and on the device's measured profile (`orchestrator.profiling.measure_hardware("cuda")`): the pure roofline
(no fitted coefficients) and the fitted model (least squares on even-indexed points, errors on odd-indexed ones).
Before timing, a losslessness check on the same device: a random-weight model of the default model's shape in fp32
(1) gives the same logits through our packed, paged forward as `transformers`' LlamaForCausalLM with the same weights,
and (2) decodes greedily to the same tokens with adversarial draft trees as without speculation.

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

from benchmarks.results_files import RESULTS, write_results_json

BATCHES = (1, 4, 16, 32, 64)
NODES = (0, 1, 3, 7, 15, 31, 63)
CONTEXTS = (512, 2048, 8192)


def datasheet_for(device_name: str) -> str | None:
    name = device_name.upper()
    for key, needle in (("H200", "H200"), ("H100-SXM", "H100"), ("A100-80GB", "A100"), ("L40S", "L40S")):
        if needle in name:
            return key
    return None


def random_weight_config(model_name: str) -> dict:
    """A bundled shape (`tools.simulate.model_config`) as a Llama config for `Transformer.random`: Llama-3's RoPE
    base and norm epsilon, without the shape file's `_`-prefixed notes."""
    from tools.simulate import model_config

    config = {"rope_theta": 500000.0, "rms_norm_eps": 1e-5, "model_type": "llama", **model_config(model_name)}
    return {k: v for k, v in config.items() if not k.startswith("_")}


def bushy_tree(n: int, rng: np.random.Generator, vocab: int):
    from drafter.tree import DraftTree

    if n == 0:
        return DraftTree.empty()
    parents = [-1] + [int(rng.integers(max(-1, i - 3), i)) for i in range(1, n)]
    return DraftTree.from_arrays(tokens=rng.integers(0, vocab, n), parents=parents)


def adversarial_tree(rng: np.random.Generator, truth: list[int], vocab: int):
    """The true continuation (cut at a random depth) hidden among random decoy branches."""
    from drafter.tree import DraftTree

    depth = int(rng.integers(0, min(len(truth), 8) + 1))
    tokens, parents = list(truth[:depth]), [i - 1 for i in range(depth)]
    for _ in range(int(rng.integers(0, 12))):
        parents.append(int(rng.integers(-1, len(tokens))))
        tokens.append(int(rng.integers(0, vocab)))
    return DraftTree.from_arrays(tokens=tokens, parents=parents) if tokens else DraftTree.empty()


def check_lossless(device_name: str, *, n_prompts: int = 8, new_tokens: int = 64) -> dict:
    """fp32 on `device_name`: our forward vs transformers' logits, and speculative vs plain greedy tokens."""
    import tempfile

    import torch
    import transformers

    from orchestrator.spec_loop import generate
    from tools.simulate import model_config
    from trt_engines.llama import Transformer
    from trt_engines.torch_engine import TorchEngine

    device = torch.device(device_name)
    config = {k: v for k, v in model_config("smollm2-135m").items() if not k.startswith("_")}
    hf_config = transformers.LlamaConfig(**config, rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                                         bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_config).to(device=device, dtype=torch.float32).eval()
    with tempfile.TemporaryDirectory() as folder:
        hf.save_pretrained(folder, safe_serialization=True)
        model = Transformer.from_folder(folder, dtype=torch.float32, device=device)
    engine = TorchEngine(model, dtype=torch.float32, device=device, num_blocks=512, max_context=1024)
    rng = np.random.default_rng(0)
    vocab = config["vocab_size"]
    prompts = [rng.integers(3, vocab, int(rng.integers(3, 200))).tolist() for _ in range(n_prompts)]
    ours = engine.debug_logits(prompts[:3])
    with torch.no_grad():
        logits_gap = max(float((hf(torch.tensor([p], device=device)).logits[0] - got).abs().max()) for p, got in
                         zip(prompts[:3], ours))
    plain, _ = generate(engine, prompts, max_new_tokens=new_tokens, stop_at_eos=False, id_prefix="plain")
    reference = {f"spec-{i}": p + out for i, (p, out) in enumerate(zip(prompts, plain))}

    def draft(rid, context: list[int]):
        return adversarial_tree(rng, reference[rid][len(context):], vocab)

    spec, stats = generate(engine, prompts, max_new_tokens=new_tokens, stop_at_eos=False, draft_fn=draft,
                           id_prefix="spec")
    identical = sum(a == b for a, b in zip(plain, spec))
    return {"device": device_name, "model_shape": "smollm2-135m (random weights, fp32)", "prompts": n_prompts,
            "new_tokens": new_tokens, "max_abs_logit_diff_vs_transformers": logits_gap,
            "identical_outputs_fraction": identical / n_prompts,
            "accepted_draft_tokens": int(sum(s.accepted for s in stats)),
            "mean_tokens_per_step": float(sum(len(o) for o in spec) / max(1, sum(s.steps for s in stats))),
            "free_blocks_after": engine.free_blocks(), "total_blocks": engine.total_blocks()}


def device_busy_ms(engine, items, calls: int = 3) -> float | None:
    """Median over `calls` verify calls of the summed duration of the GPU kernels each one ran.

    An eager PyTorch forward is host-bound at small batches (about 1,200 kernel launches per step for an 8B shape):
    the GPU idles between kernels, so wall time measures the launch path, not the device. Busy time is what the
    roofline predicts, and what an engine without launch overhead (TensorRT-LLM, CUDA graphs) gets close to."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    if engine.device.type != "cuda":
        return None
    busy = []
    try:
        for _ in range(calls):
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                engine.verify(items)
            kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            busy.append(sum(e.time_range.elapsed_us() for e in kernels) / 1e3)
    except (AttributeError, RuntimeError) as exc:  # a profiler without kernel events: keep the wall times
        print(f"device busy time not available from the profiler ({exc})", flush=True)
        return None
    return statistics.median(busy) if any(busy) else None


def profile_verify(engine, items, label: str) -> str:
    """torch.profiler tables of 5 verify calls: where host and device time go."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(5):
            engine.verify(items)
    averages = prof.key_averages()
    device_key = "self_cuda_time_total" if engine.device.type == "cuda" else "self_cpu_time_total"
    return "\n".join([f"### {label} (5 calls)", "", "By host (self CPU) time:", "",
                      averages.table(sort_by="self_cpu_time_total", row_limit=20), "", "By device time:", "",
                      averages.table(sort_by=device_key, row_limit=12), ""])


def compare(rows: list[dict], shape, profiles: dict) -> dict:
    """Per hardware profile: the pure roofline against wall and busy times, and a fitted model's held-out error
    (least squares on even-indexed points, errors on odd-indexed ones). Adds `roofline_ms_<profile>` to each row."""
    from orchestrator.roofline import StepTimeModel

    tokens = [np.full(r["batch"], r["nodes"] + 1.0) for r in rows]
    context = [np.full(r["batch"], float(r["context"])) for r in rows]
    train = list(range(0, len(rows), 2))
    test = list(range(1, len(rows), 2)) or train

    def heldout_error(spec, seconds: np.ndarray) -> tuple[float, list]:
        fitted = StepTimeModel(shape, spec)
        fitted.fit([(tokens[i], context[i], seconds[i]) for i in train])
        predicted = np.array([fitted.predict(tokens[i], context[i]) for i in test])
        return float(np.median(np.abs(predicted / seconds[test] - 1))), fitted.coefficients.tolist()

    seconds = np.array([r["ms"] / 1e3 for r in rows])
    busy = None if any(r.get("device_busy_ms") is None for r in rows) else np.array(
        [r["device_busy_ms"] / 1e3 for r in rows])
    comparison = {}
    for label, spec in profiles.items():
        pure = StepTimeModel(shape, spec)
        pure_pred = np.array([pure.predict(t, c) for t, c in zip(tokens, context)])
        for r, p in zip(rows, pure_pred):
            r[f"roofline_ms_{label}"] = p * 1e3
        err, coefficients = heldout_error(spec, seconds)
        comparison[label] = {
            "hardware": spec.name,
            "pure_roofline_median_abs_rel_err": float(np.median(np.abs(pure_pred / seconds - 1))),
            "pure_roofline_median_ratio_measured_over_predicted": float(np.median(seconds / pure_pred)),
            "fitted_median_abs_rel_err_heldout": err,
            "fitted_coefficients": coefficients,
            "free_budget_tokens": pure.free_budget(),
        }
        if busy is not None:
            busy_err, busy_coefficients = heldout_error(spec, busy)
            comparison[label].update({
                "pure_roofline_vs_device_busy_median_abs_rel_err": float(np.median(np.abs(pure_pred / busy - 1))),
                "pure_roofline_vs_device_busy_median_ratio": float(np.median(busy / pure_pred)),
                "fitted_to_device_busy_median_abs_rel_err_heldout": busy_err,
                "fitted_to_device_busy_coefficients": busy_coefficients,
            })
    return comparison


LAYOUT_NODES, LAYOUT_CONTEXT, LAYOUT_BATCHES = 60, 2048, (4, 16, 32)


def layout_check(engine, rng: np.random.Generator, *, repeats: int) -> list[dict]:
    """The same 60 tree nodes per step, spread evenly over the batch or all on one request: a packed (varlen)
    attention costs the same either way, a padded one makes every request pay for the deepest tree."""
    from trt_engines.base import VerifyItem

    out = []
    for b in LAYOUT_BATCHES:
        for rid in list(engine.requests):
            engine.release(rid)
        for i in range(b):
            engine.add_synthetic_request(f"s{i}", LAYOUT_CONTEXT)
        even = [LAYOUT_NODES // b + (i < LAYOUT_NODES % b) for i in range(b)]
        for kind, nodes in (("even", even), ("one deep tree", [LAYOUT_NODES] + [0] * (b - 1))):
            items = [VerifyItem(f"s{i}", bushy_tree(n, rng, engine.vocab_size)) for i, n in enumerate(nodes)]
            engine.verify(items)
            wall = statistics.median(engine.verify(items).timings["total_ms"] for _ in range(repeats))
            row = {"batch": b, "context": LAYOUT_CONTEXT, "kind": kind, "nodes": nodes, "ms": wall,
                   "device_busy_ms": device_busy_ms(engine, items)}
            out.append(row)
            print(f"layout check b={b:<3d} {kind:14s} {wall:8.2f} ms, busy {row['device_busy_ms'] or 0:.2f}", flush=True)
    return out


def predict_layouts(layout_rows: list[dict], shape, measured, comparison: dict, call_cost: float) -> None:
    """Each layout row's busy time as predicted by the model fitted to the grid's busy times (uniform trees, where
    the layouts agree), once per attention layout ("grouped" at the engine's price of a call, `call_cost`)."""
    from orchestrator.roofline import ATTENTION_LAYOUTS, StepTimeModel

    coefficients = comparison.get("fitted_to_device_busy_coefficients")
    if coefficients is None:
        return
    for row in layout_rows:
        tokens = 1.0 + np.asarray(row["nodes"], np.float64)
        context = np.full(len(row["nodes"]), float(row["context"]))
        for layout in ATTENTION_LAYOUTS:
            model = StepTimeModel(shape, measured, coefficients=np.asarray(coefficients), attention_layout=layout,
                                  attention_call_cost=call_cost)
            row[f"predicted_busy_ms_{layout}"] = model.predict(tokens, context) * 1e3


def run(model_name: str, *, budget_s: float, max_kv_tokens: int, device_name: str = "cuda", quick: bool = False,
        repeats: int = 9, profile_points: tuple = ()) -> dict:
    import torch

    from orchestrator.profiling import measure_hardware
    from orchestrator.roofline import KNOWN_HARDWARE, ModelShape
    from trt_engines.base import VerifyItem
    from trt_engines.llama import Transformer
    from trt_engines.torch_engine import TorchEngine

    config = random_weight_config(model_name)
    device = torch.device(device_name)
    batches, nodes, contexts = ((1, 4), (0, 7), (512,)) if quick else (BATCHES, NODES, CONTEXTS)
    model = Transformer.random(config, dtype=torch.bfloat16, device=device)
    max_ctx = max(contexts) + max(nodes) + 2
    engine = TorchEngine(model, dtype=torch.bfloat16, device=device, max_context=max_ctx,
                         num_blocks=-(-(max_kv_tokens + max(batches) * (max(nodes) + 1)) // 16) + max(batches))
    rng = np.random.default_rng(0)
    points = sorted(((b, n, c) for c in contexts for b in batches for n in nodes if b * (c + n + 1) <= max_kv_tokens),
                    key=lambda p: (p[0] * p[2], p[0] * p[1]))
    rows, skipped, profiles_text = [], [], []
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
        timings = [engine.verify(items).timings for _ in range(repeats)]
        row = {"batch": b, "nodes": n, "context": c}
        for key in ("total", "prepare", "forward", "sample"):
            row["ms" if key == "total" else f"{key}_ms"] = statistics.median(t[f"{key}_ms"] for t in timings)
        row["min_ms"] = min(t["total_ms"] for t in timings)
        row["device_busy_ms"] = device_busy_ms(engine, items)
        rows.append(row)
        print(f"b={b:<3d} nodes={n:<3d} ctx={c:<5d} {row['ms']:8.2f} ms (min {row['min_ms']:.2f}, forward "
              f"{row['forward_ms']:.2f}, prepare {row['prepare_ms']:.2f}, sample {row['sample_ms']:.2f}, "
              f"busy {row['device_busy_ms'] or 0:.2f})", flush=True)
        if (b, n, c) in profile_points:
            profiles_text.append(profile_verify(engine, items, f"b={b} nodes={n} ctx={c}"))

    layout_rows = [] if quick else layout_check(engine, rng, repeats=repeats)
    measured = measure_hardware(device_name)
    profiles = {"measured": measured}
    device_label = torch.cuda.get_device_name(device) if device.type == "cuda" else measured.name
    sheet = datasheet_for(device_label) if device.type == "cuda" else None
    if sheet:
        profiles[sheet] = KNOWN_HARDWARE[sheet]
    comparison = compare(rows, ModelShape.from_config(config), profiles)
    predict_layouts(layout_rows, ModelShape.from_config(config), measured, comparison["measured"],
                    engine.attention_call_cost)
    return {"model": model_name, "device": device_label, "torch": torch.__version__,
            "rows": rows, "skipped": skipped, "comparison": comparison, "profiles": profiles_text,
            "layout_rows": layout_rows, "engine_attention_layout": engine.attention_layout,
            "measured_hardware": {"name": measured.name, "peak_flops": measured.peak_flops,
                                  "mem_bandwidth": measured.mem_bandwidth, "overhead_s": measured.overhead_s}}


def write_markdown(path: Path, result: dict) -> None:
    labels = list(result["comparison"])
    lines = [
        f"# GPU verify cost: TorchEngine on {result['device']} vs the roofline model",
        "",
        f"Command: `{result['command']}`. Model shape {result['model']} (random weights, bf16), torch {result['torch']}.",
        "",
    ]
    if "lossless" in result:
        x = result["lossless"]
        lines += [
            "## Losslessness on this device",
            "",
            (f"{x['model_shape']}, {x['prompts']} prompts x {x['new_tokens']} greedy tokens with adversarial draft "
            f"trees: identical outputs **{x['identical_outputs_fraction']:.0%}**, max |logit difference| vs "
            f"`transformers` {x['max_abs_logit_diff_vs_transformers']:.2e}, {x['accepted_draft_tokens']} draft tokens "
            f"accepted ({x['mean_tokens_per_step']:.2f} tokens per step), KV blocks free after: "
            f"{x['free_blocks_after']}/{x['total_blocks']}."),
            "",
        ]
    lines += [
        "## Roofline vs measured",
        "",
        ("| profile | hardware | pure roofline: median abs err | measured / predicted (median) "
        "| fitted: median abs err (held out) | free budget (tokens) |"),
        "|---|---|---|---|---|---|",
    ]
    for label, c in result["comparison"].items():
        lines.append(f"| {label} | {c['hardware']} | {c['pure_roofline_median_abs_rel_err']:.1%} | "
                     f"{c['pure_roofline_median_ratio_measured_over_predicted']:.2f} | "
                     f"{c['fitted_median_abs_rel_err_heldout']:.1%} | {c['free_budget_tokens']:.0f} |")
    if all("pure_roofline_vs_device_busy_median_abs_rel_err" in c for c in result["comparison"].values()):
        lines += ["", "Against the GPU's busy time (the summed kernel durations of one step, from the profiler):", "",
                  ("| profile | pure roofline: median abs err | busy / predicted (median) "
                   "| fitted to busy: median abs err (held out) |"), "|---|---|---|---|"]
        lines += [f"| {label} | {c['pure_roofline_vs_device_busy_median_abs_rel_err']:.1%} | "
                  f"{c['pure_roofline_vs_device_busy_median_ratio']:.2f} | "
                  f"{c['fitted_to_device_busy_median_abs_rel_err_heldout']:.1%} |"
                  for label, c in result["comparison"].items()]
        fit = result["comparison"]["measured"]["fitted_to_device_busy_coefficients"]
        lines += ["", ("Reading: fitted to busy time with the measured profile, the model's coefficients are "
                  f"{fit[1]:.2f} x the roofline of the linear layers, {fit[2]:.2f} x that of attention (the engine "
                  "gathers each group's KV blocks into a contiguous buffer before SDPA, so it moves the cache about "
                  f"three times) and a fixed {fit[0] * 1e3:.1f} ms per step (norms, RoPE, gathers: small kernels). "
                  "Wall time is higher again at small batches: eager PyTorch launches every kernel from Python, "
                  "and the GPU waits for the host (see `gpu_profile.txt` when written with `--profile`).")]
    m = result["measured_hardware"]
    lines += ["", "Measured profile: " + ", ".join(f"{k} {v / 1e12:.0f} TFLOP/s" for k, v in m["peak_flops"].items())
              + f", bandwidth {m['mem_bandwidth'] / 1e12:.2f} TB/s, overhead {m['overhead_s'] * 1e6:.0f} us.", ""]
    lines += [
        "## Step times",
        "",
        "Wall ms: median of the timed `verify` calls (host included); busy ms: GPU kernel time of one call.",
        "",
        "| batch | nodes | context | wall ms | busy ms | " + " | ".join(f"roofline ms ({x})" for x in labels) + " |",
        "|---|---|---|---|---|" + "---|" * len(labels),
    ]
    for r in result["rows"]:
        busy = "" if r.get("device_busy_ms") is None else f"{r['device_busy_ms']:.2f}"
        lines.append(f"| {r['batch']} | {r['nodes']} | {r['context']} | {r['ms']:.2f} | {busy} | "
                     + " | ".join(f"{r[f'roofline_ms_{x}']:.2f}" for x in labels) + " |")
    rows = result.get("layout_rows") or []
    layouts = [x for x in ("packed", "grouped", "padded") if rows and all(f"predicted_busy_ms_{x}" in r for r in rows)]
    if layouts:
        # results written before the engine grouped its attention calls carry no layout: it was one padded call
        engine_layout = result.get("engine_attention_layout", "padded")
        lines += ["", f"## Attention layout: {LAYOUT_NODES} tree nodes per step, spread evenly or on one request",
                  "", (f"The engine measured here lays attention out as `{engine_layout}`. Predicted busy time: the "
                  "model fitted to the grid's busy times (uniform trees), in each `StepTimeModel.attention_layout`."),
                  "", "| batch | context | nodes | wall ms | busy ms | "
                  + " | ".join(f"predicted busy ms, {x}" for x in layouts) + " |", "|---|---|---|---|---|" + "---|" * len(layouts)]
        lines += [f"| {r['batch']} | {r['context']} | {r['kind']} | {r['ms']:.2f} | {r['device_busy_ms']:.2f} | "
                  + " | ".join(f"{r[f'predicted_busy_ms_{x}']:.2f}" for x in layouts) + " |" for r in rows]
    if result["skipped"]:
        lines += ["", f"Skipped (time budget): {', '.join(result['skipped'])}"]
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-3.1-8b", help="bundled shape (tools/model_shapes) or config.json")
    parser.add_argument("--budget-s", type=float, default=420.0, help="stop timing new points after this long")
    parser.add_argument("--max-kv-tokens", type=int, default=160_000, help="skip points with a larger KV cache")
    parser.add_argument("--device", default="cuda", help="cuda (the benchmark); cpu only for a dry run of the code path")
    parser.add_argument("--quick", action="store_true", help="a 4-point grid (dry runs)")
    parser.add_argument("--skip-lossless", action="store_true", help="time only; skip the losslessness check")
    parser.add_argument("--repeats", type=int, default=9, help="timed verify calls per point (the median is kept)")
    parser.add_argument("--profile", action="store_true",
                        help="also write torch.profiler tables of the smallest and largest point (gpu_profile.txt)")
    parser.add_argument("--out-dir", default=str(RESULTS))
    args = parser.parse_args(argv)
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_verify_cost: no CUDA device here (torch.cuda.is_available() is False); nothing was measured. "
              "Run it on a GPU machine: python -m benchmarks.gpu_verify_cost")
        return 0
    lossless = None if args.skip_lossless else check_lossless(args.device)
    if lossless:
        print(f"lossless check: {json.dumps(lossless)}", flush=True)
    points = ((1, 0, 512), (4, 7, 512)) if args.quick else ((1, 0, 512), (1, 15, 2048), (64, 15, 2048))
    result = run(args.model, budget_s=args.budget_s, max_kv_tokens=args.max_kv_tokens, device_name=args.device,
                 quick=args.quick, repeats=args.repeats, profile_points=points if args.profile else ())
    profiles_text = result.pop("profiles")
    if lossless:
        result["lossless"] = lossless
    flags = [f"--model {args.model}"] if args.model != "llama-3.1-8b" else []
    flags += [f"--device {args.device}"] if args.device != "cuda" else []
    flags += ["--quick"] if args.quick else []
    result["command"] = " ".join(["python -m benchmarks.gpu_verify_cost", *flags])
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_results_json(out / "gpu_verify_cost.json", result)
    write_markdown(out / "gpu_verify_cost.md", result)
    if profiles_text:
        (out / "gpu_profile.txt").write_text("\n".join(profiles_text))
    print((out / "gpu_verify_cost.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
