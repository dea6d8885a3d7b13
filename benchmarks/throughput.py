"""Offline throughput of the serving core: policies side by side on the same engine, drafter and prompts.

    python -m benchmarks.throughput                  # full run (tens of minutes on 2 CPU cores)
    python -m benchmarks.throughput --quick          # the `make demo` version: a few minutes, separate files
    python -m benchmarks.throughput --temperature 0.8 --top-p 0.95 --name throughput_sampled   # sampled, seeded

For each prompt set (recorded eval prompts, `tools/record_trajectories.py`) and concurrency cap, every policy
(`none`, `fixed:4`, `fixed:16`, `fixed:32`, `roofline`, `goodput`) serves the same prompts through `Orchestrator`
(all requests submitted at t=0, at most `cap` running; twice as many prompts as the cap, at least 16, each
generating its reference length with EOS ignored, so every policy does the same work; prompts prefilled in chunks
where the server would chunk them, `--prefill-chunk`). Reports output tokens/s, mean
and p90 request latency, tau (tokens per request-step) and speedup over `none`; the step-time model's median
relative error over every step; and losslessness: an fp32 run in which every policy's outputs must equal `none`'s token for token
(`identical_outputs_fraction`), plus, for the bf16 runs, each divergence from `none` with the gap between the top-2
target logits at the first differing position (only near-ties may diverge). The bf16 engine runs batch-invariant
(`TorchEngine.batch_invariant`), so policies part only where an accepted path left its tree's first-child chain.

Writes benchmarks/results/throughput.json (+ .md, + throughput.png, + throughput_outputs.npz: every row's generated
tokens, which `benchmarks/simulator_validation.py` replays).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.plotting import panels_by_set
from benchmarks.results_files import RESULTS, code_revision, result_name_problem, save_results
from datastore import Datastore
from datastore.paths import default_datastore_dir
from drafter.drafter import Drafter, DrafterConfig
from orchestrator.budget import BudgetController, BudgetPolicy
from orchestrator.core import Orchestrator, check_prefill_chunk
from orchestrator.profiling import fit_step_model, measure_hardware
from orchestrator.request import GenerationRequest
from orchestrator.roofline import FEATURES, ModelShape, StepTimeModel, nonnegative_lstsq
from orchestrator.serving.cli import prefill_chunk_arg, row_table_rows_arg
from orchestrator.serving.stack import serving_prefill_chunk
from tools.prompt_sets import PROMPT_SETS
from tools.trajectories import load_trajectories, spread, trajectory_path
from trt_engines.base import CPU_KERNEL_CHOICES, InvalidField, SamplingParams
from trt_engines.cpu_kernels import cpu_description
from trt_engines.prepare import resolve_model_dir
from trt_engines.torch_engine import TorchEngine

POLICIES = ("none", "fixed:4", "fixed:16", "fixed:32", "roofline", "goodput")
GREEDY = SamplingParams()
SEED_BASE = 1000  # a sampled row's request i is seeded SEED_BASE + i, under every policy alike


def build_stack(dtype: torch.dtype, *, num_blocks: int, max_nodes: int = 64, window: int = 512,
                batch_invariant: bool | None = None, cpu_kernels: str = "auto", table_rows: int = 0):
    engine = TorchEngine("default", dtype=dtype, num_blocks=num_blocks, batch_invariant=batch_invariant,
                         cpu_kernels=cpu_kernels)
    datastore = Datastore.open(default_datastore_dir())
    drafter = Drafter(DrafterConfig(max_budget=max_nodes), datastores=[datastore])
    dtype_name = "float32" if dtype == torch.float32 else "bfloat16"
    # the FLOP/s of the kernels the engine runs, in its own dtype only (`measure_hardware`)
    hardware = measure_hardware("cpu", cpu_kernels=engine.kernel_linears, dtypes=(dtype_name,))
    step_model = StepTimeModel.for_engine(engine, ModelShape.from_config(resolve_model_dir("default")), hardware,
                                          dtype=dtype_name, window=window)
    fit_error = fit_step_model(engine, step_model, table_rows=table_rows)
    warm_up(engine, drafter, step_model)
    return engine, drafter, step_model, fit_error


def warm_up(engine, drafter, step_model) -> None:
    """Serve two calibration prompts briefly with the speculating policies, untimed, so that whatever compiles or
    fills a cache on first use does so here, not inside the first timed group. A fresh clone has no numba cache:
    its first group's goodput row once paid ~6 s of compiling in its budget step (MT-Bench cap 1 at 1.24x `none`
    against `fixed:4`'s 1.45x, `throughput_avx2.json` before this warm-up). The budget controller and the drafter
    now compile their own numba functions when built; this also runs every policy's path once end to end."""
    prompts = [np.asarray(t.prompt_ids) for t in load_trajectories(trajectory_path("chitchat", "calib"))[:2]]
    serve_side_by_side(engine, drafter, step_model, ["goodput", "roofline", "fixed:4"], prompts, cap=1, max_tokens=24)
    engine.reset_prefix_cache()


