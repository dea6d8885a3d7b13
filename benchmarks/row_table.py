"""Pricing a step's rows by a measured table vs the roofline's line, side by side on one engine.

    python -m benchmarks.row_table                       # 4 sets x caps 1 and 16, ~25 min on 2 CPU cores
    python -m benchmarks.row_table --sets humaneval --caps 1 --held-out 40 --name row_table_quick

The step-time model prices everything that grows with a step's rows (linear layers, LM head, per-token work) either
by the roofline (max(FLOPs / peak, bytes / bandwidth), a line in the rows past the ridge) or by the engine's row
table, measured at start-up (`orchestrator.profiling.measure_row_seconds`; `orchestrator.roofline` says why).
Three measurements, all on the default model in bf16 (`TorchEngine`, "auto" kernels):

1. The row table itself: extra seconds of 1..48 rows over a one-row step, as a ratio to the one-row step.
2. Held-out accuracy of the two forms: `--held-out` verify steps of random served shapes (1-16 requests, 0-40 nodes
   each, contexts 32-900), timed in an interleaved order; the odd ones fit both forms (`StepTimeModel.fit_samples`),
   the even ones test them (median relative error). The same steps for both: only the form differs.
3. Serving: for each (set, cap), `none`, `fixed:4` and `goodput` twice, once on a step-time model of each form
   (each fitted at start-up in its own form, then refit online from its own steps), all side by side
   (`benchmarks.throughput.interleave`, each on its own clock). Output tokens/s, speedup over `none`, tau, nodes per
   request and step, and each goodput's step-model median error over its own steps.

Writes benchmarks/results/<name>.{json,md} (default name: row_table).
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time

import numpy as np
import torch

from benchmarks.results_files import result_name_problem, save_results
from benchmarks.throughput import PolicyRun, summarize_run, build_stack, group_sample, interleave
from drafter.tree import DraftTree
from orchestrator.profiling import ROW_TABLE_ROWS, fit_step_model
from orchestrator.roofline import StepTimeModel
from orchestrator.serving.stack import serving_prefill_chunk
from tools.prompt_sets import PROMPT_SETS
from tools.trajectories import load_trajectories, trajectory_path
from trt_engines.base import VerifyItem
from trt_engines.cpu_kernels import cpu_description

# the serving rows: (tag, policy, step-time model form)
ROWS = (("none", "none", "table"), ("fixed4", "fixed:4", "table"), ("goodput-roofline-rows", "goodput", "roofline"),
        ("goodput-row-table", "goodput", "table"))

HELD_OUT_BATCH, HELD_OUT_NODES, HELD_OUT_CONTEXT = 16, 40, 900  # the held-out steps' largest shape


def held_out_steps(engine, count: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray, float]]:
    """`count` verify steps of random served shapes, each timed once after a warm-up pass, in a shuffled order."""
    rng = np.random.default_rng(seed)
    shapes = []
    for _ in range(count):
        batch = int(rng.choice([1, 1, 2, 4, 8, HELD_OUT_BATCH]))
        nodes = rng.integers(0, HELD_OUT_NODES + 1, batch) if rng.random() < 0.7 else np.zeros(batch, np.int64)
        shapes.append((nodes, rng.integers(32, HELD_OUT_CONTEXT, batch)))
    steps = []
    for i, (nodes, context) in enumerate(shapes):
        ids = [f"__held-out-{i}-{r}" for r in range(len(nodes))]
        for rid, c in zip(ids, context):
            engine.add_synthetic_request(rid, int(c))
        items = [VerifyItem(rid, DraftTree.chain(rng.integers(0, engine.vocab_size, n))) for rid, n in zip(ids, nodes)]
        try:
            engine.verify(items)  # warm-up: a new shape may allocate
            seconds = engine.verify(items).timings["total_ms"] / 1e3
        finally:
            for rid in ids:
                engine.release(rid)
        steps.append((1.0 + nodes.astype(np.float64), context.astype(np.float64), seconds))
    return steps


def held_out_errors(forms: dict[str, StepTimeModel], steps) -> dict[str, dict]:
    """Each form fitted on the odd steps, its median relative error on the even ones (and on the ones it fitted)."""
    out = {}
    for name, model in forms.items():
        model = model.clone()
        model.fit_samples([(model.features(t, c), m) for t, c, m in steps[1::2]])

        def error(subset):
            return float(np.median([abs(model.predict(t, c) - m) / m for t, c, m in subset]))

        out[name] = {"test_median_rel_err": error(steps[0::2]), "fit_median_rel_err": error(steps[1::2]),
                     "coefficients": model.coefficients.tolist()}
    return out


def serve_rows(engine, drafter, models: dict[str, StepTimeModel], prompts, lengths, *, cap: int, chunk) -> dict:
    engine.reset_prefix_cache()
    runs = {tag: PolicyRun(engine, drafter.fresh(), models[form], policy, prompts, cap=cap, max_tokens=max(lengths),
                           lengths=lengths, tag=tag, prefill_chunk=chunk)
            for tag, policy, form in ROWS}
    interleave(list(runs.values()))
    return {tag: summarize_run(run) for tag, run in runs.items()}


def run(sets: list[str], caps: list[int], *, held_out: int, max_tokens: int, prompts_per_cap) -> dict:
    torch.set_num_threads(os.cpu_count() or 2)
    longest = max(len(t.prompt_ids) for name in sets for t in load_trajectories(trajectory_path(name, "eval")))
    num_blocks = max(len(ROWS) * max(caps) * -(-(longest + max_tokens + 65) // 16),
                     HELD_OUT_BATCH * -(-(HELD_OUT_CONTEXT + HELD_OUT_NODES + 1) // 16)) + 64
    engine, drafter, table_model, fit_error = build_stack(torch.bfloat16, num_blocks=num_blocks,
                                                          table_rows=ROW_TABLE_ROWS)
    roofline_model = StepTimeModel.for_engine(engine, table_model.shape, table_model.hardware,
                                              dtype=table_model.dtype, window=table_model.window)
    roofline_fit_error = fit_step_model(engine, roofline_model, table_rows=0)
    models = {"table": table_model, "roofline": roofline_model}
    one_row = engine_one_row_seconds(engine)
    steps = held_out_steps(engine, held_out)
    accuracy = held_out_errors(models, steps)
    chunk = serving_prefill_chunk("auto", engine)
    rows = []
    for set_name in sets:
        trajectories = load_trajectories(trajectory_path(set_name, "eval"))
        for cap in caps:
            sample = group_sample(trajectories, cap, prompts_per_cap)
            lengths = [min(max_tokens, len(t.output_ids)) for t in sample]
            started = time.perf_counter()
            results = serve_rows(engine, drafter, models, [t.prompt_ids for t in sample], lengths, cap=cap,
                                 chunk=chunk)
            none = results["none"]
            for tag, policy, form in ROWS:
                r = results[tag]
                if tag != "none" and r["outputs"] != none["outputs"]:
                    print(f"  note: {set_name} cap {cap} {tag}: outputs differ from none's (bf16 near-tie)")
                rows.append({"set": set_name, "cap": cap, "row": tag, "policy": policy, "step_model": form,
                             "prompts": len(sample), "tokens": r["tokens"], "tokens_per_s": r["tokens_per_s"],
                             "speedup_vs_none": r["tokens_per_s"] / none["tokens_per_s"], "tau": r["tau"],
                             "nodes_per_request_step": r["mean_nodes_per_request_step"],
                             "step_model_median_abs_err": r["step_model_median_abs_err"],
                             "shared_steps_fraction": r["shared_steps_fraction"]})
            print(f"{set_name} cap {cap}: " + ", ".join(
                f"{row['row']} {row['tokens_per_s']:.1f} tok/s" for row in rows[-len(ROWS):])
                  + f" ({time.perf_counter() - started:.0f} s)", flush=True)
    ratios = [table["tokens_per_s"] / roof["tokens_per_s"] for table, roof in _pairs(rows)]
    return {
        "command": "python -m benchmarks.row_table " + shlex.join(sys.argv[1:]),
        "device": cpu_description(), "kernels": engine.cpu_kernels,
        "row_table": {"rows": ROW_TABLE_ROWS, "seconds": table_model.row_seconds.tolist(),
                      "one_row_step_s": one_row},
        "start_up_fit_median_rel_err": {"table": fit_error, "roofline": roofline_fit_error},
        "held_out": {"steps": len(steps), **accuracy},
        "rows": rows,
        "summary": {
            "held_out_err_table": accuracy["table"]["test_median_rel_err"],
            "held_out_err_roofline": accuracy["roofline"]["test_median_rel_err"],
            "goodput_table_vs_roofline_rows_median": statistics.median(ratios),
            "goodput_table_vs_roofline_rows_min": min(ratios),
            "served_step_err_table": statistics.median(
                [r["step_model_median_abs_err"] for r in rows if r["row"] == "goodput-row-table"]),
            "served_step_err_roofline": statistics.median(
                [r["step_model_median_abs_err"] for r in rows if r["row"] == "goodput-roofline-rows"]),
        },
    }


def _pairs(rows: list[dict]) -> list[tuple[dict, dict]]:
    by_group = {}
    for r in rows:
        by_group.setdefault((r["set"], r["cap"]), {})[r["row"]] = r
    return [(g["goodput-row-table"], g["goodput-roofline-rows"]) for g in by_group.values()]


def engine_one_row_seconds(engine, repeats: int = 9) -> float:
    """The median one-row verify step at the table's context, to read the table as multiples of a plain step."""
    engine.add_synthetic_request("__one-row", 32)
    try:
        times = [engine.verify([VerifyItem("__one-row", DraftTree.empty())]).timings["total_ms"] / 1e3
                 for _ in range(repeats + 1)][1:]
    finally:
        engine.release("__one-row")
    return float(np.median(times))


