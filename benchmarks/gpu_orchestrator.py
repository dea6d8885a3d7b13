"""The serving core on a GPU: `Orchestrator` + `Drafter` + `TorchEngine` on CUDA, with every budget policy and with
micro-batches that take turns (SPIN §V: one micro-batch is drafted on the CPU while the other is verified).

    python -m benchmarks.gpu_orchestrator                                          # on the CUDA device
    python -m benchmarks.gpu_orchestrator --caps 16 --out-dir /tmp/x              # the speed part at cap 16 only
    python -m benchmarks.gpu_orchestrator --device cpu --quick --out-dir /tmp/x    # dry run of the code path

No checkpoint travels to a GPU machine, so the models are bundled shapes with random weights, and acceptance here
says nothing about real text. Two things are measured:

1. Lossless on this device. The default model's shape in fp32; requests with prompts of mixed length (random tokens
   with one stretch repeated), at most 8 running, through the orchestrator with every policy, with 2 micro-batches
   forced, and with micro-batches decided per step. The drafter runs on its prompt and self-output indexes (no
   datastore): this random model repeats itself enough for them. Outputs against plain greedy decoding
   (`orchestrator.spec_loop.generate`), token for token, and the KV blocks free afterwards.
2. The budget on a real shape's step times. Llama-3.1-8B's shape in bf16 at caps 1 and 16, the runs interleaved step
   by step: `none`, `fixed:4`, `fixed:16`, and `goodput` with one micro-batch per step, deciding per step, and with
   two forced. That random model hardly repeats itself, so the drafter also gets a datastore of its own greedy
   continuations of every other prompt: half the requests find their answer retrieved (retrieval's best case), the
   other half only what their prompt and output repeat. Output tokens/s, tokens per request-step, tree nodes per
   request-step, steps split into micro-batches, request-steps drafted ahead (during another micro-batch's verify) and
   the seconds of drafting that hid behind verifies, and the step-time model's median
   error (the datasheet roofline fitted at start-up by `fit_step_model`, then refit online from the steps).

`--passes 2` serves each cap's runs twice over the same prompts and reports both passes. `none` and `fixed:B`
repeat their batches in the second pass (greedy outputs, drafts from fresh indexes), so they meet only shapes the
first pass met; `goodput` mostly does (its step-time model and calibration keep learning). Where a GPU library sets
up per shape (cuDNN attention builds an execution graph per problem shape, `torch_engine.SHAPE_STABLE_SDPA_BACKENDS`),
the first pass pays for it and the second does not: the gap between the passes says how much such costs weigh.

Without CUDA (and without --device cpu) it says so and exits 0. Writes gpu_orchestrator.json (+ .md) to --out-dir
after the lossless part and after each cap, so a run stopped by a time limit keeps what it measured.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from benchmarks.gpu_verify_cost import datasheet_for, random_weight_config
from benchmarks.results_files import RESULTS, write_results_json

LOSSLESS_RUNS = (("none", 1), ("fixed:4", 1), ("fixed:16", 1), ("roofline", 1), ("goodput", 1),
                 ("fixed:4", 2), ("goodput", 2), ("goodput", None))
SPEED_RUNS = (("none", 1), ("fixed:4", 1), ("fixed:16", 1), ("goodput", 1), ("goodput", None), ("goodput", 2))


def repeating_prompts(n: int, vocab: int, rng: np.random.Generator) -> list[list[int]]:
    """Random tokens with one stretch of 8-16 tokens repeated three times among them, 30-200 tokens long."""
    prompts = []
    for _ in range(n):
        stretch = rng.integers(3, vocab, int(rng.integers(8, 17))).tolist()
        prompt: list[int] = []
        for _ in range(3):
            prompt += rng.integers(3, vocab, int(rng.integers(4, 50))).tolist() + stretch
        prompts.append(prompt)
    return prompts


def build(model_name: str, dtype, device, *, num_blocks: int, max_context: int):
    """A random-weight engine of a bundled shape, and the step-time model fitted to it at start-up."""
    import torch

    from orchestrator.profiling import fit_step_model, measure_hardware
    from orchestrator.roofline import KNOWN_HARDWARE, ModelShape, StepTimeModel
    from trt_engines.llama import Transformer
    from trt_engines.torch_engine import TorchEngine

    config = random_weight_config(model_name)
    model = Transformer.random(config, dtype=dtype, device=device)
    engine = TorchEngine(model, dtype=dtype, device=device, num_blocks=num_blocks, max_context=max_context)
    dtype_name = "float32" if dtype == torch.float32 else "bfloat16"
    sheet = datasheet_for(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    hardware = KNOWN_HARDWARE[sheet] if sheet else measure_hardware(device.type, dtypes=(dtype_name,))
    step_model = StepTimeModel.for_engine(engine, ModelShape.from_config(config), hardware, dtype=dtype_name)
    fit_error = fit_step_model(engine, step_model)
    return engine, step_model, fit_error


def answers_datastore(engine, prompt_groups: list[list[list[int]]], *, max_tokens: int, folder: Path):
    """A datastore (built in `folder`) of the model's own greedy continuations, `max_tokens` long, of every other
    prompt of each group (plain decoding, here). A random model hardly repeats itself, so the drafter gets this too:
    half the requests then find their answer retrieved (the best case of retrieval), the other half only what their
    prompt and output repeat."""
    from datastore import Datastore, build_from_token_docs
    from orchestrator.spec_loop import generate

    docs = []
    for group, prompts in enumerate(prompt_groups):
        answered = prompts[::2]
        reference, _ = generate(engine, answered, max_new_tokens=max_tokens, stop_at_eos=False,
                                id_prefix=f"ref{group}")
        docs += [np.asarray(p + r, np.int64) for p, r in zip(answered, reference)]
    return Datastore.open(build_from_token_docs(docs, folder / "answers", vocab_size=engine.vocab_size,
                                                tokenizer_id="random-weights"))


def serve_together(engine, step_model, runs: tuple, prompts: list[list[int]], *, cap: int, max_tokens: int,
                   datastores: tuple = ()) -> list[dict]:
    """Every (policy, micro-batches) run over the same prompts (all submitted at once, at most `cap` running, each
    request exactly `max_tokens` long, EOS ignored), side by side as the throughput benchmark serves its policies
    (`benchmarks.throughput.PolicyRun`, `interleave`): the run furthest behind in its work steps next, so a drift of
    the machine's speed hits every run alike, and each run's time is the sum of its own steps."""
    from benchmarks.throughput import PolicyRun, interleave
    from drafter.drafter import Drafter, DrafterConfig

    drafter = Drafter(DrafterConfig(sources="fused" if datastores else "input", max_budget=64),
                      datastores=datastores, vocab_size=engine.vocab_size)
    free_before = engine.free_blocks()
    engine.reset_prefix_cache()
    active = [PolicyRun(engine, drafter.fresh(), step_model, policy, prompts, cap=cap, max_tokens=max_tokens,
                        lengths=[max_tokens] * len(prompts), micro_batches=mb,
                        tag=f"{policy.replace(':', '')}-mb{mb}") for policy, mb in runs]
    interleave(active)
    engine.reset_prefix_cache()
    freed = engine.free_blocks() == free_before
    return [{**_summary(r, policy, mb, cap), "kv_blocks_freed": freed} for r, (policy, mb) in zip(active, runs)]


def _summary(run, policy: str, micro_batches: int | None, cap: int) -> dict:
    every_step = list(run.orchestrator.records)
    records = [r for r in every_step if r.batch > 0]  # the verify steps (not those that only prefilled chunks)
    request_steps = sum(r.batch for r in records)
    errors = [abs(r.predicted_s / r.measured_s - 1) for r in records if r.measured_s > 0]
    outputs = [run.outputs[i] for i in run.ids]
    tokens = sum(map(len, outputs))
    tree = np.array([sum(r.nodes) > 0 for r in records], bool)  # steps where some request sent a tree
    step_ms = np.array([r.measured_s * 1e3 for r in records])
    return {
        "policy": policy, "micro_batches": "per step" if micro_batches is None else micro_batches, "cap": cap,
        "requests": len(run.ids), "outputs": outputs, "tokens": tokens, "seconds": run.elapsed,
        "tokens_per_s": tokens / run.elapsed,
        "accepted_draft_tokens": sum(r.realized_tokens - r.batch for r in records),
        "tokens_per_request_step": (tokens - len(run.ids)) / max(request_steps, 1),
        "nodes_per_request_step": sum(sum(r.nodes) for r in records) / max(request_steps, 1),
        "steps": len(records), "split_steps": sum(r.micro_batches > 1 for r in records),
        "drafting_hidden_s": sum(r.overlapped_draft_s for r in records),
        "request_steps": request_steps,
        "drafted_ahead_request_steps": sum(r.drafted_ahead for r in records),  # `StepRecord.drafted_ahead`
        "drafting_waited_s": sum(r.draft_s for r in records),
        "verify_s": sum(r.measured_s for r in records),
        "tree_steps": int(tree.sum()),
        "plain_step_ms": float(np.median(step_ms[~tree])) if (~tree).any() else None,
        "tree_step_ms": float(np.median(step_ms[tree])) if tree.any() else None,
        "prefill_s": sum(sum(r.prefill_s) for r in every_step),
        "step_model_median_abs_err": float(np.median(errors)) if errors else None,
        "drafter_fallbacks": run.orchestrator.drafter_fallbacks,
    }


def lossless(device, *, requests: int, max_tokens: int) -> dict:
    import torch

    from orchestrator.spec_loop import generate

    engine, step_model, fit_error = build("smollm2-135m", torch.float32, device, num_blocks=1024, max_context=1024)
    prompts = repeating_prompts(requests, engine.vocab_size, np.random.default_rng(0))
    reference, _ = generate(engine, prompts, max_new_tokens=max_tokens, stop_at_eos=False, id_prefix="plain")
    runs = []
    for policy, micro_batches in LOSSLESS_RUNS:
        run, = serve_together(engine, step_model, ((policy, micro_batches),), prompts, cap=8, max_tokens=max_tokens)
        run["identical_outputs_fraction"] = sum(a == b for a, b in zip(run.pop("outputs"), reference)) / requests
        runs.append(run)
        print(f"lossless {policy:9s} micro-batches {run['micro_batches']!s:8s} identical "
              f"{run['identical_outputs_fraction']:.0%}, {run['accepted_draft_tokens']} accepted, "
              f"{run['split_steps']}/{run['steps']} steps split", flush=True)
    return {"model_shape": "smollm2-135m (random weights, fp32)", "requests": requests, "max_tokens": max_tokens,
            "cap": 8, "fit_error": fit_error, "runs": runs}


def speed(device, model_name: str, *, caps: tuple[int, ...], requests_per_cap: dict[int, int],
          max_tokens: int, passes: int = 1, on_cap=None) -> dict:
    """The speed part; `on_cap(partial result)` after each cap, so a run stopped by a time limit keeps its caps.
    `passes`: how many times each cap's runs are served (module docstring); rows then carry their `pass`."""
    import tempfile

    import torch

    engine, step_model, fit_error = build(model_name, torch.bfloat16, device, num_blocks=4096, max_context=1024)
    rng = np.random.default_rng(1)
    prompts_by_cap = {cap: repeating_prompts(requests_per_cap[cap], engine.vocab_size, rng) for cap in caps}
    rows = []
    result = {"model_shape": f"{model_name} (random weights, bf16)",
              "max_tokens": max_tokens, "fit_error": fit_error, "hardware": step_model.hardware.name,
              "torch_threads": torch.get_num_threads(),
              "datastore": "the model's greedy outputs for every other prompt", "rows": rows}
    with tempfile.TemporaryDirectory(prefix="gpu-orchestrator-") as folder:
        datastores = (answers_datastore(engine, list(prompts_by_cap.values()), max_tokens=max_tokens,
                                        folder=Path(folder)),)
        # untimed: whatever compiles or allocates on first use (prefill shapes, the micro-batch worker) does so here
        serve_together(engine, step_model, (("none", 1), ("goodput", 2)), prompts_by_cap[caps[0]][:2], cap=2,
                       max_tokens=8, datastores=datastores)
        for cap in caps:
            for pass_number in range(1, passes + 1):
                baseline = None
                for run in serve_together(engine, step_model, SPEED_RUNS, prompts_by_cap[cap], cap=cap,
                                          max_tokens=max_tokens, datastores=datastores):
                    outputs = run.pop("outputs")
                    baseline = baseline or (run["tokens_per_s"], outputs)
                    run["speedup_over_none"] = run["tokens_per_s"] / baseline[0]
                    # bf16 on a GPU is not batch-invariant: the batch's shape may flip a near-tie (reported only)
                    run["identical_to_none_fraction"] = sum(a == b for a, b in zip(outputs, baseline[1])) / len(outputs)
                    if passes > 1:
                        run["pass"] = pass_number
                    rows.append(run)
                    print(f"speed cap {cap:<3d} " + (f"pass {pass_number} " if passes > 1 else "")
                          + f"{run['policy']:8s} micro-batches {run['micro_batches']!s:8s} "
                          f"{run['tokens_per_s']:8.1f} tok/s ({run['speedup_over_none']:.2f}x none), "
                          f"{run['nodes_per_request_step']:.1f} nodes/request-step, {run['split_steps']}/"
                          f"{run['steps']} split, step err {run['step_model_median_abs_err'] or 0:.1%}", flush=True)
                if on_cap is not None:
                    on_cap(result)
    return result


