"""Event-clock simulation: the real orchestrator, drafter and budget controller over a `SimulatedEngine`.

    retrospec simulate --model llama-3.1-8b --hardware H100-SXM --sets mtbench humaneval \\
        --policies none goodput --concurrency 1 16 64 --max-tokens 128
    retrospec simulate --model llama-3.1-70b --tp 4 --hardware H100-SXM --rates 1 4 16 --policies none goodput
    retrospec simulate --trace arrivals.csv --policies goodput        # bursty trace: one timestamp (s) per row

Answers "what would this deployment do?" without the deployment: the target's tokens come from recorded greedy
trajectories (`tools/record_trajectories.py`), so acceptance is exactly what the drafter earns on that text; time
comes from the roofline step-time model of the chosen model shape (`tools/model_shapes/*.json` or any HF
`config.json`, with a tensor-parallel degree) on the chosen device (`KNOWN_HARDWARE` or a measured profile JSON).
Nothing sleeps. Host work is charged to the clock as measured on this machine, per `--host-time`:

    measured   all orchestrator work between engine calls (drafting, budgeting, acceptance, bookkeeping) as this
               machine runs it with the simulated engine
    plan       drafting and the budget controller's allocation (a deployment that runs this Python scheduler)
    draft      drafting only (a deployment whose scheduler is native code but drafts with this drafter)
    none       nothing (drafting fully overlapped with verification, SPIN-style)

A deployment's `host_overhead` (seconds per step + per running request) is charged on top: the engine-side host
work a real engine does per step (acceptance bookkeeping, KV commits, streaming), which the simulated engine does not.
`benchmarks/simulator_validation.py` uses `plan` plus the host overhead fitted in the measured CPU run.

Workloads: closed loop (every request submitted at t=0, at most `concurrency` running: the throughput benchmark),
Poisson arrivals at a rate, or a CSV trace of arrival timestamps. Metrics per run: throughput, latency
percentiles, TTFT, TPOT, tau (tokens per request-step), nodes per request-step, steps, engine and host seconds.
"""

from __future__ import annotations

import argparse
import csv
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from orchestrator.budget import BudgetController, BudgetPolicy
from orchestrator.core import Orchestrator, check_micro_batches, check_prefill_chunk
from orchestrator.profiling import SWEEP_BATCHES, SWEEP_CONTEXTS, SWEEP_NODES
from orchestrator.request import GenerationRequest
from orchestrator.roofline import (
    KNOWN_HARDWARE,
    HardwareSpec,
    ModelShape,
    StepTimeModel,
    hardware,
    step_coefficients,
)
from tools.prompt_sets import PROMPT_SETS
from tools.trajectories import Trajectory, load_trajectories, trajectory_path
from trt_engines.attention_groups import call_cost_for
from trt_engines.simulated_engine import SimClock, SimulatedEngine

MODEL_SHAPES_DIR = Path(__file__).resolve().parent / "model_shapes"
HOST_TIME = ("measured", "plan", "draft", "none")


def model_config(name_or_path: str) -> dict:
    """A bundled shape (`llama-3.1-8b`, `llama-3.1-70b`, `smollm2-135m`) or a config.json / model folder path."""
    bundled = MODEL_SHAPES_DIR / f"{name_or_path}.json"
    path = bundled if bundled.is_file() else Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        names = ", ".join(sorted(p.stem for p in MODEL_SHAPES_DIR.glob("*.json")))
        raise ValueError(f"unknown model {name_or_path!r}: use one of {names} or a path to a config.json / model folder")
    try:
        return json.loads(path.read_text())
    except ValueError as exc:
        raise ValueError(f"{path}: not a JSON model config ({exc})") from exc


