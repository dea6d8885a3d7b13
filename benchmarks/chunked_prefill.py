"""What chunked prefill does for the requests already decoding when a long prompt arrives (the default model, bf16,
`TorchEngine` with its CPU kernels, the goodput policy).

Each group: four MT-Bench requests decode (128 tokens each); after `--arrive-step` steps a long grounded prompt
arrives (32 tokens). Without chunks its whole prefill runs inside one step, and every stream waits for it; with
`prefill_chunk` N each step prefills at most N of its tokens beside the verify. One orchestrator per setting over
the same engine, interleaved step by step (request ids and prefix-cache salts per setting, the cache emptied per
group), each timed on its own clock (the sum of its own steps' wall time), so background load hits them alike.
Every setting must stream the same tokens for every request (the run fails otherwise): chunks are exact.

    .venv/bin/python -m benchmarks.chunked_prefill [--chunks 256 64] [--long 3]

Writes benchmarks/results/chunked_prefill.{json,md}.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.results_files import save_results
from orchestrator.budget import BudgetController, BudgetPolicy
from orchestrator.core import Orchestrator, check_prefill_chunk
from orchestrator.request import GenerationRequest
from tools.trajectories import load_trajectories, spread, trajectory_path
from trt_engines.cpu_kernels import cpu_description

STREAMS = 4
STREAM_TOKENS = 128
LONG_TOKENS = 32


class _Setting:
    """One `prefill_chunk` setting's orchestrator, its own clock and what its streams saw."""

    def __init__(self, engine, drafter, step_model, chunk: int | None, streams: list[np.ndarray], long: np.ndarray, *,
                 arrive_step: int):
        self.name = "whole" if chunk is None else str(chunk)
        self.elapsed, self.step_started = 0.0, None
        controller = BudgetController(BudgetPolicy.parse("goodput"), step_model.clone())
        self.orchestrator = Orchestrator(engine, drafter, controller, max_running=STREAMS + 1, clock=self.clock,
                                         prefill_chunk=chunk)
        self.long, self.arrive_step, self.steps = long, arrive_step, 0
        self.long_id = f"{self.name}-long"
        self.outputs: dict[str, list[int]] = {}
        self.last: dict[str, float] = {}
        self.gaps: list[tuple[float, float]] = []  # (when, seconds since the stream's previous update), streams only
        self.arrived: float | None = None
        self.long_first: float | None = None
        for i, prompt in enumerate(streams):
            self.orchestrator.submit(GenerationRequest(prompt_ids=tuple(int(t) for t in prompt),
                                                       max_tokens=STREAM_TOKENS, ignore_eos=True,
                                                       cache_salt=self.name), self.collect, request_id=f"{self.name}-{i}")

    def clock(self) -> float:
        return self.elapsed + (time.perf_counter() - self.step_started if self.step_started is not None else 0.0)

    def collect(self, out) -> None:
        if not out.token_ids:
            return
        now = self.clock()
        self.outputs.setdefault(out.request_id, []).extend(out.token_ids)
        if out.request_id == self.long_id:
            self.long_first = self.long_first if self.long_first is not None else now
        elif out.request_id in self.last:
            self.gaps.append((now, now - self.last[out.request_id]))
        self.last[out.request_id] = now

    @property
    def busy(self) -> bool:
        return self.arrived is None or not self.orchestrator.idle

    def step(self) -> None:
        if self.steps == self.arrive_step:
            self.arrived = self.clock()
            self.orchestrator.submit(GenerationRequest(prompt_ids=tuple(int(t) for t in self.long),
                                                       max_tokens=LONG_TOKENS, ignore_eos=True, cache_salt=self.name),
                                     self.collect, request_id=self.long_id)
        self.step_started = time.perf_counter()
        self.orchestrator.step()
        self.elapsed += time.perf_counter() - self.step_started
        self.step_started = None
        self.steps += 1

    def row(self) -> dict:
        gaps = np.array([g for _, g in self.gaps])
        # the gaps that overlap the long prompt's prefill, from its arrival to its first token
        during = [g for when, g in self.gaps if when > self.arrived and when - g < self.long_first]
        tokens = sum(len(v) for v in self.outputs.values())
        return {"chunk": self.name, "long_prompt_tokens": len(self.long), "stream_gap_p50_ms": 1e3 * np.median(gaps),
                "stream_gap_p99_ms": 1e3 * np.percentile(gaps, 99), "stream_gap_max_ms": 1e3 * gaps.max(),
                "stream_gap_max_during_prefill_ms": 1e3 * max(during, default=0.0),
                "long_ttft_s": self.long_first - self.arrived, "seconds": self.elapsed,
                "tokens_per_s": tokens / self.elapsed, "steps": self.steps}


