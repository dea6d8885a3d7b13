"""Drafter-only acceptance benchmark on recorded greedy trajectories (SSSD's offline method, `tools/replay.py`).

    python -m benchmarks.acceptance                 # every eval prompt set, B in 1..64, every method
    python -m benchmarks.acceptance --quick         # a smoke run: 12 prompts per set, B in {8, 32}

Methods, all behind the same lifecycle API and replayed on the same trajectories in one process:
  fused / input / datastore   ours (SSSD fusion; input index only; datastores only), calibrated by
                              <datastore>/calibration.json when present (tools/calibrate.py)
  fused-path                  ours reduced to the most probable root-to-leaf path (what a linear-draft engine
                              such as TensorRT-LLM's external draft tokens verifies: `TensorRTLLMEngine` sends
                              `DraftTree.best_path_nodes`, the same path); summary `tau_lost_by_path_b32_<set>`
                              is fused minus fused-path at B=32
  pld / pld-recent            prompt lookup decoding, vLLM v1 NgramProposer semantics (earliest / latest match)
  aded                        ADED's retriever, PyPI `draftretriever` (third-party code) over the same documents
  rest-rules                  REST's retrieval rules REIMPLEMENTED on our datastore (labelled: REST's own
                              DraftRetriever is not installable here)
Datastore: the default one (chitchat-dataset training split + CPython stdlib source).

Writes benchmarks/results/acceptance.json (+ .md, + acceptance.png).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from benchmarks.peers import AdedDrafter, PromptLookupDrafter, RestRulesDrafter
from benchmarks.plotting import panels_by_set
from benchmarks.results_files import RESULTS, save_results
from datastore import Datastore
from datastore.paths import default_datastore_dir
from drafter.drafter import Drafter, DrafterConfig
from drafter.tree import DraftTree
from tools.prompt_sets import PROMPT_SETS
from tools.replay import replay
from tools.trajectories import load_trajectories, trajectory_path

BUDGETS = (1, 2, 4, 8, 16, 32, 64)
METHODS = ("fused", "fused-path", "input", "datastore", "pld", "pld-recent", "aded", "rest-rules")


class BestPathDrafter:
    """Wraps a tree drafter: each tree is reduced to its most probable root-to-leaf path (a linear draft)."""

    name = "fused-path"

    def __init__(self, inner: Drafter) -> None:
        self.inner = inner
        self.start_request, self.extend, self.stop_request = inner.start_request, inner.extend, inner.stop_request
        self.clear_history = inner.clear_history

    def draft(self, batch) -> list[DraftTree]:
        return [tree.best_path() for tree in self.inner.draft(batch)]


def method_factories(datastore: Datastore, aded_index: Path, methods: list[str]) -> dict[str, Callable[[], object]]:
    """A fresh drafter per (set, budget) run: `draftretriever`'s Reader adapts its counts to every context it
    searches (ADED's design), so reusing one across runs would let it memorise the very trajectories it is scored
    on. Within a run it still learns from the set's earlier prompts, as our drafter's output history does."""
    if "aded" in methods and not aded_index.is_file():
        started = time.perf_counter()
        AdedDrafter.build_index(str(aded_index), datastore.documents(), datastore.vocab_size)
        print(f"built the draftretriever index in {time.perf_counter() - started:.0f} s -> {aded_index}")
    factories: dict[str, Callable[[], object]] = {
        "fused": lambda: Drafter(DrafterConfig(sources="fused"), datastores=[datastore]),
        "fused-path": lambda: BestPathDrafter(Drafter(DrafterConfig(sources="fused"), datastores=[datastore])),
        "input": lambda: Drafter(DrafterConfig(sources="input"), datastores=[datastore]),
        "datastore": lambda: Drafter(DrafterConfig(sources="datastore"), datastores=[datastore]),
        "pld": lambda: PromptLookupDrafter(),
        "pld-recent": lambda: PromptLookupDrafter(most_recent=True),
        "aded": lambda: AdedDrafter(str(aded_index)),
        "rest-rules": lambda: RestRulesDrafter(datastore),
    }
    return {name: factories[name] for name in methods}


def run(sets: list[str], budgets: list[int], methods: list[str], *, limit: int | None) -> dict:
    datastore = Datastore.open(default_datastore_dir())
    factories = method_factories(datastore, default_datastore_dir() / "draftretriever.idx", methods)
    rows = []
    for set_name in sets:
        trajectories = load_trajectories(trajectory_path(set_name, "eval"))[:limit]
        for budget in budgets:
            for name, factory in factories.items():
                result = replay(factory(), trajectories, budget=budget)
                row = {
                    "set": set_name, "budget": budget, "method": name, "tau": result.tau, "steps": result.steps,
                    "tokens": result.tokens, "draft_us_p50": result.draft_us_p50,
                    "draft_us_p99": float(np.percentile(result.draft_us, 99)) if result.draft_us else 0.0,
                    "mean_tree_size": float(np.mean(result.tree_sizes)) if result.tree_sizes else 0.0,
                    "calibration_mae": result.calibration_mae,
                    "calibration_step_mae": result.step_mae,
                }
                rows.append(row)
                print(f"{set_name:10s} B={budget:<3d} {name:11s} tau={row['tau']:.3f} "
                      f"draft p50={row['draft_us_p50']:.0f}us mae={row['calibration_mae']:.3f}", flush=True)
    return {"rows": rows, "datastore": repr(datastore)}


def summarize(rows: list[dict], sets: list[str]) -> dict:
    def tau(set_name, method, budget):
        return next((r["tau"] for r in rows if (r["set"], r["method"], r["budget"]) == (set_name, method, budget)), None)

    summary: dict[str, float] = {}
    ratios, dominance = [], []
    for s in sets:
        for method in ("fused", "pld", "aded", "rest-rules", "fused-path"):
            value = tau(s, method, 32)
            if value is not None:
                summary[f"tau_{method.replace('-rules', '').replace('-', '_')}_b32_{s}"] = value
        fused_row = next((r for r in rows if (r["set"], r["method"], r["budget"]) == (s, "fused", 32)), None)
        if fused_row:
            summary[f"draft_us_p50_fused_b32_{s}"] = fused_row["draft_us_p50"]
        if fused_row and tau(s, "fused-path", 32) is not None:  # tokens per step lost to linear verification
            summary[f"tau_lost_by_path_b32_{s}"] = fused_row["tau"] - tau(s, "fused-path", 32)
        peers = [tau(s, m, 32) for m in ("pld", "aded", "rest-rules")]
        peers = [p for p in peers if p is not None]
        if fused_row and peers:
            ratios.append(fused_row["tau"] / max(peers))
        for b in sorted({r["budget"] for r in rows}):
            parts = [tau(s, m, b) for m in ("fused", "input", "datastore")]
            if None not in parts:
                dominance.append(parts[0] >= max(parts[1:]) - 1e-9)
    if ratios:
        summary["fused_vs_best_peer_b32_min"] = min(ratios)
    if dominance:
        summary["fused_dominates_single_sources"] = float(all(dominance))
    fused_rows = [r for r in rows if r["method"] == "fused"]
    if fused_rows:
        summary["calibration_mae"] = float(np.mean([r["calibration_mae"] for r in fused_rows]))
    aded = [r["draft_us_p50"] for r in rows if r["method"] == "aded" and r["budget"] == 32]
    fused = [r["draft_us_p50"] for r in rows if r["method"] == "fused" and r["budget"] == 32]
    if aded and fused:
        summary["fused_draft_us_over_aded_b32_max"] = max(f / a for f, a in zip(fused, aded))
    return summary


def write_markdown(path: Path, result: dict) -> None:
    rows, summary = result["rows"], result["summary"]
    sets = sorted({r["set"] for r in rows}, key=lambda s: PROMPT_SETS.index(s))
    methods = [m for m in METHODS if any(r["method"] == m for r in rows)]
    lines = [
        "# Acceptance: tokens per step (tau) on recorded greedy trajectories",
        "",
        f"Command: `{result['command']}`. Datastore: {result['datastore']}. Machine: {result['machine']}.",
        "tau = tokens produced by decoding steps / steps (accepted + bonus). `rest-rules` is REST's retrieval rules",
        "reimplemented on our datastore (REST's DraftRetriever is not on PyPI); `aded` is the PyPI `draftretriever`.",
        "",
    ]
    for s in sets:
        budgets = sorted({r["budget"] for r in rows if r["set"] == s})
        lines += [f"## {s}", "", "| method | " + " | ".join(f"B={b}" for b in budgets) + " | draft µs p50 @B=32 |",
                  "|---|" + "---|" * (len(budgets) + 1)]
        for m in methods:
            cells = []
            for b in budgets:
                row = next((r for r in rows if (r["set"], r["method"], r["budget"]) == (s, m, b)), None)
                cells.append(f"{row['tau']:.3f}" if row else "–")
            at32 = next((r for r in rows if (r["set"], r["method"], r["budget"]) == (s, m, 32)), None)
            lines.append(f"| {m} | " + " | ".join(cells) + f" | {at32['draft_us_p50']:.0f} |" if at32 else
                         f"| {m} | " + " | ".join(cells) + " | – |")
        lines.append("")
    lines += ["## Summary", "", "```json", json.dumps(summary, indent=2), "```", ""]
    lines += result.get("notes", [])
    path.write_text("\n".join(lines) + "\n")


def plot(path: Path, rows: list[dict]) -> None:
    panels_by_set(path, rows, x="budget", y="tau", series_key="method", series=METHODS, highlight="fused",
                  xlabel="budget B (nodes)", ylabel="tau (tokens / step)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sets", nargs="+", default=list(PROMPT_SETS), choices=PROMPT_SETS)
    parser.add_argument("--budgets", nargs="+", type=int, default=list(BUDGETS))
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--limit", type=int, default=None, help="prompts per set (default: all)")
    parser.add_argument("--quick", action="store_true", help="12 prompts per set, B in {8, 32}; separate output files")
    args = parser.parse_args(argv)
    if args.quick:
        args.limit = args.limit or 12
        args.budgets = args.budgets if args.budgets != list(BUDGETS) else [8, 32]
    started = time.perf_counter()
    result = run(args.sets, args.budgets, args.methods, limit=args.limit)
    result["summary"] = summarize(result["rows"], args.sets)
    result["command"] = "python -m benchmarks.acceptance" + (" --quick" if args.quick else "")
    result["machine"] = f"{platform.machine()}, {platform.processor() or 'cpu'}, {__import__('os').cpu_count()} cores"
    result["seconds"] = round(time.perf_counter() - started, 1)
    name = "acceptance_quick" if args.quick else "acceptance"
    save_results(name, result, write_markdown)
    if not args.quick:
        plot(RESULTS / "acceptance.png", result["rows"])
    print(json.dumps(result["summary"], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