@dataclass(frozen=True)
class Deployment:
    """What is simulated: a model shape on a device, and the step-time model's coefficients (None = pure roofline)."""

    shape: ModelShape
    hardware: HardwareSpec
    dtype: str = "bfloat16"
    coefficients: tuple[float, ...] | None = None
    prefill_coefficients: tuple[float, ...] | None = None  # a separate fit for prefills (None = same as steps)
    max_context: int = 8192
    kv_blocks: int = 1 << 20  # KV capacity in 16-token blocks (ample by default: the simulator studies speed)
    # Host work per step beyond drafting (acceptance, KV commits, streaming): seconds per step and per running
    # request, charged on top of `host_time`. Zero by default; `benchmarks/throughput.py` fits it on the CPU.
    host_overhead: tuple[float, float] = (0.0, 0.0)
    prefix_caching: bool = True  # prompts reuse earlier requests' full KV blocks (both real engines do by default)
    attention_layout: str = "packed"  # the engine's (`StepTimeModel.attention_layout`): TensorRT-LLM packs
    row_seconds: tuple[float, ...] | None = None  # a measured row table (`StepTimeModel.row_seconds`), or roofline rows
    # where it verifies: on a "gpu" the orchestrator may split the batch into micro-batches that take turns, one
    # drafted on the host while another is verified (`simulate(micro_batches=...)`); on the "cpu" it never does
    device: str = "gpu"

    def step_model(self, *, prefill: bool = False) -> StepTimeModel:
        chosen = self.prefill_coefficients if prefill and self.prefill_coefficients else self.coefficients
        coefficients = None if chosen is None else np.asarray(chosen, dtype=np.float64)
        # a grouped engine (`TorchEngine`) prices an attention call by its device ("gpu" here is CUDA)
        return StepTimeModel(self.shape, self.hardware, dtype=self.dtype, coefficients=coefficients,
                             attention_layout=self.attention_layout, row_seconds=self.row_seconds,
                             attention_call_cost=call_cost_for("cuda" if self.device == "gpu" else self.device))


@dataclass(frozen=True)
class Workload:
    trajectories: tuple[Trajectory, ...]
    max_tokens: int
    arrivals_s: tuple[float, ...]  # one per trajectory, non-decreasing
    concurrency: int  # most requests running at once
    # True: every request generates its trajectory's whole length (up to max_tokens), EOS ignored, as the
    # throughput benchmark's fixed-length requests do
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if len(self.arrivals_s) != len(self.trajectories):
            raise ValueError(f"{len(self.arrivals_s)} arrival times for {len(self.trajectories)} requests")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1 (tokens per request); got {self.max_tokens}")
        if self.concurrency < 1:
            raise ValueError(f"the concurrency (requests running at once) must be >= 1; got {self.concurrency}")


def closed_loop_arrivals(n: int) -> np.ndarray:
    return np.zeros(n)


def poisson_arrivals(n: int, rate: float, *, seed: int = 0) -> np.ndarray:
    if not rate > 0:
        raise ValueError(f"the request rate must be > 0 requests/s; got {rate}")
    return np.cumsum(np.random.default_rng(seed).exponential(1.0 / rate, n))


