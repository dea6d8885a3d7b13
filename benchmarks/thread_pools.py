"""Why one thread runs every parallel kernel of a server (`orchestrator/runner.py`): a plain decode step's time by
which threads have started parallel regions.

    python -m benchmarks.thread_pools            # about 2 minutes on 2 CPU cores

numba's OpenMP layer and PyTorch's (libgomp) keep a pool of worker threads for every thread that starts a parallel
region; once a runtime manages more threads than there are CPUs, its workers sleep between regions instead of
spinning, and a verify step runs a couple of hundred short regions. Each scenario runs in a fresh process (pools
outlive the code that made them): the default model (`TorchEngine`, bf16, its "auto" kernels), one request, the
median of 64 plain decode steps on the thread named.

Writes benchmarks/results/thread_pools.json and .md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time

import numpy as np

from benchmarks.results_files import save_results

SCENARIOS = {
    "main": "built and stepped on the main thread",
    "second_thread": "built and first stepped on the main thread, then stepped on a second thread (the server "
                     "before 08304fa)",
    "one_other_thread": "built and stepped on one thread that is not the main one (the server since 08304fa)",
    "beside_parallel_thread": "main thread, while a live second thread has run a 2-thread numba kernel (a drafting "
                              "thread before 49f5444)",
    "beside_serial_thread": "main thread, while a live second thread has run that kernel on 1 thread (since 49f5444)",
}
STEPS = 64


def _decode_ms(engine, request_id: str) -> float:
    """Median ms of STEPS plain decode steps of one request."""
    from drafter.tree import DraftTree
    from tools.trajectories import load_trajectories, trajectory_path
    from trt_engines.base import VerifyItem

    engine.add_request(request_id, list(load_trajectories(trajectory_path("chitchat", "eval"))[3].prompt_ids))
    times = []
    for _ in range(STEPS):
        started = time.perf_counter()
        result = engine.verify([VerifyItem(request_id, DraftTree.empty())]).results[0]
        times.append(time.perf_counter() - started)
        engine.commit(request_id, [], next_root=int(result.target_tokens[0]))
    engine.release(request_id)
    return 1e3 * float(np.median(times))


def _engine():
    import torch

    from trt_engines.torch_engine import TorchEngine

    return TorchEngine("default", dtype=torch.bfloat16, num_blocks=256)


def _on_thread(fn):
    out = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    thread.join()
    return out[0]


def _beside_a_thread(threads: int | None) -> float:
    import numba

    @numba.njit(parallel=True)
    def parallel_sum(x):
        total = 0.0
        for i in numba.prange(x.shape[0]):
            total += x[i]
        return total

    engine = _engine()
    _decode_ms(engine, "warm")
    ran, leave = threading.Event(), threading.Event()

    def side():
        if threads:
            numba.set_num_threads(threads)
        parallel_sum(np.ones(1000))
        ran.set()
        leave.wait()

    thread = threading.Thread(target=side)
    thread.start()
    ran.wait()
    try:
        return _decode_ms(engine, "measured")
    finally:
        leave.set()
        thread.join()


def run_scenario(name: str) -> float:
    if name == "main":
        engine = _engine()
        _decode_ms(engine, "warm")
        return _decode_ms(engine, "measured")
    if name == "second_thread":
        engine = _engine()
        _decode_ms(engine, "warm")
        return _on_thread(lambda: _decode_ms(engine, "measured"))
    if name == "one_other_thread":
        def build_and_decode():
            engine = _engine()
            _decode_ms(engine, "warm")
            return _decode_ms(engine, "measured")
        return _on_thread(build_and_decode)
    if name == "beside_parallel_thread":
        return _beside_a_thread(None)
    if name == "beside_serial_thread":
        return _beside_a_thread(1)
    raise ValueError(f"unknown scenario {name!r}; one of {sorted(SCENARIOS)}")


def write_markdown(path, result: dict) -> None:
    lines = ["# thread_pools: a decode step's time by which threads started parallel regions", "",
             f"Command: `{result['command']}` on {result['cpu']}. Default model, bf16, one request, median of "
             f"{STEPS} plain decode steps; each scenario in a fresh process, {result['rounds']} rounds interleaved "
             "(the median of the rounds' medians).", "",
             "| scenario | step ms | / main |", "|---|---|---|"]
    main = result["step_ms"]["main"]
    lines += [f"| {SCENARIOS[name]} | {ms:.1f} | {ms / main:.2f} |" for name, ms in result["step_ms"].items()]
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), help=argparse.SUPPRESS)  # one, in this process
    args = parser.parse_args(argv)
    if args.scenario:
        print(json.dumps({"step_ms": run_scenario(args.scenario)}))
        return 0
    from trt_engines.cpu_kernels import cpu_description

    runs: dict[str, list[float]] = {name: [] for name in SCENARIOS}
    for _ in range(args.rounds):
        for name in SCENARIOS:
            done = subprocess.run([sys.executable, "-m", "benchmarks.thread_pools", "--scenario", name],
                                  capture_output=True, text=True, check=True, timeout=600)
            runs[name].append(json.loads(done.stdout.strip().splitlines()[-1])["step_ms"])
            print(f"{name:24s} {runs[name][-1]:.1f} ms", flush=True)
    result = {"command": "python -m benchmarks.thread_pools" + "".join(f" {a}" for a in (argv or sys.argv[1:])),
              "cpu": cpu_description(), "rounds": args.rounds, "runs_ms": runs,
              "step_ms": {name: float(np.median(ms)) for name, ms in runs.items()}}
    print(save_results("thread_pools", result, write_markdown).read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