def write_markdown(path: Path, result: dict) -> None:
    x = result["lossless"]
    lines = [f"# The serving core on {result['device']}", "",
             f"Command: `{result['command']}`. torch {result['torch']}. Random weights (no checkpoint travels to the "
             "GPU machine), so acceptance here says nothing about real text.", "",
             "## Lossless through the orchestrator on this device", "",
             f"{x['model_shape']}, {x['requests']} requests x {x['max_tokens']} tokens, at most {x['cap']} running; "
             "the drafter on its prompt and self-output indexes; outputs against plain greedy decoding.", "",
             "| policy | micro-batches | identical outputs | draft tokens accepted | steps split | KV freed |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['policy']} | {r['micro_batches']} | {r['identical_outputs_fraction']:.0%} | "
              f"{r['accepted_draft_tokens']} | {r['split_steps']}/{r['steps']} | "
              f"{'yes' if r['kv_blocks_freed'] else 'NO'} |"
              for r in x["runs"]]
    s = result.get("speed")
    if s is not None:  # absent while the speed part runs (`main` saves after each part)
        passes = any("pass" in r for r in s["rows"])
        lines += ["", f"## The budget on {s['model_shape']} step times", "",
                  f"{s['max_tokens']} tokens per request, EOS ignored. Drafter: prompt and self-output indexes"
                  + (f", and a datastore of {s['datastore']}" if s.get("datastore") else "")
                  + (f"; torch CPU threads {s['torch_threads']}" if s.get("torch_threads") else "")
                  + f". Step-time model: {s['hardware']} roofline, fitted at start-up (median error on the sweep "
                  f"{s['fit_error']:.1%}), refit online.", "",
                  "| cap | " + ("pass | " if passes else "") + "policy | micro-batches | tok/s | x none | tokens / "
                  "request-step | nodes / request-step | steps split | drafted ahead | drafting hidden s | "
                  "drafting waited s | verify s | step model err | same as none |",
                  "|---|" + ("---|" if passes else "") + "---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['cap']} | " + (f"{r['pass']} | " if passes else "")
                  + f"{r['policy']} | {r['micro_batches']} | {r['tokens_per_s']:.1f} | "
                  f"{r['speedup_over_none']:.2f} | {r['tokens_per_request_step']:.2f} | "
                  f"{r['nodes_per_request_step']:.1f} | "
                  f"{r['split_steps']}/{r['steps']} | {_drafted_ahead(r)} | {r['drafting_hidden_s']:.2f} | "
                  f"{r['drafting_waited_s']:.2f} | "
                  f"{r['verify_s']:.2f} | {r['step_model_median_abs_err'] or 0:.1%} | "
                  f"{r['identical_to_none_fraction']:.0%} |"
                  for r in s["rows"]]
        lines += ["", *speed_readings(s["rows"])]
    if result.get("notes"):
        lines += ["## Notes", ""] + [line for note in result["notes"] for line in (note, "")]
    path.write_text("\n".join(lines) + "\n")