def write_markdown(path, result: dict) -> None:
    table = np.array(result["row_table"]["seconds"])
    one = result["row_table"]["one_row_step_s"]
    ho = result["held_out"]
    lines = [
        "# Row-table step pricing vs the roofline's row terms",
        "",
        f"Command: `{result['command']}`. Device: {result['device']}. `benchmarks/row_table.py` says what runs.",
        "",
        f"Row table (extra seconds of T rows over one row, one request at 32 cached tokens), as plain steps "
        f"(one-row step {one * 1e3:.1f} ms): "
        + ", ".join(f"{t}: {1 + table[t - 1] / one:.2f}" for t in (2, 4, 8, 12, 13, 16, 17, 24, 25, 32, 33, 40, 48)
                    if t <= table.size),
        "",
        f"Held-out steps ({ho['steps']} random served shapes; half fit each form, the other half test it): median "
        f"relative error, row table {ho['table']['test_median_rel_err']:.3f}, roofline rows "
        f"{ho['roofline']['test_median_rel_err']:.3f} (on the steps they fitted: "
        f"{ho['table']['fit_median_rel_err']:.3f} and {ho['roofline']['fit_median_rel_err']:.3f}).",
        "",
        "| set | cap | row | tok/s | speedup vs none | tau | nodes/req/step | step-model err |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        err = r["step_model_median_abs_err"]
        lines.append(f"| {r['set']} | {r['cap']} | {r['row']} | {r['tokens_per_s']:.1f} | "
                     f"{r['speedup_vs_none']:.2f} | {r['tau']:.2f} | {r['nodes_per_request_step']:.1f} | "
                     f"{'' if err is None else f'{err:.3f}'} |")
    s = result["summary"]
    lines += ["", "goodput (row table) / goodput (roofline rows): median "
              f"{s['goodput_table_vs_roofline_rows_median']:.3f}, "
              f"min {s['goodput_table_vs_roofline_rows_min']:.3f}; served step-model median error: row table "
              f"{s['served_step_err_table']:.3f}, roofline rows {s['served_step_err_roofline']:.3f}.", ""]
    path.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", nargs="+", default=list(PROMPT_SETS), choices=PROMPT_SETS)
    parser.add_argument("--caps", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--held-out", type=int, default=200, help="random verify steps for the held-out accuracy")
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--name", default="row_table")
    args = parser.parse_args(argv)
    if problem := result_name_problem(args.name):
        parser.error(f"--name {problem}")
    if any(c < 1 for c in args.caps) or args.held_out < 4 or args.max_tokens < 1:
        parser.error("--caps must be >= 1, --held-out >= 4 and --max-tokens >= 1")
    result = run(args.sets, args.caps, held_out=args.held_out, max_tokens=args.max_tokens,
                 prompts_per_cap=lambda cap: max(2 * cap, 16))
    print(save_results(args.name, result, write_markdown).read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