class PolicyRun:
    """One policy's orchestrator and its own clock: the summed wall time of its own steps only. `micro_batches`:
    the orchestrator's (None: decided per step); `tag` names its requests and prefix-cache salt (default: the
    policy), so two runs of one policy can serve side by side."""

    def __init__(self, engine, drafter, step_model, policy: str, prompts: list[np.ndarray], *, cap: int,
                 max_tokens: int, lengths: list[int] | None = None, micro_batches: int | None = None,
                 tag: str | None = None, prefill_chunk: int | None = None, sampling: SamplingParams = GREEDY):
        self.elapsed = 0.0
        self.step_started: float | None = None
        # Each controller owns its step-time model, as a served orchestrator does: the start-up fit, then refit
        # online from its own recent steps (the default window) and the start-up sweep. A model shared by every
        # policy and every group of the run would predict a cap-1 step from a fit dominated by other batch shapes.
        controller = BudgetController(BudgetPolicy.parse(policy), step_model.clone())
        self.orchestrator = Orchestrator(engine, drafter, controller, max_running=cap, clock=self.clock,
                                         offline_batch=True, micro_batches=micro_batches,
                                         prefill_chunk=prefill_chunk)
        self.finished: dict[str, float] = {}
        self.outputs: dict[str, list[int]] = {}
        self.steps: dict[str, int] = {}
        self.generated = 0
        self.to_generate = sum(lengths) if lengths is not None else max_tokens * len(prompts)  # at most, with EOS
        self.shared_steps = self.own_steps = 0  # steps taken while every other policy was busy too / all its steps
        tag = tag or policy.replace(":", "")
        # `lengths`: exactly that many tokens per request, EOS ignored (the same work for every policy). The salt
        # keeps each policy's prompts in its own prefix cache: they share the chat template's blocks with each other,
        # as a served batch does, but never a prompt another policy prefilled.
        # Sampled, request i draws with seed SEED_BASE + i under every policy: lossless speculation then returns
        # `none`'s very tokens (`trt_engines.sampling`), so the policies still do the same work.
        requests = [GenerationRequest(prompt_ids=tuple(int(t) for t in p), max_tokens=n, ignore_eos=lengths is not None,
                                      cache_salt=tag, sampling=_seeded(sampling, i))
                    for i, (p, n) in enumerate(zip(prompts, lengths or [max_tokens] * len(prompts)))]
        self.ids = [self.orchestrator.submit(r, self.collect, request_id=f"{tag}-p{i}") for i, r in enumerate(requests)]

    def clock(self) -> float:
        return self.elapsed + (time.perf_counter() - self.step_started if self.step_started is not None else 0.0)

    @property
    def progress(self) -> float:
        """Share of its work done: tokens generated / tokens it will generate."""
        return self.generated / max(self.to_generate, 1)

    def collect(self, out) -> None:
        self.outputs.setdefault(out.request_id, []).extend(out.token_ids)
        self.generated += len(out.token_ids)
        if out.finished:
            self.finished[out.request_id] = self.clock()
            self.steps[out.request_id] = out.stats.steps

    def step(self, *, shared: bool) -> None:
        self.own_steps += 1
        self.shared_steps += shared
        self.step_started = time.perf_counter()
        self.orchestrator.step()
        self.elapsed += time.perf_counter() - self.step_started
        self.step_started = None


def _seeded(sampling: SamplingParams, i: int) -> SamplingParams:
    return sampling if sampling.greedy else dataclasses.replace(sampling, seed=SEED_BASE + i)


def sampling_record(sampling: SamplingParams) -> dict | None:
    """How a run sampled, as its results file records it (None: greedy)."""
    return None if sampling.greedy else {"temperature": sampling.temperature, "top_p": sampling.top_p,
                                         "top_k": sampling.top_k, "seed_base": SEED_BASE}


def serve_side_by_side(engine, drafter, step_model, policies: list[str], prompts: list[np.ndarray], *, cap: int,
                       max_tokens: int, lengths: list[int] | None = None, prefill_chunk: int | str | None = "auto",
                       sampling: SamplingParams = GREEDY) -> dict[str, dict]:
    """Serve every prompt (all arriving at t=0, at most `cap` running) with every policy at once, interleaved step by
    step: the next step is always the one of the policy furthest behind in its own work (tokens generated / tokens
    to generate), each policy timed on its own clock (the sum of its own steps' wall time).

    Interleaving at step granularity (tens of ms) makes a burst of background load on this shared machine hit every
    policy alike; whole runs one after the other differed by up to 20% on noise alone (a policy that sends zero
    nodes measured 0.82x `none`). Balancing progress rather than taking turns keeps that true to the end: in turns,
    the faster policies finished first and `none` ran the second half of a cap-1 group alone, where a burst slowed
    it alone (HumanEval cap 1: `none` 23% slower than the run before while the others moved by 4% or less). Balanced,
    every policy's steps during a burst cover the same share of its work, so all finish together
    (`shared_steps_fraction`: the share of a policy's steps taken while every other policy was still busy).
    Engine and step-time model are shared; request ids and prefix-cache salts are per policy, and the engine's
    prefix cache starts empty. Each policy
    drafts with its own `drafter.fresh()`: an output history shared between policies would let one draft a prompt
    from another's output for the same prompt.
    `lengths` (per prompt) fixes every request's output length, EOS ignored; otherwise up to `max_tokens` or EOS.
    `sampling`: every request's (greedy by default; sampled, request i is seeded SEED_BASE + i).
    `prefill_chunk`: the orchestrators' ("auto": what the server runs on this engine, `serving_prefill_chunk`).
    Chunked, a group's admissions are many short steps that take turns with the other policies' steps, instead of
    one long step per policy. Whole, the first step at cap 32 admitted 32 prompts (half the group's prefill, 2-8 s),
    and a burst of background load during one policy's block hit that policy alone. Prefill is the same work for
    every policy, yet its seconds differed by up to 16% between the policies of one group (MT-Bench cap 32 at
    430441d: `none` 4.50 s, the others 4.92-5.24 s). That decided goodput / none there: 0.967 over the row, 0.991
    over the rest of its time.
    """
    prefill_chunk = serving_prefill_chunk(prefill_chunk, engine)
    engine.reset_prefix_cache()  # an earlier run's blocks of these prompts would make their prefills free
    runs = {p: PolicyRun(engine, drafter.fresh(), step_model, p, prompts, cap=cap, max_tokens=max_tokens,
                         lengths=lengths, prefill_chunk=prefill_chunk, sampling=sampling)
            for p in policies}
    interleave(list(runs.values()))
    return {p: summarize_run(r) for p, r in runs.items()}