def _drafted_ahead(row: dict) -> str:
    """Request-steps drafted ahead / all request-steps; '-' in results written before the count existed (6694b26)."""
    if "drafted_ahead_request_steps" not in row:
        return "-"
    return f"{row['drafted_ahead_request_steps']}/{row['request_steps']}"


def _run_label(row: dict) -> str:
    """`goodput`, `goodput` (micro-batches per step), `goodput` (2 micro-batches)."""
    mb = row["micro_batches"]
    return f"`{row['policy']}`" + ("" if mb == 1 else " (micro-batches per step)" if mb == "per step"
                                   else f" ({mb} micro-batches)")


def speed_readings(rows: list[dict]) -> list[str]:
    """What the speed table does and does not show, read from its own rows."""
    out = []
    goodput = [r for r in rows if r["policy"] == "goodput"]
    if goodput and all(r["nodes_per_request_step"] == 0 for r in goodput):
        out += ["Reading: `goodput` sent no tree nodes in any row (the drafter found no continuation in this model's "
                "outputs), so every row of a cap did the same work, and `x none` is the spread between runs of the "
                "same work on this machine, not a speedup from speculation.", ""]
    for cap, pass_number in sorted({(r["cap"], r.get("pass", 0)) for r in rows}):
        group = [r for r in rows if r["cap"] == cap and r.get("pass", 0) == pass_number]
        where = f"Cap {cap}" + (f", pass {pass_number}" if pass_number else "")
        decided = [r for r in group if r["micro_batches"] == "per step"]
        forced = [r for r in group if r["policy"] == "goodput" and r["micro_batches"] == 2 and r["split_steps"]]
        if decided and forced:
            d, f = decided[0], forced[0]
            out += [f"{where}: deciding per step, the orchestrator split {d['split_steps']} of {d['steps']} steps "
                    f"into micro-batches; with two forced it split {f['split_steps']} of {f['steps']} and ran at "
                    f"{f['tokens_per_s'] / d['tokens_per_s']:.2f}x the tokens/s of deciding per step.", ""]
        first = {(r["policy"], r["micro_batches"]): r for r in rows if r["cap"] == cap and r.get("pass") == 1}
        if pass_number > 1 and first:
            pairs = [(r, first[(r["policy"], r["micro_batches"])]) for r in group
                     if (r["policy"], r["micro_batches"]) in first]
            out += [f"{where}, every shape met in pass 1 already: tokens/s "
                    + ", ".join(f"{_run_label(r)} {r['tokens_per_s'] / r1['tokens_per_s']:.2f}x" for r, r1 in pairs)
                    + " pass 1's.", ""]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda",
                        help="cuda (the benchmark); cpu only for a dry run of the code path")
    parser.add_argument("--model", default="llama-3.1-8b", help="bundled shape for the speed part")
    parser.add_argument("--quick", action="store_true",
                        help="few, short requests; the default model's shape (dry runs)")
    parser.add_argument("--caps", type=int, nargs="+", default=None,
                        help="concurrency caps of the speed part (default 1 16; --quick: 1 4)")
    parser.add_argument("--passes", type=int, default=1,
                        help="serve each cap's runs this many times over the same prompts (module docstring)")
    parser.add_argument("--out-dir", default=str(RESULTS))
    parser.add_argument("--note", action="append", default=[], help="a paragraph for the results' Notes section")
    args = parser.parse_args(argv)
    caps = tuple(args.caps or ((1, 4) if args.quick else (1, 16)))
    if any(c not in (1, 4, 16) for c in caps):
        parser.error(f"--caps: each cap must be 1, 4 or 16 (the request counts are set for those); got {caps}")
    if args.passes < 1:
        parser.error(f"--passes must be >= 1; got {args.passes}")
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_orchestrator: no CUDA device here (torch.cuda.is_available() is False); nothing was measured. "
              "Run it on a GPU machine: python -m benchmarks.gpu_orchestrator")
        return 0
    device = torch.device(args.device)
    model_name = "smollm2-135m" if args.quick else args.model
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__,
              "command": " ".join(["python -m benchmarks.gpu_orchestrator"]
                                  + ([f"--device {args.device}"] if args.device != "cuda" else [])
                                  + ([f"--model {args.model}"] if args.model != "llama-3.1-8b" else [])
                                  + (["--quick"] if args.quick else [])
                                  + (["--caps", *map(str, caps)] if args.caps else [])
                                  + ([f"--passes {args.passes}"] if args.passes != 1 else []))}
    if args.note:
        result["notes"] = args.note
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)

    def save(speed_part: dict | None = None) -> None:  # after each part and cap: a run stopped by a time limit
        if speed_part is not None:                       # keeps what it measured
            result["speed"] = speed_part
        write_results_json(out / "gpu_orchestrator.json", result)
        write_markdown(out / "gpu_orchestrator.md", result)

    result["lossless"] = lossless(device, requests=6 if args.quick else 16, max_tokens=16 if args.quick else 64)
    save()
    speed(device, model_name, caps=caps, requests_per_cap={1: 2 if args.quick else 4, 4: 4, 16: 32},
          max_tokens=16 if args.quick else 128, passes=args.passes, on_cap=save)
    print((out / "gpu_orchestrator.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