def trace_arrivals(path: str | Path, n: int) -> np.ndarray:
    """Arrival times from a CSV: the `timestamp` column (or the first one), seconds, made relative to the first row;
    the trace repeats (shifted by its span) when it has fewer rows than requests."""
    path = Path(path)
    try:
        with open(path, newline="") as f:
            rows = [r for r in csv.reader(f) if r and r[0].strip()]
    except OSError as exc:
        raise ValueError(f"{path}: cannot read the arrival trace ({exc})") from exc
    column = 0
    if rows and not _is_number(rows[0][0]):
        header = [h.strip().lower() for h in rows.pop(0)]
        column = header.index("timestamp") if "timestamp" in header else 0
    try:
        times = np.sort(np.array([float(r[column]) for r in rows]))
    except (ValueError, IndexError) as exc:
        raise ValueError(f"{path}: every row needs a number of seconds in column {column} ({exc})") from exc
    if times.size == 0:
        raise ValueError(f"{path}: the trace has no timestamps")
    times -= times[0]
    span = times[-1] + (np.diff(times).mean() if times.size > 1 else 1.0)
    reps = -(-n // times.size)
    return np.concatenate([times + i * span for i in range(reps)])[:n]


def _auto_or_int(text: str) -> str | int:
    """`--micro-batches`: "auto" or an int (argparse names the flag when this raises)."""
    return text if text == "auto" else int(text)


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def load_prompt_trajectories(sets: list[str], n_per_set: int, split: str = "eval") -> list[Trajectory]:
    out: list[Trajectory] = []
    for name in sets:
        out += load_trajectories(trajectory_path(name, split))[:n_per_set]
    return out


@dataclass
class _Timeline:
    arrival: float
    first: float | None = None
    done: float | None = None
    tokens: list[int] = field(default_factory=list)
    steps: int = 0
    last: float | None = None  # when its last update streamed
    gaps: list[float] = field(default_factory=list)  # seconds between its streamed updates


@dataclass
class SimulationResult:
    policy: str
    tokens: int
    seconds: float
    requests: int
    metrics: dict = field(default_factory=dict)
    outputs: list[list[int]] = field(default_factory=list)  # per request, in workload order


def _start_up_model(deployment: Deployment, coefficients: Sequence[float] | None) -> StepTimeModel:
    """The controller's step-time model as a real server starts it: fitted on the start-up sweep
    (`orchestrator.profiling.fit_step_model`'s grid, timed here by the deployment's own model), which its online
    refits keep; `coefficients` (when given) replace the fit, as when replaying a measured run's start."""
    truth, model = deployment.step_model(), deployment.step_model()
    grid = [(np.full(b, n + 1.0), np.full(b, float(c))) for b in SWEEP_BATCHES for n in SWEEP_NODES
            for c in SWEEP_CONTEXTS]
    # The sweep is kept for refits, but the start is the deployment's own model: a fit on the sweep's narrow grid
    # alone can land on other coefficients that fit it equally well and extrapolate worse (batch 64, long contexts).
    model.anchor([(t, c, truth.predict(t, c)) for t, c in grid])
    if coefficients is not None:
        model.coefficients = step_coefficients(coefficients)
    return model


def simulate(deployment: Deployment, workload: Workload, policy: str, drafter, *, host_time: str = "measured",
             max_nodes: int = 64, controller_coefficients: Sequence[float] | None = None,
             micro_batches: int | None = 1, prefill_chunk: int | None = None) -> SimulationResult:
    """Serve `workload` with `policy` on a simulated `deployment`; `drafter` is a real `Drafter` (state is released
    per request and its output history cleared first, so one drafter serves many simulations). The budget
    controller's step-time model starts from `controller_coefficients` when given (what a real controller knew at
    start-up), else from the deployment's, and refits itself online from the simulated steps as the real one does.

    `micro_batches` is the orchestrator's (`Orchestrator`): 1 verifies the whole batch every step; None lets it
    split the batch where that pays on the deployment's device, and a number splits it so. A split step's drafting
    ahead is charged only where it outlasts the simulated verify it ran beside (with `host_time` "draft" or "plan";
    "measured" times whole steps on this machine's wall clock, which cannot tell what a simulated verify hides).

    `prefill_chunk` is the orchestrator's too: at most that many prompt tokens prefilled per step (None: whole
    prompts at admission). The metrics' stream gaps (seconds between a request's streamed updates) show what a long
    prefill does to the requests already decoding."""
    if host_time not in HOST_TIME:
        raise ValueError(f"host_time must be one of {HOST_TIME}; got {host_time!r}")
    if micro_batches != 1 and host_time == "measured":
        raise ValueError("micro-batches need host_time 'draft', 'plan' or 'none': 'measured' cannot tell the drafting "
                         "hidden behind a simulated verify from the rest")
    drafter.clear_history()  # this workload's outputs must not be drafted from another simulation of the same prompts
    clock = SimClock()
    outputs = {tuple(int(t) for t in tr.prompt_ids): tr.output_ids for tr in workload.trajectories}
    eos = sorted({int(tr.output_ids[-1]) for tr in workload.trajectories if tr.finish_reason == "eos"})
    engine = SimulatedEngine(deployment.step_model(), clock, trajectories=outputs, vocab_size=deployment.shape.vocab,
                             eos_token_ids=tuple(eos), max_context=deployment.max_context,
                             num_blocks=deployment.kv_blocks, prefill_model=deployment.step_model(prefill=True),
                             device=deployment.device, prefix_caching=deployment.prefix_caching)
    controller_model = _start_up_model(deployment, controller_coefficients)
    controller = BudgetController(BudgetPolicy.parse(policy, max_nodes_per_request=max_nodes), controller_model)
    # every request arriving at t=0 is an offline batch, served as the throughput benchmark serves one
    orchestrator = Orchestrator(engine, drafter, controller, max_running=workload.concurrency, clock=clock,
                                offline_batch=not any(workload.arrivals_s), micro_batches=micro_batches,
                                prefill_chunk=prefill_chunk)

    timelines: dict[str, _Timeline] = {}

    def collect(out) -> None:
        line = timelines[out.request_id]
        if out.token_ids and line.first is None:
            line.first = clock.now
        if out.token_ids:
            if line.last is not None:
                line.gaps.append(clock.now - line.last)
            line.last = clock.now
        line.tokens += out.token_ids
        if out.finished:
            line.done = clock.now
            line.steps = out.stats.steps
            if out.error:
                raise RuntimeError(f"simulated request {out.request_id} failed: {out.error}")

    order = np.argsort(np.asarray(workload.arrivals_s), kind="stable")
    pending = [(float(workload.arrivals_s[i]), workload.trajectories[i], f"r{i}") for i in order]
    next_arrival = 0
    host_s = 0.0
    while next_arrival < len(pending) or not orchestrator.idle:
        while next_arrival < len(pending) and pending[next_arrival][0] <= clock.now:
            arrival, tr, rid = pending[next_arrival]
            # a trajectory recorded up to a length cap cannot say what comes after it
            cap = (workload.max_tokens if tr.finish_reason == "eos" and not workload.ignore_eos
                   else min(workload.max_tokens, len(tr.output_ids)))
            timelines[rid] = _Timeline(arrival=arrival)
            orchestrator.submit(GenerationRequest(prompt_ids=tuple(int(t) for t in tr.prompt_ids), max_tokens=cap,
                                                  ignore_eos=workload.ignore_eos), collect, request_id=rid)
            next_arrival += 1
        if orchestrator.idle:
            clock.now = max(clock.now, pending[next_arrival][0])
            continue
        wall, engine_wall = time.perf_counter(), engine.wall_s
        record = orchestrator.step()
        host = time.perf_counter() - wall - (engine.wall_s - engine_wall)
        if host_time == "measured":
            charged = host
        elif record is None or host_time == "none":
            charged = 0.0
        else:
            charged = record.draft_s + (record.budget_s if host_time == "plan" else 0.0)
        if record is not None:
            charged += deployment.host_overhead[0] + deployment.host_overhead[1] * record.batch
        clock.advance(charged)
        host_s += charged

    lines = [timelines[f"r{i}"] for i in range(len(pending))]
    orchestrator.close()
    tokens = sum(len(line.tokens) for line in lines)
    latency = np.array([line.done - line.arrival for line in lines])
    ttft = np.array([line.first - line.arrival for line in lines])
    tpot = np.array([(line.done - line.first) / (len(line.tokens) - 1) for line in lines if len(line.tokens) > 1])
    gaps = np.array([gap for line in lines for gap in line.gaps])
    records = [r for r in orchestrator.records if r.batch > 0]  # the verify steps (not those that only prefilled)
    start = min(line.arrival for line in lines)
    seconds = max(line.done for line in lines) - start
    metrics = {
        "tokens_per_s": tokens / seconds,
        "latency_mean_s": float(latency.mean()),
        "latency_p50_s": float(np.percentile(latency, 50)),
        "latency_p90_s": float(np.percentile(latency, 90)),
        "latency_p99_s": float(np.percentile(latency, 99)),
        "ttft_p50_s": float(np.percentile(ttft, 50)),
        "ttft_p99_s": float(np.percentile(ttft, 99)),
        "tpot_p50_s": float(np.percentile(tpot, 50)) if tpot.size else None,
        "tpot_p99_s": float(np.percentile(tpot, 99)) if tpot.size else None,
        "stream_gap_p99_s": float(np.percentile(gaps, 99)) if gaps.size else None,  # between a request's updates
        "stream_gap_max_s": float(gaps.max()) if gaps.size else None,
        "tau": (tokens - len(lines)) / max(sum(line.steps for line in lines), 1),
        "mean_nodes_per_request_step": float(np.mean([np.mean(r.nodes) for r in records])) if records else 0.0,
        "steps": len(records),
        "split_steps": sum(r.micro_batches > 1 for r in records),  # steps that verified one micro-batch of several
        "request_steps": sum(r.batch for r in records),
        "drafted_ahead": sum(r.drafted_ahead for r in records),  # their drafting hid behind an earlier verify
        "engine_s": engine.simulated_s,
        "host_s": host_s,
    }
    return SimulationResult(policy=policy, tokens=tokens, seconds=seconds, requests=len(lines), metrics=metrics,
                            outputs=[line.tokens for line in lines])


def default_drafter(max_nodes: int = 64):
    """The product's drafter on the default datastore (built by `make datastore`)."""
    from datastore import Datastore
    from datastore.paths import default_datastore_dir
    from drafter.drafter import Drafter, DrafterConfig

    return Drafter(DrafterConfig(max_budget=max_nodes), datastores=[Datastore.open(default_datastore_dir())])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="retrospec simulate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-3.1-8b", help="bundled shape name or config.json / model folder")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    parser.add_argument("--hardware", default="H100-SXM", help=f"{', '.join(KNOWN_HARDWARE)} or a profile JSON")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--sets", nargs="+", default=["mtbench"], choices=PROMPT_SETS)
    parser.add_argument("--prompts", type=int, default=32, help="requests per prompt set")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--policies", nargs="+", default=["none", "goodput"])
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 16],
                        help="closed loop: all requests at t=0, at most this many running")
    parser.add_argument("--rates", nargs="*", type=float, default=[], help="Poisson arrivals (requests/s)")
    parser.add_argument("--trace", help="CSV of arrival timestamps (seconds): a bursty trace")
    parser.add_argument("--max-running", type=int, default=64, help="batch limit for open-loop arrivals")
    parser.add_argument("--host-time", choices=HOST_TIME, default="draft")
    parser.add_argument("--micro-batches", default="1", type=_auto_or_int,
                        help="1: verify the whole batch every step; auto: split it into micro-batches that take turns "
                        "where that pays (SPIN); N: always N")
    parser.add_argument("--prefill-chunk", type=int, default=None,
                        help="chunked prefill: prompt tokens a step may compute (default: whole prompts)")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    try:
        for policy in args.policies:
            BudgetPolicy.parse(policy)
        spec = hardware(args.hardware)
        deployment = Deployment(ModelShape.from_config(model_config(args.model), tp=args.tp), spec, dtype=args.dtype,
                                device="cpu" if "cpu" in spec.name.lower() else "gpu")
        micro_batches = None if args.micro_batches == "auto" else check_micro_batches(args.micro_batches)
        if micro_batches != 1 and args.host_time == "measured":
            raise ValueError("--micro-batches other than 1 needs --host-time draft, plan or none")
        check_prefill_chunk(args.prefill_chunk)
        deployment.step_model().predict(np.ones(1), np.zeros(1))  # fails fast on a dtype the device lacks
        if args.prompts < 1:
            raise ValueError(f"--prompts must be >= 1 (requests per prompt set); got {args.prompts}")
        if args.max_running < 1:  # `Workload` would name it as a concurrency, the closed loop's word for it
            raise ValueError(f"--max-running must be >= 1 (requests running at once under --rates or --trace); got "
                             f"{args.max_running}")
        trajectories = load_prompt_trajectories(args.sets, args.prompts)
        n = len(trajectories)
        traced = None if not args.trace else trace_arrivals(args.trace, n)  # read before any simulation runs
        # built (and so checked) before any simulation runs
        workloads = [(f"closed c={c}", Workload(tuple(trajectories), args.max_tokens, tuple(closed_loop_arrivals(n)),
                                                c)) for c in args.concurrency]
        workloads += [(f"poisson {r}/s", Workload(tuple(trajectories), args.max_tokens, tuple(poisson_arrivals(n, r)),
                                                  args.max_running)) for r in args.rates]
        if args.trace:
            workloads.append((f"trace {Path(args.trace).name}",
                              Workload(tuple(trajectories), args.max_tokens, tuple(traced), args.max_running)))
    except (ValueError, FileNotFoundError) as exc:
        parser.error(str(exc))
    drafter = default_drafter()
    rows = []
    print(f"{args.model} tp={args.tp} on {deployment.hardware.name}, {n} requests from {', '.join(args.sets)}, "
          f"host time: {args.host_time}")
    for label, workload in workloads:
        base = None
        for policy in args.policies:
            result = simulate(deployment, workload, policy, drafter, host_time=args.host_time,
                              micro_batches=micro_batches, prefill_chunk=args.prefill_chunk)
            m = result.metrics
            base = m["tokens_per_s"] if policy == "none" else base
            speedup = m["tokens_per_s"] / base if base else float("nan")
            rows.append({"workload": label, "policy": policy, **m, "speedup": speedup})
            print(f"  {label:16s} {policy:9s} {m['tokens_per_s']:9.1f} tok/s  speedup {speedup:5.2f}  "
                  f"tau {m['tau']:.2f}  p50 latency {m['latency_p50_s']:.3f}s  TPOT p50 "
                  f"{(m['tpot_p50_s'] or 0) * 1e3:.1f} ms", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
