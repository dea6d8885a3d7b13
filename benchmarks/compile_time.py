"""What a fresh install compiles before it serves: seconds of numba compiling per component, from an empty cache.

    python -m benchmarks.compile_time                       # this tree (about 1.5 minutes on 2 CPU cores)
    python -m benchmarks.compile_time --baseline 100f3ad    # and a git revision of this repository, side by side

numba compiles each jitted kernel on its first call and caches it on disk (`cache=True`), so a fresh install, a new
version, or CI's clean clone pays the compiling once, in the first process that needs each kernel. Each component is
built here in a fresh process with an empty NUMBA_CACHE_DIR:
    drafter  `Drafter(DrafterConfig(), datastores=[default datastore])`: its warm-up compiles fusion and lookups
    budget   `BudgetController(goodput)`: its warm-up compiles the goodput step's kernels
    engine   the default model's first bf16 prefill in `TorchEngine` (its numba CPU kernels)
Reported per component: wall seconds of the build (imports excluded), seconds inside numba's compile events (outermost
only), and how many compiles ran (every specialization, nested ones included). numba compiles a function once per
tuple of argument types, and a constant argument is a type of its own (Literal[int](1)); the drafter row also lists
how many specializations each fusion helper got. A baseline revision is exported with `git archive` and measured by
the same child code, round by round in turn with this tree.

Writes benchmarks/results/compile_time.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import numpy as np

from benchmarks.results_files import save_results

REPO = Path(__file__).resolve().parents[1]
COMPONENTS = ("drafter", "budget", "engine")
FUSION_HELPERS = ("fuse_one", "_seed_suffixes", "_push_count_children", "_push", "_pop", "calibrate")

# Runs inside the tree being measured (its own modules on the path), so it may only use what every revision has.
_CHILD = textwrap.dedent("""
    import json, sys, time
    from numba.core import event

    class Recorder(event.Listener):
        def __init__(self):
            self.open, self.outermost_s, self.compiles = [], 0.0, 0
        def on_start(self, e):
            self.open.append(time.perf_counter())
            self.compiles += 1
        def on_end(self, e):
            took = time.perf_counter() - self.open.pop()
            if not self.open:
                self.outermost_s += took

    recorder = Recorder()
    event.register("numba:compile", recorder)
    component = sys.argv[1]
    if component == "drafter":
        from datastore import Datastore
        from datastore.paths import default_datastore_dir
        from drafter import fusion
        from drafter.drafter import Drafter, DrafterConfig
        datastore = Datastore.open(default_datastore_dir())
        started = time.perf_counter()
        Drafter(DrafterConfig(), datastores=[datastore])
    elif component == "budget":
        from orchestrator.budget import BudgetController, BudgetPolicy
        from orchestrator.roofline import KNOWN_HARDWARE, ModelShape, StepTimeModel
        from trt_engines.prepare import default_model_dir
        model = StepTimeModel(ModelShape.from_config(default_model_dir()), KNOWN_HARDWARE["H100-SXM"])
        started = time.perf_counter()
        BudgetController(BudgetPolicy.parse("goodput"), model)
    else:
        import torch
        from trt_engines.torch_engine import TorchEngine
        engine = TorchEngine("default", dtype=torch.bfloat16, num_blocks=64, max_context=512)
        started = time.perf_counter()
        engine.add_request("r", list(range(1, 40)))
    result = {"build_s": time.perf_counter() - started, "compiling_s": recorder.outermost_s,
              "compiles": recorder.compiles}
    if component == "drafter":
        result["fusion_specializations"] = {name: len(getattr(fusion, name).signatures)
                                            for name in %r if hasattr(fusion, name)}
    print(json.dumps(result))
""" % (FUSION_HELPERS,))


def measure(tree: Path, component: str) -> dict:
    """One component built in a fresh process of `tree` with an empty numba cache."""
    with tempfile.TemporaryDirectory(prefix="numba-cache-") as cache:
        env = {**os.environ, "NUMBA_CACHE_DIR": cache, "PYTHONPATH": str(tree)}
        done = subprocess.run([sys.executable, "-c", _CHILD, component], cwd=tree, env=env, capture_output=True,
                              text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"{component} in {tree} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def export_revision(revision: str, into: Path) -> str:
    """`git archive` of a revision of this repository into `into`; returns its short hash."""
    short = subprocess.run(["git", "rev-parse", "--short", revision], cwd=REPO, capture_output=True, text=True,
                           check=True).stdout.strip()
    archive = subprocess.run(["git", "archive", revision], cwd=REPO, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return short


def this_tree_name() -> str:
    """How results name the working tree they ran on: HEAD's short hash, marked where tracked files changed."""
    here = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout.strip()
    return f"{here}{' + changes' if dirty else ''} (this tree)"


def write_markdown(path: Path, result: dict) -> None:
    trees = list(result["trees"])
    lines = ["# compile_time: what a fresh install compiles before it serves", "",
             f"Command: `{result['command']}` on {result['cpu']}. Each component built in a fresh process with an "
             f"empty numba cache; median of {result['rounds']} round(s). Build s: wall time of the build (imports "
             "excluded); compiling s: inside numba's outermost compile events; compiles: every specialization "
             "compiled, nested ones included.", "",
             "| component | tree | build s | compiling s | compiles |", "|---|---|---|---|---|"]
    for component in COMPONENTS:
        for tree in trees:
            row = result["trees"][tree][component]
            lines.append(f"| {component} | {tree} | {row['build_s']:.1f} | {row['compiling_s']:.1f} | "
                         f"{row['compiles']:.0f} |")
    lines += ["", "Specializations of each fusion helper (drafter):", "",
              "| tree | " + " | ".join(f"`{h}`" for h in FUSION_HELPERS) + " |",
              "|---|" + "---|" * len(FUSION_HELPERS)]
    for tree in trees:
        counts = result["trees"][tree]["drafter"].get("fusion_specializations", {})
        lines.append(f"| {tree} | " + " | ".join(str(counts.get(h, "-")) for h in FUSION_HELPERS) + " |")
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", help="a git revision of this repository to measure beside this tree")
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args(argv)
    from trt_engines.cpu_kernels import cpu_description

    with tempfile.TemporaryDirectory(prefix="compile-baseline-") as exported:
        trees = {this_tree_name(): REPO}
        if args.baseline:
            trees[export_revision(args.baseline, Path(exported))] = Path(exported)
        runs: dict[str, dict[str, list[dict]]] = {name: {c: [] for c in COMPONENTS} for name in trees}
        for _ in range(args.rounds):
            for component in COMPONENTS:
                for name, tree in trees.items():
                    runs[name][component].append(measure(tree, component))
                    row = runs[name][component][-1]
                    print(f"{component:8s} {name:22s} build {row['build_s']:5.1f} s, compiling "
                          f"{row['compiling_s']:5.1f} s, {row['compiles']} compiles", flush=True)
    medians = {name: {c: {**rows[-1], **{k: float(np.median([r[k] for r in rows]))
                                         for k in ("build_s", "compiling_s", "compiles")}}
                      for c, rows in per.items()} for name, per in runs.items()}
    result = {"command": "python -m benchmarks.compile_time" + "".join(f" {a}" for a in (argv or sys.argv[1:])),
              "cpu": cpu_description(), "rounds": args.rounds, "trees": medians, "runs": runs}
    print(save_results("compile_time", result, write_markdown).read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
