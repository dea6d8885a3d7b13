"""Which SDPA kernels a CUDA verify step should run: the engine's choice, every backend but cuDNN
(`torch_engine.SHAPE_STABLE_SDPA_BACKENDS`), against PyTorch's own, which puts cuDNN first on Hopper in recent
builds. Each choice runs in a process of its own, since a per-shape cache lives as long as its process.

    python -m benchmarks.gpu_sdpa_backends                                        # on the CUDA device, a few minutes
    python -m benchmarks.gpu_sdpa_backends --device cpu --quick --out-dir /tmp/x  # dry run of the code path

In each process: `gpu_orchestrator`'s model, prompts and datastore (Llama-3.1-8B's shape, random weights, bf16; the
model's greedy outputs for every other prompt), at each cap `none` and `fixed:4` served alone one after the other,
in two passes over the same prompts. The second pass repeats the first's batches, so it meets only shapes the first
met: a per-shape setup cost shows as a first pass slower than the second. (`none`'s first pass follows the plain
decoding that built the datastore, which met many of its shapes already.) Reports per run: tokens/s, the median
verify step with no tree in the batch and with one, and which SDPA ops ran (the profiler, over a few steps served
after the timed runs).

Without CUDA (and without --device cpu) it says so and exits 0. Writes gpu_sdpa_backends.json (+ .md) to --out-dir.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.gpu_orchestrator import RESULTS, answers_datastore, build, repeating_prompts, serve_together
from benchmarks.results_files import write_results_json

CHOICES = ("engine", "pytorch")  # SHAPE_STABLE_SDPA_BACKENDS / PyTorch's own priority order
POLICIES = ("none", "fixed:4")
ROW_PREFIX = "ROW "


def serve_alone(engine, step_model, policy: str, prompts, *, cap: int, max_tokens: int, datastores) -> dict:
    """`policy` over `prompts` with nothing beside it (`gpu_orchestrator.serve_together`), without its outputs."""
    run, = serve_together(engine, step_model, ((policy, 1),), prompts, cap=cap, max_tokens=max_tokens,
                          datastores=datastores)
    del run["outputs"]
    return run


def sdpa_ops(engine, step_model, prompts, *, max_tokens: int, datastores) -> list[str]:
    """The SDPA ops that a few `fixed:4` steps over `prompts` ran (from the profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        serve_alone(engine, step_model, "fixed:4", prompts, cap=len(prompts), max_tokens=max_tokens,
                    datastores=datastores)
    return sorted({e.key for e in prof.key_averages()
                   if e.key.startswith("aten::_scaled_dot_product") or "cudnn_attention" in e.key})


def child(choice: str, device_name: str, model_name: str, caps: tuple[int, ...], max_tokens: int) -> None:
    """Measure one choice in this process; prints a `ROW_PREFIX` JSON line per run and one with the ops."""
    import torch

    from trt_engines import torch_engine

    if choice == "pytorch":  # measurement only: the forwards run in PyTorch's own SDPA priority order
        torch_engine.sdpa_backends_for = lambda device: contextlib.nullcontext()
    device = torch.device(device_name)
    engine, step_model, _ = build(model_name, torch.bfloat16, device, num_blocks=4096, max_context=1024)
    rng = np.random.default_rng(1)
    prompts_by_cap = {cap: repeating_prompts(2 * cap, engine.vocab_size, rng) for cap in caps}
    with tempfile.TemporaryDirectory(prefix="gpu-sdpa-") as folder:
        datastores = (answers_datastore(engine, list(prompts_by_cap.values()), max_tokens=max_tokens,
                                        folder=Path(folder)),)
        for cap, prompts in prompts_by_cap.items():
            for pass_number in (1, 2):
                for policy in POLICIES:
                    row = serve_alone(engine, step_model, policy, prompts, cap=cap, max_tokens=max_tokens,
                                      datastores=datastores)
                    row.update(choice=choice, **{"pass": pass_number})
                    print(ROW_PREFIX + json.dumps(row), flush=True)
        ops = sdpa_ops(engine, step_model, prompts_by_cap[caps[-1]][:4], max_tokens=4, datastores=datastores)
    print(ROW_PREFIX + json.dumps({"choice": choice, "sdpa_ops": ops}), flush=True)


def measure(device_name: str, model_name: str, caps: tuple[int, ...], max_tokens: int) -> dict:
    """Each choice in a fresh process (`child`); their rows and ops."""
    rows, ops = [], {}
    for choice in CHOICES:
        command = [sys.executable, "-m", "benchmarks.gpu_sdpa_backends", "--child", choice, "--device", device_name,
                   "--model", model_name, "--max-tokens", str(max_tokens), "--caps", *map(str, caps)]
        done = subprocess.run(command, capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent)
        if done.returncode != 0:
            raise RuntimeError(f"gpu_sdpa_backends: the '{choice}' process failed ({done.returncode}):\n"
                               f"{done.stderr[-4000:]}")
        for line in done.stdout.splitlines():
            if line.startswith(ROW_PREFIX):
                record = json.loads(line[len(ROW_PREFIX):])
                if "sdpa_ops" in record:
                    ops[choice] = record["sdpa_ops"]
                else:
                    rows.append(record)
                    print(f"{choice:8s} cap {record['cap']:<3d} pass {record['pass']} {record['policy']:8s} "
                          f"{record['tokens_per_s']:8.1f} tok/s, plain step {record['plain_step_ms'] or 0:6.1f} ms, "
                          f"tree step {record['tree_step_ms'] or 0:6.1f} ms", flush=True)
    return {"rows": rows, "sdpa_ops": ops}


def readings(rows: list[dict]) -> list[str]:
    """Per choice and cap: `fixed:4` against `none` in each pass, and each policy's second pass against its first."""
    out = []
    for choice in CHOICES:
        for cap in sorted({r["cap"] for r in rows}):
            get = {(r["pass"], r["policy"]): r for r in rows if r["choice"] == choice and r["cap"] == cap}
            if len(get) < 2 * len(POLICIES):
                continue
            spec = [get[p, "fixed:4"]["tokens_per_s"] / get[p, "none"]["tokens_per_s"] for p in (1, 2)]
            repeat = [get[2, policy]["tokens_per_s"] / get[1, policy]["tokens_per_s"] for policy in POLICIES]
            out += [f"{choice}, cap {cap}: `fixed:4` ran at {spec[0]:.2f}x `none`'s tokens/s in the first pass and "
                    f"{spec[1]:.2f}x in the second; the second pass ran at "
                    + " and ".join(f"{x:.2f}x (`{policy}`)" for x, policy in zip(repeat, POLICIES))
                    + " the first's.", ""]
    return out


def write_markdown(path: Path, result: dict) -> None:
    lines = [f"# SDPA backends of CUDA verify steps on {result['device']}", "",
             f"Command: `{result['command']}`. torch {result['torch']}. {result['model_shape']}, "
             f"{result['max_tokens']} tokens per request, twice the cap's requests; each choice in a process of its "
             "own. 'engine': every SDPA backend but cuDNN (`torch_engine.SHAPE_STABLE_SDPA_BACKENDS`); 'pytorch': "
             "PyTorch's own order. "
             "Step ms: the median verify step with no tree in the batch (plain) and with one (tree).", "",
             "| choice | cap | pass | policy | tok/s | steps | tree steps | plain step ms | tree step ms |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        ms = [f"{r[k]:.1f}" if r[k] is not None else "-" for k in ("plain_step_ms", "tree_step_ms")]
        lines.append(f"| {r['choice']} | {r['cap']} | {r['pass']} | {r['policy']} | {r['tokens_per_s']:.1f} | "
                     f"{r['steps']} | {r['tree_steps']} | {ms[0]} | {ms[1]} |")
    lines += ["", *readings(result["rows"]), "SDPA ops that ran:", ""]
    lines += [f"- {choice}: " + (", ".join(f"`{op}`" for op in ops) or "none") for choice, ops in
              result["sdpa_ops"].items()]
    if result.get("notes"):
        lines += ["", "## Notes", ""] + [line for note in result["notes"] for line in (note, "")]
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda (the benchmark); cpu only for a dry run")
    parser.add_argument("--model", default="llama-3.1-8b", help="bundled shape")
    parser.add_argument("--quick", action="store_true", help="the default model's shape, short requests (dry runs)")
    parser.add_argument("--caps", type=int, nargs="+", default=[1, 16], help="concurrency caps (default 1 16)")
    parser.add_argument("--max-tokens", type=int, default=None, help="tokens per request (default 48; --quick 8)")
    parser.add_argument("--out-dir", default=str(RESULTS))
    parser.add_argument("--note", action="append", default=[], help="a paragraph for the results' Notes section")
    parser.add_argument("--child", choices=CHOICES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    max_tokens = args.max_tokens if args.max_tokens is not None else 8 if args.quick else 48
    if min(args.caps) < 1 or max_tokens < 1:
        parser.error(f"--caps and --max-tokens must be >= 1; got {args.caps} and {max_tokens}")
    model_name = "smollm2-135m" if args.quick else args.model
    if args.child:
        child(args.child, args.device, model_name, tuple(args.caps), max_tokens)
        return 0
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_sdpa_backends: no CUDA device here (torch.cuda.is_available() is False); nothing was measured. "
              "Run it on a GPU machine: python -m benchmarks.gpu_sdpa_backends")
        return 0
    result = {"device": torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu",
              "torch": torch.__version__, "model_shape": f"{model_name} (random weights, bf16)",
              "max_tokens": max_tokens,
              "command": " ".join(["python -m benchmarks.gpu_sdpa_backends"]
                                  + ([f"--device {args.device}"] if args.device != "cuda" else [])
                                  + ([f"--model {args.model}"] if args.model != "llama-3.1-8b" else [])
                                  + (["--quick"] if args.quick else [])
                                  + (["--caps", *map(str, args.caps)] if args.caps != [1, 16] else [])
                                  + ([f"--max-tokens {args.max_tokens}"] if args.max_tokens is not None else []))}
    if args.note:
        result["notes"] = args.note
    result.update(measure(args.device, model_name, tuple(args.caps), max_tokens))
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_results_json(out / "gpu_sdpa_backends.json", result)
    write_markdown(out / "gpu_sdpa_backends.md", result)
    print((out / "gpu_sdpa_backends.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
