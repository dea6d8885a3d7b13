"""Does the simulator predict what the CPU actually did? Replays every row of the throughput benchmark.

    python -m benchmarks.simulator_validation                    # replays benchmarks/results/throughput.json
    python -m benchmarks.simulator_validation --source throughput_quick

For each (prompt set, cap, policy) row of the measured run, `tools/simulate.py` serves the same prompts with the
same policy, cap and token limit through the real orchestrator and drafter, over a `SimulatedEngine` whose step
times come from the step-time model of the default model's shape on the CPU profile measured in that run
(`hardware`), with the coefficients fitted on every verify step of that run (`step_model`) and on every prefill
(`prefill_model`). Host work (drafting,
budgeting, bookkeeping) runs for real here and is charged as measured. Reports simulated vs measured output
tokens/s per row; summary key `sim_vs_measured_max_abs_err` (goal <= 0.10).

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

from orchestrator.roofline import HardwareSpec, ModelShape
from tools.simulate import (
    Deployment,
    Workload,
    closed_loop_arrivals,
    default_drafter,
    model_config,
    simulate,
)
from tools.trajectories import load_trajectories, trajectory_path

RESULTS = Path(__file__).resolve().parent / "results"


def validate(measured: dict, *, host_time: str = "measured") -> dict:
    for key in ("hardware", "step_model", "rows", "max_tokens"):
        if key not in measured:
            raise ValueError(f"the throughput results lack `{key}`: re-run `python -m benchmarks.throughput` "
                             "(results from before the simulator existed cannot be replayed)")
    deployment = Deployment(
        ModelShape.from_config(model_config("smollm2-135m")),
        HardwareSpec(**measured["hardware"]),
        dtype=measured["step_model"]["dtype"],
        coefficients=tuple(measured["step_model"]["coefficients"]),
        prefill_coefficients=tuple(measured["prefill_model"]["coefficients"]) if "prefill_model" in measured else None,
    )
    drafter = default_drafter()
    rows = []
    for row in measured["rows"]:
        trajectories = load_trajectories(trajectory_path(row["set"], "eval"))[: row["prompts"]]
        workload = Workload(tuple(trajectories), measured["max_tokens"], tuple(closed_loop_arrivals(len(trajectories))),
                            row["cap"])
        sim = simulate(deployment, workload, row["policy"], drafter, host_time=host_time).metrics
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
        "orchestrator and drafter over `SimulatedEngine` (step-time model fitted on that run's verify steps; host "
        "work charged as measured here).",
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
    result = validate(json.loads(source.read_text()))
    result["source"] = f"benchmarks/results/{source.name}"
    result["command"] = "python -m benchmarks.simulator_validation" + (
        f" --source {args.source}" if args.source != "throughput" else "")
    result["machine"] = f"{platform.machine()} {os.cpu_count()} cores"
    result["seconds"] = round(time.perf_counter() - started, 1)
    name = "simulator_validation" + ("" if args.source == "throughput" else f"_{args.source}")
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    write_markdown(RESULTS / f"{name}.md", result)
    print((RESULTS / f"{name}.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