def interleave(runs: list[PolicyRun]) -> None:
    """Step the runs until all are idle, always the one furthest behind in its work (`serve_side_by_side`; ties,
    such as the steps that prefill a group's first prompts before any token: the one with fewer steps, then the
    first in `runs`, so that they take turns)."""
    while busy := [r for r in runs if not r.orchestrator.idle]:
        min(busy, key=lambda r: (r.progress, r.own_steps)).step(shared=len(busy) == len(runs))


def serve(engine, drafter, step_model, policy: str, prompts: list[np.ndarray], *, cap: int, max_tokens: int,
          prefill_chunk: int | str | None = "auto", sampling: SamplingParams = GREEDY):
    """Serve every prompt with one policy alone; per-request outputs and timings."""
    return serve_side_by_side(engine, drafter, step_model, [policy], prompts, cap=cap, max_tokens=max_tokens,
                              prefill_chunk=prefill_chunk, sampling=sampling)[policy]


def summarize_run(run: PolicyRun) -> dict:
    ids, outputs, steps, orchestrator = run.ids, run.outputs, run.steps, run.orchestrator
    wall = run.elapsed
    latencies = np.array([run.finished[i] for i in ids])
    n_tokens = sum(len(outputs[i]) for i in ids)
    every_step = list(orchestrator.records)  # prefills included: with chunks, steps that only prefilled (batch 0)
    records = [r for r in every_step if r.batch > 0]  # the verify steps
    step_errors = [abs(r.predicted_s - r.measured_s) / r.measured_s for r in records if r.measured_s > 0]
    # (tokens computed, seconds, tokens already cached that they attended to: the prefix-cache hit of an admission,
    # or that and the prompt's earlier chunks)
    prefills = [(n, t, c) for r in every_step for n, t, c in zip(r.prefill_tokens, r.prefill_s, r.prefill_context)]
    model = orchestrator.budget.step_model
    samples = [(model.features(1.0 + np.asarray(r.nodes, np.float64), np.asarray(r.context, np.float64)), r.measured_s)
               for r in records]
    verify_s, prefill_s = sum(r.measured_s for r in records), sum(t for _, t, _ in prefills)
    draft_s, budget_s = sum(r.draft_s for r in records), sum(r.budget_s for r in records)
    # Host work that is neither verification, drafting, budgeting nor prefill: acceptance, KV commits, streaming.
    host_steps = [(r.batch, r.step_s - r.measured_s - r.draft_s - r.budget_s - sum(r.prefill_s)) for r in every_step]
    return {
        "outputs": [outputs[i] for i in ids],
        "tokens": n_tokens,
        "seconds": wall,
        "tokens_per_s": n_tokens / wall,
        "latency_mean_s": float(latencies.mean()),
        "latency_p90_s": float(np.percentile(latencies, 90)),
        # tokens per request-step: the first token comes from prefill, the rest from verification steps
        "tau": (n_tokens - len(ids)) / max(sum(steps.values()), 1),
        "mean_nodes_per_request_step": float(np.mean([np.mean(r.nodes) for r in records])) if records else 0.0,
        "time_split_s": {"verify": verify_s, "prefill": prefill_s, "draft": draft_s, "budget": budget_s,
                         "other": wall - verify_s - prefill_s - draft_s - budget_s},
        "steps": len(records),
        "shared_steps_fraction": run.shared_steps / max(run.own_steps, 1),
        "step_rel_errors": step_errors,
        "step_model_median_abs_err": float(np.median(step_errors)) if step_errors else None,
        "prefills": prefills,
        "samples": samples,
        "host_steps": host_steps,
        "drafter_fallbacks": orchestrator.drafter_fallbacks,
    }


def first_divergence_gap(engine, prompt: np.ndarray, reference: list[int], other: list[int]) -> dict:
    """Where `other` first differs from `reference`: the position and the target's top-2 logit gap there."""
    at = next(i for i, (a, b) in enumerate(zip(reference, other)) if a != b)
    logits = engine.debug_logits([list(prompt) + reference[:at]])[0][-1].float()
    top2 = torch.topk(logits, 2).values
    return {"position": at, "top2_logit_gap": float(top2[0] - top2[1])}


def group_sample(trajectories: list, cap: int, prompts_per_cap) -> list:
    """The prompts a (set, cap) group serves: `prompts_per_cap(cap)` of them, spread over the set (every MT-Bench
    category, not only the first)."""
    return spread(trajectories, prompts_per_cap(cap))


