"""Does the simulator predict what the CPU actually did? Replays every row of the throughput benchmark.

    python -m benchmarks.simulator_validation                    # replays benchmarks/results/throughput.json
    python -m benchmarks.simulator_validation --source throughput_quick

For each (prompt set, cap, policy) row of the measured run, `tools/simulate.py` serves the same prompts with the
same policy, cap, token limit and prefill chunk through the real orchestrator and drafter, over a `SimulatedEngine` that answers
with the tokens that row actually generated (`throughput_outputs.npz`; bf16 near-ties make them differ from the
recorded trajectories, and acceptance depends on the exact text). Its step times come from the step-time model of
the default model's shape on the CPU profile measured in that run (`hardware`), with the coefficients fitted on the
verify steps and prefills of that row's (set, cap) group (`group_fits`: the group's policies ran side by side, so
they saw the same machine; this shared machine's speed drifts by tens of percent over the whole run). Drafting runs
for real here and is charged as measured; the rest of the host work per step (acceptance, KV commits, streaming) is
charged by the group's fitted host overhead (seconds per step + per running request). The budget controller starts
from the step-time fit the measured run started from, and refits itself online, as the measured one did.
Reports simulated vs measured output tokens/s per row; summary key `sim_vs_measured_max_abs_err` (goal <= 0.10),
and under `run_fit` the same replay with one fit over the whole run.

Writes benchmarks/results/simulator_validation.json (+ .md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np

from benchmarks.results_files import RESULTS, save_results
from orchestrator.roofline import HardwareSpec, ModelShape
from tools.simulate import (
    Deployment,
    Workload,
    closed_loop_arrivals,
    default_drafter,
    model_config,
    simulate,
)
from tools.trajectories import Trajectory, load_trajectories, spread, trajectory_path


def measured_outputs(measured: dict) -> dict[tuple[str, int, str], list[np.ndarray]] | None:
    """Every row's generated tokens (the throughput run's `outputs_file`), or None for results without them."""
    name = measured.get("outputs_file")
    if not name or not (RESULTS / name).is_file():
        return None
    out = {}
    with np.load(RESULTS / name) as arrays:
        for row in measured["rows"]:
            key = f"{row['set']}_{row['cap']}_{row['policy'].replace(':', '')}"
            tokens, lengths = arrays[f"{key}_tokens"], arrays[f"{key}_lengths"]
            out[(row["set"], row["cap"], row["policy"])] = np.split(tokens, np.cumsum(lengths)[:-1])
    return out


def row_trajectories(recorded: list[Trajectory], outputs: list[np.ndarray] | None, eos: set[int]) -> list[Trajectory]:
    """The row's prompts with what the measured run generated for them (bf16 near-ties make that differ from the
    recorded trajectories, and acceptance depends on the exact text); the recorded outputs when none were saved."""
    if outputs is None:
        return recorded
    return [Trajectory(t.set_name, t.prompt_id, t.prompt_ids, np.asarray(o, np.int32),
                       "eos" if len(o) and int(o[-1]) in eos else "length") for t, o in zip(recorded, outputs)]


def validate(measured: dict, *, host_time: str = "plan", fit: str = "group") -> dict:
    """Replay every measured row. `fit="group"`: each (set, cap) group with the step-time fit of its own steps;
    `fit="run"`: every row with the one fit over the whole run."""
    for key in ("hardware", "step_model", "rows", "max_tokens") + (("group_fits",) if fit == "group" else ()):
        if key not in measured:
            raise ValueError(f"the throughput results lack `{key}`: re-run `python -m benchmarks.throughput` "
                             "(older results cannot be replayed this way)")
    shape, hardware = ModelShape.from_config(model_config("smollm2-135m")), HardwareSpec(**measured["hardware"])
    # the run's row table, where it priced rows by one (its coefficients mean nothing without it)
    row_seconds = measured["step_model"].get("row_seconds")
    row_seconds = None if row_seconds is None else tuple(row_seconds)

    def deployment(step: list[float], prefill: list[float] | None, host: list[float] | None) -> Deployment:
        return Deployment(shape, hardware, dtype=measured["step_model"]["dtype"], coefficients=tuple(step),
                          prefill_coefficients=None if prefill is None else tuple(prefill),
                          host_overhead=tuple(host) if host else (0.0, 0.0),
                          attention_layout=measured["step_model"].get("attention_layout", "packed"), device="cpu",
                          row_seconds=row_seconds)

    group_fits = {(g["set"], g["cap"]): deployment(g["step_model"], g["prefill_model"], g.get("host_overhead"))
                  for g in measured.get("group_fits", [])}
    # one host-overhead fit for the run: the mean of the groups' (they differ by batch shape, not by machine drift)
    overheads = [g["host_overhead"] for g in measured.get("group_fits", []) if "host_overhead" in g]
    host = np.mean(overheads, axis=0).tolist() if overheads else None
    run_fit = deployment(measured["step_model"]["coefficients"],
                         measured["prefill_model"]["coefficients"] if "prefill_model" in measured else None, host)
    start_up = measured["step_model"].get("start_up_coefficients")
    generated = measured_outputs(measured)
    drafter = default_drafter()
    rows = []
    for row in measured["rows"]:
        deployment_of_row = group_fits[(row["set"], row["cap"])] if fit == "group" else run_fit
        recorded = load_trajectories(trajectory_path(row["set"], "eval"))
        # the measured run's prompts: evenly spread over the set, or (runs before the spread sample) the first ones
        recorded = (spread(recorded, row["prompts"]) if measured.get("prompt_sample") == "spread"
                    else recorded[: row["prompts"]])
        eos = {int(t.output_ids[-1]) for t in recorded if t.finish_reason == "eos"}
        trajectories = row_trajectories(recorded, generated and generated[(row["set"], row["cap"], row["policy"])], eos)
        workload = Workload(tuple(trajectories), measured["max_tokens"], tuple(closed_loop_arrivals(len(trajectories))),
                            row["cap"], ignore_eos=measured.get("output_lengths") == "reference")
        sim = simulate(deployment_of_row, workload, row["policy"], drafter, host_time=host_time,
                       controller_coefficients=start_up, prefill_chunk=measured.get("prefill_chunk")).metrics
        err = sim["tokens_per_s"] / row["tokens_per_s"] - 1.0
        rows.append({"set": row["set"], "cap": row["cap"], "policy": row["policy"],
                     "measured_tokens_per_s": row["tokens_per_s"], "simulated_tokens_per_s": sim["tokens_per_s"],
                     "rel_err": err, "measured_tau": row["tau"], "simulated_tau": sim["tau"],
                     "simulated_engine_s": sim["engine_s"], "simulated_host_s": sim["host_s"]})
        print(f"{row['set']:10s} cap={row['cap']:<3d} {row['policy']:9s} measured {row['tokens_per_s']:7.1f} "
              f"simulated {sim['tokens_per_s']:7.1f} tok/s ({err:+.1%})  tau {row['tau']:.2f} / {sim['tau']:.2f}",
              flush=True)
    errors = np.abs([r["rel_err"] for r in rows])
    return {
        "rows": rows,
        "summary": {
            "sim_vs_measured_max_abs_err": float(errors.max()),
            "sim_vs_measured_median_abs_err": float(np.median(errors)),
            "rows_within_10pct": float(np.mean(errors <= 0.10)),
        },
    }


def write_markdown(path: Path, result: dict) -> None:
    lines = [
        "# Simulator validation: simulated vs measured CPU throughput",
        "",
        f"Command: `{result['command']}` on {result['machine']}. Source: `{result['source']}` (each measured row "
        "is timed on its policy's own clock: the policies of a (set, cap) ran side by side, step by step). Simulated: same prompts, policy, cap and token limit through the real "
        "orchestrator and drafter over `SimulatedEngine`, answering with the tokens the row generated (step-time "
        "model fitted on the verify steps of the row's (set, cap) group; drafting charged as measured here, other "
        "host work by the group's fitted host overhead). `run_fit` in the summary: the same replay "
        "with one fit over the whole run, whose error includes the machine's drift during the run.",
        "",
        "| set | cap | policy | measured tok/s | simulated tok/s | error | tau measured | tau simulated |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(f"| {r['set']} | {r['cap']} | {r['policy']} | {r['measured_tokens_per_s']:.1f} | "
                     f"{r['simulated_tokens_per_s']:.1f} | {r['rel_err']:+.1%} | {r['measured_tau']:.2f} | "
                     f"{r['simulated_tau']:.2f} |")
    lines += ["", "## Summary", "", "```json", json.dumps(result["summary"], indent=2), "```"]
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", default="throughput", help="results name under benchmarks/results/")
    args = parser.parse_args(argv)
    source = RESULTS / f"{args.source}.json"
    if not source.is_file():
        parser.error(f"{source}: not found; run `python -m benchmarks.throughput` first")
    started = time.perf_counter()
    measured = json.loads(source.read_text())
    result = validate(measured, fit="group")
    # The same replay with one fit over the whole run, for comparison: its error includes the machine's drift.
    run_fit = validate(measured, fit="run")
    result["summary"]["run_fit"] = run_fit["summary"]
    result["run_fit_rows"] = run_fit["rows"]
    result["source"] = f"benchmarks/results/{source.name}"
    result["command"] = "python -m benchmarks.simulator_validation" + (
        f" --source {args.source}" if args.source != "throughput" else "")
    result["machine"] = f"{platform.machine()} {os.cpu_count()} cores"
    result["seconds"] = round(time.perf_counter() - started, 1)
    name = "simulator_validation" + ("" if args.source == "throughput" else f"_{args.source}")
    print(save_results(name, result, write_markdown).read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