def measure(chunks: list[int], longs: int, arrive_step: int) -> dict:
    from benchmarks.throughput import build_stack

    torch.set_num_threads(2)
    engine, drafter, step_model, fit_error = build_stack(torch.bfloat16, num_blocks=4096)
    streams = [np.asarray(t.prompt_ids) for t in spread(load_trajectories(trajectory_path("mtbench", "eval")), STREAMS)]
    grounded = load_trajectories(trajectory_path("grounded", "eval"))
    long_prompts = [np.asarray(t.prompt_ids) for t in sorted(grounded, key=lambda t: -len(t.prompt_ids))[:longs]]
    rows = []
    for g, long in enumerate(long_prompts):
        engine.reset_prefix_cache()
        settings = [_Setting(engine, drafter.fresh(), step_model, chunk, streams, long, arrive_step=arrive_step)
                    for chunk in [None, *chunks]]
        while any(s.busy for s in settings):
            for s in settings:
                if s.busy:
                    s.step()
        streamed = [{rid.split("-", 1)[1]: tokens for rid, tokens in s.outputs.items()} for s in settings]
        for s, outputs in zip(settings[1:], streamed[1:]):
            if outputs != streamed[0]:
                raise AssertionError(f"group {g}: prefill_chunk {s.name} streamed other tokens than whole prefills")
        rows += [{"group": g, **s.row()} for s in settings]
        print(" | ".join(f"{r['chunk']}: max gap {r['stream_gap_max_ms']:.0f} ms, TTFT {r['long_ttft_s']:.2f} s"
                         for r in rows[-len(settings):]), flush=True)
    return {"machine": cpu_description(), "cpu_kernels": engine.cpu_kernels, "threads": torch.get_num_threads(),
            "chunks": chunks, "arrive_step": arrive_step, "streams": STREAMS, "stream_tokens": STREAM_TOKENS,
            "long_tokens": LONG_TOKENS, "step_fit_error": fit_error, "rows": rows, "summary": _summary(rows)}


def _summary(rows: list[dict]) -> dict:
    """Per setting, medians over the groups of its numbers over the whole-prefill setting's."""
    out = {}
    for name in dict.fromkeys(r["chunk"] for r in rows):
        if name == "whole":
            continue
        pairs = [(r, w) for r in rows if r["chunk"] == name
                 for w in rows if w["chunk"] == "whole" and w["group"] == r["group"]]
        out[name] = {key: float(np.median([r[key] / w[key] for r, w in pairs]))
                     for key in ("stream_gap_max_ms", "stream_gap_p99_ms", "long_ttft_s", "tokens_per_s")}
    return out


def write_markdown(path: Path, result: dict) -> None:
    chunks = " ".join(str(c) for c in result["chunks"])
    lines = [
        "# chunked_prefill: a long prompt arriving while requests decode",
        "",
        f"Command: `python -m benchmarks.chunked_prefill --chunks {chunks} --long "
        f"{len({r['group'] for r in result['rows']})} --arrive-step {result['arrive_step']}` on {result['machine']} "
        f"({result['cpu_kernels']} kernels, {result['threads']} threads); bf16, goodput policy. {result['streams']} "
        f"MT-Bench requests decode {result['stream_tokens']} tokens each; after {result['arrive_step']} steps one of "
        f"the longest grounded prompts arrives and generates {result['long_tokens']} tokens. Every setting runs side by side on "
        "its own clock (interleaved step by step) and streamed the same tokens (the run checks it). A stream gap is "
        "the time between two updates of one of the decoding requests.",
        "",
        "| long prompt | prefill | stream gap p50 ms | p99 ms | max ms | max over its prefill ms | its TTFT s | "
        "tok/s (all) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [f"| {r['long_prompt_tokens']} tokens | {'whole' if r['chunk'] == 'whole' else r['chunk'] + '-token chunks'} "
              f"| {r['stream_gap_p50_ms']:.0f} | {r['stream_gap_p99_ms']:.0f} | {r['stream_gap_max_ms']:.0f} | "
              f"{r['stream_gap_max_during_prefill_ms']:.0f} | {r['long_ttft_s']:.2f} | {r['tokens_per_s']:.1f} |"
              for r in result["rows"]]
    lines += ["", "Medians over the long prompts of each chunked setting's numbers over whole prefills':", "",
              "| chunk | stream gap max | stream gap p99 | long prompt's TTFT | tok/s |", "|---|---|---|---|---|"]
    lines += [f"| {name} | {s['stream_gap_max_ms']:.2f}x | {s['stream_gap_p99_ms']:.2f}x | {s['long_ttft_s']:.2f}x | "
              f"{s['tokens_per_s']:.2f}x |" for name, s in result["summary"].items()]
    lines.append("")
    path.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", nargs="+", type=int, default=[256, 64], help="prefill_chunk settings to compare "
                        "with whole prefills")
    parser.add_argument("--long", type=int, default=3, help="groups: one per long prompt (the longest grounded ones)")
    parser.add_argument("--arrive-step", type=int, default=8, help="the streams' steps before the long prompt arrives")
    args = parser.parse_args(argv)
    try:
        for chunk in args.chunks:
            check_prefill_chunk(chunk)
    except ValueError as exc:
        parser.error(f"--chunks: {exc}")
    if not 1 <= args.long <= 20 or args.arrive_step < 1:
        parser.error("--long must lie in [1, 20] and --arrive-step be >= 1")
    result = measure(args.chunks, args.long, args.arrive_step)
    print(save_results("chunked_prefill", result, write_markdown).read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