def run(sets: list[str], caps: list[int], policies: list[str], *, prompts_per_cap, max_tokens: int,
        identity_prompts: int, rounds: int = 1, cpu_kernels: str = "auto",
        prefill_chunk: int | str | None = "auto", sampling: SamplingParams = GREEDY, table_rows: int = 0) -> dict:
    """Every (set, cap) serves its prompts with all policies side by side (`serve_side_by_side`), `rounds` times;
    a row reports its fastest round."""
    torch.set_num_threads(os.cpu_count() or 2)
    # Every policy holds its own `cap` requests at once: room for all of them (prompt + output + the largest tree).
    longest = max(len(t.prompt_ids) for name in sets for t in load_trajectories(trajectory_path(name, "eval")))
    num_blocks = len(policies) * max(caps) * -(-(longest + max_tokens + 65) // 16) + 64
    engine, drafter, step_model, fit_error = build_stack(torch.bfloat16, num_blocks=num_blocks, cpu_kernels=cpu_kernels,
                                                         table_rows=table_rows)
    initial_coefficients = step_model.coefficients.tolist()
    chunk = serving_prefill_chunk(prefill_chunk, engine)
    rows, divergences, all_errors, prefills, group_fits, all_samples = [], [], [], [], [], []
    outputs: dict[str, np.ndarray] = {}
    for set_name in sets:
        trajectories = load_trajectories(trajectory_path(set_name, "eval"))
        for cap in caps:
            sample = group_sample(trajectories, cap, prompts_per_cap)
            prompts = [t.prompt_ids for t in sample]
            # Every policy generates each prompt's reference length (the target's own greedy output, from the recorded
            # trajectory, up to max_tokens), EOS ignored, as vLLM's throughput benchmark fixes output lengths: in
            # bf16 the policies' outputs part at near-ties, and a parted output that ends sooner or later changes a
            # row's work, not its speed (with EOS honoured, one row's policies generated 1729 to 2046 tokens).
            lengths = [min(max_tokens, len(t.output_ids)) for t in sample]
            samples_before, prefills_before, host_steps = len(all_samples), len(prefills), []
            runs: dict[str, list[dict]] = {p: [] for p in policies}
            for r in range(rounds):
                order = policies[r % len(policies):] + policies[: r % len(policies)]
                for policy, result in serve_side_by_side(engine, drafter, step_model, order, prompts, cap=cap,
                                                         max_tokens=max_tokens, lengths=lengths,
                                                         prefill_chunk=chunk, sampling=sampling).items():
                    runs[policy].append(result)
            reference = runs["none"][0]["outputs"] if "none" in runs else None
            group = []
            for policy in policies:
                for result in runs[policy]:
                    all_errors += result.pop("step_rel_errors")
                    prefills += result.pop("prefills")
                    all_samples += result.pop("samples")
                    host_steps += result.pop("host_steps")
                    outs = result.pop("outputs")
                    if result is runs[policy][0]:  # what the simulator validation replays (first round)
                        key = f"{set_name}_{cap}_{policy.replace(':', '')}"
                        outputs[f"{key}_tokens"] = np.concatenate([np.asarray(o, np.int32) for o in outs])
                        outputs[f"{key}_lengths"] = np.array([len(o) for o in outs], np.int32)
                    if policy != "none" and reference is not None and result is runs[policy][0]:
                        for p, ref, out in zip(prompts, reference, outs):
                            if ref != out:
                                divergences.append({"set": set_name, "cap": cap, "policy": policy,
                                                    **first_divergence_gap(engine, p, ref, out)})
                best = max(runs[policy], key=lambda x: x["tokens_per_s"])
                group.append({"set": set_name, "cap": cap, "policy": policy, "prompts": len(prompts), **best,
                              "tokens_per_s_rounds": [x["tokens_per_s"] for x in runs[policy]]})
            base = next((g["tokens_per_s"] for g in group if g["policy"] == "none"), None)
            for row in group:
                row["speedup"] = row["tokens_per_s"] / base if base else float("nan")
                print(f"{set_name:10s} cap={cap:<3d} {row['policy']:9s} {row['tokens_per_s']:7.1f} tok/s "
                      f"tau={row['tau']:.2f} speedup={row['speedup']:.2f} p90={row['latency_p90_s']:.1f}s "
                      f"rounds={[round(x) for x in row['tokens_per_s_rounds']]}", flush=True)
            rows += group
            group_fits.append(_group_fit(step_model, set_name, cap, all_samples[samples_before:],
                                         prefills[prefills_before:], host_steps))
    # One fit over every verify step of the run, and one over every prefill: what `retrospec simulate` uses to
    # replay this run (prefills are compute-bound and have their own constants).
    step_model.fit_samples(all_samples)
    prefill_model = step_model.clone()
    prefill_model.fit([(np.array([float(n)]), np.array([float(c)]), t) for n, t, c in prefills])
    per_set = -(-identity_prompts // len(sets))
    identity_prompts_ids = [t.prompt_ids for name in sets
                            for t in load_trajectories(trajectory_path(name, "eval"))[:per_set]]
    identity = (identity_check(identity_prompts_ids, policies, max_tokens=min(max_tokens, 48),
                               prefill_chunk=prefill_chunk, sampling=sampling) if identity_prompts else None)
    return {"rows": rows, "bf16_divergences": divergences, "step_fit_error": fit_error,
            "batch_invariant": engine.batch_invariant,
            "cpu_kernels": engine.cpu_kernels,  # where numba kernels run (`TorchEngine`): "numba", "attention" or "torch"
            "output_lengths": "reference",  # each request: its recorded trajectory's length, EOS ignored
            "prompt_sample": "spread",  # a row's prompts: `tools.trajectories.spread` over the eval set
            "interleave": "progress",  # `serve_side_by_side`: the policy furthest behind steps next (was: in turns)
            "prefill_chunk": chunk,  # prompt tokens a step prefilled at most (None: whole prompts at admission)
            "sampling": sampling_record(sampling),
            "step_model_median_abs_err": float(np.median(all_errors)) if all_errors else None,
            "identity": identity, "rounds": rounds, "group_fits": group_fits,
            "hardware": dataclasses.asdict(step_model.hardware),
            "step_model": {"dtype": step_model.dtype, "coefficients": step_model.coefficients.tolist(),
                           "attention_layout": step_model.attention_layout,
                           # the measured row table the linear feature read (None: the roofline's row terms)
                           "row_seconds": None if step_model.row_seconds is None else step_model.row_seconds.tolist(),
                           "features": list(FEATURES), "fitted_on_steps": len(all_samples),
                           "start_up_coefficients": initial_coefficients},
            "outputs": outputs,
            "prefill_model": {"coefficients": prefill_model.coefficients.tolist(), "fitted_on_prefills": len(prefills)}}


def _group_fit(step_model: StepTimeModel, set_name: str, cap: int, samples, prefills, host_steps) -> dict:
    """Step-time and prefill fits over one (set, cap) group's steps (all its policies ran side by side, so they saw
    the same machine): the simulator validation replays each group with its own fit, because this shared machine's
    speed drifts over a run of the whole benchmark."""
    steps = step_model.clone()
    steps.fit_samples(samples)
    prefill = step_model.clone()
    prefill.fit([(np.array([float(n)]), np.array([float(c)]), t) for n, t, c in prefills])
    return {"set": set_name, "cap": cap, "steps": len(samples), "prefills": len(prefills),
            "step_model": steps.coefficients.tolist(), "prefill_model": prefill.coefficients.tolist(),
            "host_overhead": fit_host_overhead(host_steps)}


def fit_host_overhead(host_steps: list[tuple[int, float]]) -> list[float]:
    """Seconds of host work per step (beyond verify, drafting, budgeting and prefill) as a + b x running requests,
    fitted by least squares with a, b >= 0 (the simulator charges it per step)."""
    if not host_steps:
        return [0.0, 0.0]
    batch, seconds = np.array(host_steps, dtype=np.float64).T
    return nonnegative_lstsq(np.stack([np.ones_like(batch), batch], axis=1), seconds).tolist()


def identity_check(prompts: list[np.ndarray], policies: list[str], *, max_tokens: int, cap: int = 8,
                   dtype: torch.dtype = torch.float32, batch_invariant: bool | None = None,
                   cpu_kernels: str = "auto", prefill_chunk: int | str | None = "auto",
                   sampling: SamplingParams = GREEDY) -> dict:
    """Every policy's outputs against `none`'s, token for token (fp32: they must all be equal); for each output that
    differs, the top-2 logit gap at the first differing position. `sampling`: the requests' (seeded as
    `serve_side_by_side` seeds them, so sampled outputs must be equal too)."""
    engine, drafter, step_model, _ = build_stack(dtype, num_blocks=4096, batch_invariant=batch_invariant,
                                                 cpu_kernels=cpu_kernels)
    reference = serve(engine, drafter, step_model, "none", prompts, cap=cap, max_tokens=max_tokens,
                      prefill_chunk=prefill_chunk, sampling=sampling)["outputs"]
    per_policy, gaps = {}, []
    for policy in policies:
        if policy == "none":
            continue
        outs = serve(engine, drafter.fresh(), step_model, policy, prompts, cap=cap, max_tokens=max_tokens,
                     prefill_chunk=prefill_chunk, sampling=sampling)["outputs"]
        same = [a == b for a, b in zip(reference, outs)]
        per_policy[policy] = {"identical": int(sum(same)), "compared": len(same)}
        gaps += [first_divergence_gap(engine, p, a, b)["top2_logit_gap"]
                 for p, a, b, s in zip(prompts, reference, outs, same) if not s]
        print(f"{policy:9s} outputs identical to none's: {sum(same)}/{len(same)}", flush=True)
    identical = sum(v["identical"] for v in per_policy.values())
    compared = sum(v["compared"] for v in per_policy.values())
    return {"prompts": len(prompts), "max_tokens": max_tokens, "compared": compared, "identical": identical,
            "identical_outputs_fraction": identical / max(compared, 1), "per_policy": per_policy,
            "first_divergence_top2_gaps": gaps}


def summarize(result: dict, sets: list[str]) -> dict:
    rows = result["rows"]
    summary: dict[str, float | None] = {}
    for s in sets:
        for cap in (1, 16):
            row = next((r for r in rows if (r["set"], r["cap"], r["policy"]) == (s, cap, "goodput")), None)
            if row:
                summary[f"speedup_goodput_c{cap}_{s}"] = row["speedup"]
    vs_fixed, vs_none = [], []
    for s, cap in {(r["set"], r["cap"]) for r in rows}:
        group = {r["policy"]: r["tokens_per_s"] for r in rows if (r["set"], r["cap"]) == (s, cap)}
        fixed = [v for k, v in group.items() if k.startswith("fixed")]
        if "goodput" in group and fixed:
            vs_fixed.append(group["goodput"] / max(fixed))
        if "goodput" in group and "none" in group:
            vs_none.append(group["goodput"] / group["none"])
    summary["goodput_vs_best_fixed_min"] = min(vs_fixed) if vs_fixed else None
    summary["goodput_vs_none_min"] = min(vs_none) if vs_none else None
    summary["step_model_median_abs_err"] = result["step_model_median_abs_err"]
    # None when the fp32 check was not run (--identity-prompts 0)
    summary["identical_outputs_fraction"] = (result["identity"] or {}).get("identical_outputs_fraction")
    summary["bf16_divergences"] = len(result["bf16_divergences"])
    return summary


def _min_shared(rows: list[dict]) -> float:
    return min((r["shared_steps_fraction"] for r in rows if "shared_steps_fraction" in r), default=float("nan"))


def write_markdown(path: Path, result: dict) -> None:
    rows = result["rows"]
    kernels = _kernel_mode(result)
    lines = [
        "# Offline throughput: speculation policies side by side",
        "",
        f"Command: `{result['command']}`. Model: SmolLM2-135M-Instruct, bf16, TorchEngine on {result['machine']}"
        + (f" with {_KERNEL_WORDS[kernels]}, batch-invariant by construction (a token's logits do not depend on the "
           "batch or the tree, nor on the branch it is verified on)." if kernels in _KERNEL_WORDS else
           " in batch-invariant numerics (a token's logits do not depend on the batch or the tree it is verified in)."
           if result.get("batch_invariant") else "."),
        (f"Each request generates its reference length (its recorded greedy output's, at most {result['max_tokens']} "
         "tokens), EOS ignored, so every policy does the same work (in bf16 outputs may part at near-ties); "
         if result.get("output_lengths") == "reference" else f"{result['max_tokens']} new tokens per request; ")
        + "all requests arrive at t=0; at most `cap` run at once"
        + (f", and a step prefills at most {result['prefill_chunk']} prompt tokens (chunked prefill, as the server runs "
           "this engine). " if result.get("prefill_chunk") else ". ")
        + ("A row's prompts are spread evenly over the set's eval prompts (for MT-Bench: every category)."
           if result.get("prompt_sample") == "spread" else "A row's prompts are the set's first eval prompts.")
        + (f" Sampled, not greedy: temperature {result['sampling']['temperature']}, top_p "
           f"{result['sampling']['top_p']}; request i of a row is seeded {result['sampling']['seed_base']} + i under "
           "every policy, so lossless speculation returns `none`'s very tokens." if result.get("sampling") else ""),
        ("All policies of a (set, cap) run side by side, interleaved step by step: the policy furthest behind in its "
         "own work (share of its tokens generated) steps next, so all finish together; each is timed on its own clock "
         "(the sum of its own steps' wall time), so background load on this shared machine hits them alike "
         f"(every row took at least {_min_shared(rows):.0%} of its steps while all the others were still running)."
         if result.get("interleave") == "progress" else
         "All policies of a (set, cap) run side by side: one step of each policy in turn, each timed on its own clock "
         "(the sum of its own steps' wall time), so background load on this shared machine hits them alike.")
        + (f" Each row is the fastest of {result['rounds']} such rounds (all rounds in the JSON)." if result["rounds"] > 1
           else ""),
        "",
        "| set | cap | policy | tok/s | speedup vs none | tau | nodes/req/step | latency mean s | latency p90 s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['set']} | {r['cap']} | {r['policy']} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f} | "
                     f"{r['tau']:.2f} | {r['mean_nodes_per_request_step']:.1f} | {r['latency_mean_s']:.2f} | "
                     f"{r['latency_p90_s']:.2f} |")
    ident = result["identity"]
    lines += [
        "",
        f"Losslessness (fp32, {ident['prompts']} prompts x {ident['max_tokens']} tokens, every policy vs none): "
        f"{ident['identical']}/{ident['compared']} identical." if ident else "Losslessness (fp32): not checked in this run.",
        divergence_summary(result["bf16_divergences"], result.get("batch_invariant", False),
                           _kernel_mode(result) in _KERNEL_WORDS),
        f"Step-time model: median relative error {result['step_model_median_abs_err']:.3f} over every step "
        f"(start-up fit error {result['step_fit_error']:.3f}).",
    ]
    for replaced in result.get("replaced_groups", []):
        groups = ", ".join(f"{s} cap {c}" for s, c in replaced["groups"])
        rounds = replaced.get("rounds", 1)
        lines.append(f"Re-measured after the run and replaced: {groups}, with `{replaced['command']}`"
                     + (f", each of its rows the fastest of {rounds} rounds (every round's tok/s in the JSON's "
                        "`tokens_per_s_rounds`)" if rounds > 1 else "")
                     + (f". Why: {replaced['note']}" if replaced.get("note") else "") + ". The run-wide step-time "
                     "error and fits above are the original run's.")
    lines += [
        "",
        "## Summary",
        "",
        "```json",
        json.dumps(result["summary"], indent=2),
        "```",
    ]
    path.write_text("\n".join(lines) + "\n")


def group_shapes(rows: list[dict]) -> dict[tuple[str, int], list[tuple[str, int]]]:
    """Per (set, cap) group of result rows, its sorted (policy, prompts) pairs."""
    shapes: dict[tuple[str, int], list[tuple[str, int]]] = {}
    for r in rows:
        shapes.setdefault((r["set"], r["cap"]), []).append((r["policy"], r["prompts"]))
    return {g: sorted(pairs) for g, pairs in sorted(shapes.items())}


def planned_shapes(sets: list[str], caps: list[int], policies: list[str],
                   prompts_per_cap) -> dict[tuple[str, int], list[tuple[str, int]]]:
    """The (policy, prompts) pairs `run` will measure per group: `group_shapes` of its rows, before running it."""
    shapes = {}
    for set_name in sets:
        trajectories = load_trajectories(trajectory_path(set_name, "eval"))
        for cap in caps:
            shapes[set_name, cap] = sorted((p, len(group_sample(trajectories, cap, prompts_per_cap))) for p in policies)
    return shapes


def check_replaceable(name: str, shapes: dict[tuple[str, int], list[tuple[str, int]]], max_tokens: int,
                      new: dict | None = None, sampling: dict | None = None, table_rows: int = 0) -> dict:
    """The results file `name`, if its groups `shapes` (`group_shapes`) can be replaced by a run with `max_tokens`,
    `sampling` (`sampling_record`) and a row table of `table_rows` rows (and, once run, by the result `new`); else
    SystemExit naming what differs.
    `main` calls it before measuring anything, `replace_groups` again with the result."""
    path, outputs_path = RESULTS / f"{name}.json", RESULTS / f"{name}_outputs.npz"
    if not path.is_file() or not outputs_path.is_file():
        raise SystemExit(f"--replace-groups: {path} or {outputs_path} is missing; run the whole benchmark first")
    old = json.loads(path.read_text())
    measured = group_shapes(old["rows"])
    missing = [g for g in shapes if g not in measured]
    if missing:
        raise SystemExit(f"--replace-groups: {path.name} has no rows for {missing}; replace only groups it measured")
    if old.get("max_tokens") != max_tokens:
        raise SystemExit(f"--replace-groups: {path.name} ran with --max-tokens {old.get('max_tokens')}; use the same")
    if old.get("sampling") != (new.get("sampling") if new is not None else sampling):
        raise SystemExit(f"--replace-groups: {path.name} sampled with {old.get('sampling') or 'greedy decoding'}; "
                         "pass the same --temperature and --top-p")
    if new is not None:
        table_rows = len(new.get("step_model", {}).get("row_seconds") or ())
    old_rows = len(old.get("step_model", {}).get("row_seconds") or ())
    if old_rows != table_rows:  # the step-time model then priced rows another way (and its coefficients differ)
        raise SystemExit(f"--replace-groups: {path.name} priced a step's rows "
                         f"{f'by a {old_rows}-row table' if old_rows else 'by the roofline'}; pass --row-table-rows "
                         f"{old_rows}")
    for g, shape in shapes.items():  # the same policies and prompts, or the swapped rows would measure something else
        if measured[g] != shape:
            raise SystemExit(f"--replace-groups: {path.name} measured {g} with (policy, prompts) {measured[g]}; "
                             f"this run uses {shape}: use the same --policies")
    if new is None:
        return old
    if old.get("prompt_sample", "first") != new.get("prompt_sample", "first"):
        raise SystemExit(f"--replace-groups: {path.name} took its prompts another way ({old.get('prompt_sample', 'first')}"
                         f" n of each set); rerun the whole benchmark")
    if old.get("interleave", "turns") != new.get("interleave", "turns"):
        raise SystemExit(f"--replace-groups: {path.name} interleaved its policies another way "
                         f"({old.get('interleave', 'turns')}); rerun the whole benchmark")
    if old.get("prefill_chunk") != new.get("prefill_chunk"):
        raise SystemExit(f"--replace-groups: {path.name} prefilled {old.get('prefill_chunk') or 'whole'} prompt tokens "
                         f"per step; pass --prefill-chunk {old.get('prefill_chunk') or 0}")
    if _kernel_mode(old) != _kernel_mode(new):
        raise SystemExit(f"--replace-groups: {path.name} ran its engine with cpu_kernels {_kernel_mode(old)!r}; pass "
                         f"--cpu-kernels {_kernel_mode(old)}")
    return old


def replace_groups(name: str, new: dict, *, command: str, note: str | None) -> dict:
    """The results file `name` with the (set, cap) groups measured in `new` replaced (rows, per-group fits, bf16
    divergences, generated outputs); its other groups, fp32 identity check and run-wide fits stay. For a group whose
    first measurement overlapped other foreground work on this 2-core machine; the file records each replacement."""
    old = check_replaceable(name, group_shapes(new["rows"]), new["max_tokens"], new)
    outputs_path = RESULTS / f"{name}_outputs.npz"
    groups = list(group_shapes(new["rows"]))

    def swap(old_items: list[dict], new_items: list[dict]) -> list[dict]:  # keeps the original order of groups
        out, done = [], set()
        for item in old_items:
            g = (item["set"], item["cap"])
            if g not in groups:
                out.append(item)
            elif g not in done:
                done.add(g)
                out += [x for x in new_items if (x["set"], x["cap"]) == g]
        return out

    old["rows"], old["group_fits"] = swap(old["rows"], new["rows"]), swap(old["group_fits"], new["group_fits"])
    old["bf16_divergences"] = [d for d in old["bf16_divergences"] if (d["set"], d["cap"]) not in groups] + \
        new["bf16_divergences"]
    with np.load(outputs_path) as arrays:
        outputs = {k: arrays[k] for k in arrays.files if not any(k.startswith(f"{s}_{c}_") for s, c in groups)}
    outputs.update(new["outputs"])
    np.savez_compressed(outputs_path, **outputs)
    old.setdefault("code_revision", None)  # measured before results files named their commit: unknown, not this one
    old.setdefault("replaced_groups", []).append({"groups": [list(g) for g in groups], "command": command,
                                                  "rounds": new.get("rounds", 1), "seconds": new["seconds"], "note": note,
                                                  "code_revision": code_revision()})
    old["summary"] = summarize(old, list(dict.fromkeys(r["set"] for r in old["rows"])))
    return old


def recorded_command(argv: list[str]) -> str:
    """The command line a results file records: without `--note`, which `replace_groups` records beside it."""
    kept, args = [], iter(argv)
    for arg in args:
        if arg == "--note":
            next(args, None)  # its value
        elif not arg.startswith("--note="):
            kept.append(arg)
    return shlex.join(["python", "-m", "benchmarks.throughput", *kept])


_KERNEL_WORDS = {"numba": "its numba CPU kernels", "attention": "its numba attention kernel and PyTorch's linear layers"}


def _kernel_mode(result: dict) -> str:
    """Where the run's engine ran numba kernels (`TorchEngine.cpu_kernels`); results before the "attention" mode
    recorded a bool (True: "numba")."""
    mode = result.get("cpu_kernels", False)
    return {True: "numba", False: "torch"}.get(mode, mode) if isinstance(mode, bool) else mode


def divergence_summary(divergences: list[dict], batch_invariant: bool = False, cpu_kernels: bool = False) -> str:
    """bf16 outputs may leave `none`'s only at near-ties: report how many did and the widest top-2 logit gap."""
    if not divergences:
        return "bf16: every policy's outputs equal `none`'s, token for token."
    gaps = np.array([d["top2_logit_gap"] for d in divergences])
    where = ("although the engine's kernels are batch-invariant by construction (a bug: please report it)"
             if cpu_kernels else
             "where an accepted path left its tree's first-child chain, whose keys then sit behind masked siblings and "
             "are summed in another order (the engine is otherwise batch-invariant)" if batch_invariant else
             "where verifying more tokens in one batch rounds differently")
    return (f"bf16: {len(divergences)} outputs diverge from `none`'s (of all non-`none` runs); at the first differing "
            f"position the target's top-2 logits differ by at most {gaps.max():.3f} (median {np.median(gaps):.3f}, "
            f"{np.mean(gaps == 0):.0%} exact ties): near-ties at bf16 precision (logits of magnitude 16-128 are "
            f"0.125-0.5 apart in bf16), {where} and can flip the argmax. The fp32 run above is the losslessness check. "
            "Full list in the JSON.")


def plot(path: Path, rows: list[dict]) -> None:
    panels_by_set(path, rows, x="cap", y="speedup", series_key="policy", series=POLICIES, highlight="goodput",
                  xlabel="concurrency cap", ylabel="speedup over none", baseline=1.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sets", nargs="+", default=list(PROMPT_SETS), choices=PROMPT_SETS)
    parser.add_argument("--caps", nargs="+", type=int, default=[1, 4, 16, 32])
    parser.add_argument("--policies", nargs="+", default=list(POLICIES))
    # 192 tokens: long enough for the self-repetition that speculation exploits in real answers to show up (MT-Bench
    # answers run to hundreds of tokens; a short cut ends most of them before the model starts repeating itself).
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--identity-prompts", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=1, help="serve each (set, cap, policy) this many times; "
                        "rows report the fastest round (a noisy machine only ever slows a run down)")
    parser.add_argument("--quick", action="store_true", help="2 sets, caps 1 and 4, 3 policies, 128 tokens, twice "
                        "the cap in prompts (at least 4)")
    parser.add_argument("--name", help="results file name (default: throughput, or throughput_quick with --quick); "
                        "names ending in _quick are not committed")
    parser.add_argument("--replace-groups", action="store_true",
                        help="re-measure only the --sets x --caps groups and replace them in the existing results file "
                        "(its other groups, fp32 identity check and run-wide fits stay; the file records the "
                        "replacement): for groups whose first measurement overlapped other work on the machine")
    parser.add_argument("--note", help="with --replace-groups: why the groups were re-measured (recorded)")
    parser.add_argument("--cpu-kernels", default="auto", choices=CPU_KERNEL_CHOICES,
                        help="where the bf16 engine runs numba kernels (`TorchEngine`); auto: by the CPU")
    parser.add_argument("--prefill-chunk", type=prefill_chunk_arg, default="auto",
                        help="prompt tokens a step may prefill; 0: whole prompts at admission (default: auto, what the "
                        "server runs on this engine: 256 for bf16 on the CPU, whole prompts in fp32)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sample every request at this temperature (default 0: greedy); request i of a row is "
                        f"seeded {SEED_BASE} + i under every policy, so their outputs must still equal `none`'s")
    parser.add_argument("--top-p", type=float, default=1.0, help="with --temperature: the nucleus (default 1: none)")
    parser.add_argument("--row-table-rows", type=row_table_rows_arg, default=0,
                        help="the step-time model prices rows by a table of 1..N rows measured at start-up "
                        "(`orchestrator.profiling.measure_row_seconds`; default 0: the roofline's rows)")
    args = parser.parse_args(argv)
    if args.quick:
        args.sets, args.caps = ["grounded", "mtbench"], [1, 4]
        args.policies, args.max_tokens, args.identity_prompts = ["none", "fixed:16", "goodput"], 128, 4
        args.rounds = 1
        # As the full run (below), twice the cap, and 128 tokens: with `cap` prompts of 64 tokens a cap-4 row was
        # one batch that prefilled and drained, which prefill and the controller's first steps dominated, and
        # goodput there could fall below none where the full run (`throughput_avx2.md`) has it 1.09-1.21x. A row
        # this short still moves a few percent from run to run.
        prompts_per_cap = lambda cap: max(2 * cap, 4)  # noqa: E731
    else:
        # Twice the cap: the cap stays full while a queue waits, as under a concurrency limit in service.
        # With only `cap` prompts a row measured one draining batch, whose time the slowest request sets: speeding
        # up the others then buys almost nothing, and every policy that speculates on them looked worse than it is.
        # At least 16, so that a small-cap row does not rest on a handful of prompts.
        prompts_per_cap = lambda cap: max(2 * cap, 16)  # noqa: E731
    # Everything a run of tens of minutes could trip over at its end is checked before it starts.
    for policy in args.policies:
        try:
            BudgetPolicy.parse(policy)
        except ValueError as exc:
            parser.error(f"--policies: {exc}")
    repeated = sorted({p for p in args.policies if args.policies.count(p) > 1})
    if repeated:  # one row per policy: a second run of the same policy would be dropped, not compared
        parser.error(f"--policies lists {', '.join(repeated)} more than once; for repeats use --rounds")
    for option, values, least in (("--caps", args.caps, 1), ("--max-tokens", [args.max_tokens], 1),
                                  ("--rounds", [args.rounds], 1), ("--identity-prompts", [args.identity_prompts], 0)):
        if min(values) < least:
            parser.error(f"{option} must be >= {least}; got {min(values)}")
    if args.prefill_chunk not in ("auto", None):
        try:
            check_prefill_chunk(args.prefill_chunk)
        except ValueError as exc:
            parser.error(f"--prefill-chunk: {exc}")
    try:
        sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p)
    except InvalidField as exc:
        parser.error(f"--{exc.field.replace('_', '-')}: {exc}")
    if args.top_p != 1.0 and sampling.greedy:
        parser.error("--top-p samples only with a --temperature above 0 (greedy decoding has no nucleus)")
    if args.name is not None and (problem := result_name_problem(args.name)):
        parser.error(f"--name {problem}")
    name = args.name or ("throughput_quick" if args.quick else "throughput")
    if args.replace_groups:
        check_replaceable(name, planned_shapes(args.sets, args.caps, args.policies, prompts_per_cap),
                          args.max_tokens, sampling=sampling_record(sampling), table_rows=args.row_table_rows)
    started = time.perf_counter()
    result = run(args.sets, args.caps, args.policies, prompts_per_cap=prompts_per_cap, max_tokens=args.max_tokens,
                 identity_prompts=0 if args.replace_groups else args.identity_prompts, rounds=args.rounds,
                 cpu_kernels=args.cpu_kernels, prefill_chunk=args.prefill_chunk, sampling=sampling,
                 table_rows=args.row_table_rows)
    command = recorded_command(argv if argv is not None else sys.argv[1:])
    result["max_tokens"] = args.max_tokens
    result["seconds"] = round(time.perf_counter() - started, 1)
    if args.replace_groups:
        result = replace_groups(name, result, command=command, note=args.note)
        markdown = save_results(name, result, write_markdown)
        if name == "throughput":
            plot(RESULTS / "throughput.png", result["rows"])
        print(markdown.read_text())
        return 0
    result["summary"] = summarize(result, args.sets)
    result["command"] = command
    result["machine"] = cpu_description()
    # Every row's outputs (first round), for the simulator validation to replay what was actually generated.
    outputs_file = RESULTS / f"{name}_outputs.npz"
    np.savez_compressed(outputs_file, **result.pop("outputs"))
    result["outputs_file"] = outputs_file.name
    markdown = save_results(name, result, write_markdown)
    if name == "throughput":
        plot(RESULTS / "throughput.png", result["rows"])
    print(markdown.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
