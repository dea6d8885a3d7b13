"""Batch drafting latency: one `Drafter.draft` call for 64 requests at budget 32 on the default datastore.

    python -m benchmarks.draft_batch

Requests are the first 16 eval trajectories of each prompt set, each indexed with its prompt and the first 64
tokens of its recorded output (a mid-generation state). The output history holds the recorded outputs of the next
40 eval trajectories of each set (finished requests, as on a server that has been serving for a while); one row
drafts without it, for comparison. Reports p50/p99 of the whole batch call and per request,
for the fused drafter and each single source, over 200 timed calls after 20 warm-up calls.
Writes benchmarks/results/draft_batch.json (+ .md).
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import numpy as np

from datastore import Datastore
from datastore.paths import default_datastore_dir
from drafter.drafter import Drafter, DrafterConfig
from tools.prompt_sets import PROMPT_SETS
from tools.trajectories import load_trajectories, trajectory_path

RESULTS = Path(__file__).resolve().parent / "results"
BATCH, BUDGET, CALLS, WARMUP = 64, 32, 200, 20
FINISHED_PER_SET = 40


def main() -> int:
    datastore = Datastore.open(default_datastore_dir())
    trajectories, finished = [], []
    per_set = BATCH // len(PROMPT_SETS)
    for set_name in PROMPT_SETS:
        loaded = load_trajectories(trajectory_path(set_name, "eval"))
        trajectories += loaded[:per_set]
        finished += loaded[per_set : per_set + FINISHED_PER_SET]
    rows = []
    for sources, history in (("fused", True), ("fused", False), ("input", True), ("datastore", False)):
        drafter = Drafter(DrafterConfig(sources=sources, history_tokens=32768 if history else 0),
                          datastores=[datastore])
        for i, t in enumerate(finished):
            drafter.start_request(("finished", i), t.prompt_ids)
            drafter.extend(("finished", i), t.output_ids)
            drafter.stop_request(("finished", i))
        for i, t in enumerate(trajectories):
            drafter.start_request(i, np.concatenate([t.prompt_ids, t.output_ids[:64]]))
        batch = [(i, BUDGET) for i in range(len(trajectories))]
        for _ in range(WARMUP):
            drafter.draft(batch)
        times = []
        for _ in range(CALLS):
            started = time.perf_counter()
            trees = drafter.draft(batch)
            times.append(time.perf_counter() - started)
        ms = np.array(times) * 1e3
        rows.append({"sources": sources if history or sources == "datastore" else f"{sources}, no output history",
                     "batch": len(batch), "budget": BUDGET,
                     "p50_ms": float(np.median(ms)), "p99_ms": float(np.percentile(ms, 99)),
                     "p50_us_per_request": float(np.median(ms)) * 1e3 / len(batch),
                     "mean_nodes": float(np.mean([len(t) for t in trees])),
                     "history_tokens": int(sum(o.shape[0] for o in drafter.input_index.history()))})
        print(rows[-1], flush=True)
    fused = rows[0]
    result = {
        "command": "python -m benchmarks.draft_batch",
        "machine": f"{platform.machine()}, {__import__('os').cpu_count()} cores",
        "datastore": repr(datastore),
        "rows": rows,
        "summary": {"draft_ms_p50_batch64_b32": fused["p50_ms"], "goal_ms": 3.0,
                    "goal_met": fused["p50_ms"] <= 3.0},
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "draft_batch.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = ["# Batch drafting latency (64 requests, budget 32, default datastore)", "",
             f"Command: `{result['command']}`. Machine: {result['machine']}. {result['datastore']}.", "",
             "| sources | p50 ms | p99 ms | p50 µs / request | mean nodes | output history tokens |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['sources']} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['p50_us_per_request']:.0f} | "
              f"{r['mean_nodes']:.1f} | {r['history_tokens']} |" for r in rows]
    lines += ["", f"Goal: fused p50 <= 3 ms: {'met' if result['summary']['goal_met'] else 'MISSED'}."]
    (RESULTS / "draft_batch.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
