"""The CPU linear kernel with and without AVX512-BF16's VDPBF16PS (`cpu_kernels.BF16_DOT_PRODUCTS`), side by side.

    python -m benchmarks.bf16_dot [--rounds 6]     # ~5 minutes on 2 CPU cores; needs a CPU with AVX512-BF16

The choice is made once per process (`RETROSPEC_CPU_BF16_DOT`), so each round runs one fresh process per setting,
the two in turn (order alternating), and each process measures:
- every linear layer of the default model (its shapes, random bf16 weights; `linear_rows.model_linears`) at 1 to 64
  input rows: a verify step of that many tokens, or a prefill chunk;
- whole `TorchEngine` steps on the default model (bf16, "numba" kernels): one request over a 512-token context, a
  plain decode step and verify steps of 4, 8 and 16 draft nodes (a chain), and the prefill of that 512-token prompt;
- a digest of the bits: the fp32 logits of the prefill, of a 16-node verify step and the linear layers' outputs.
Reported: the median over rounds of each process's median, the ratio with / without, and whether every digest of
every process was the same (the kernel's claim: the same chain of fused multiply-adds, so the same bits).

Writes benchmarks/results/bf16_dot.json and .md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

from benchmarks.results_files import save_results

ROWS = (1, 2, 4, 8, 16, 64)
NODES = (0, 4, 8, 16)
CONTEXT = 512
REPEATS = 7  # calls per measurement inside a process (its median)


def _median_ms(fn, repeats: int = REPEATS) -> float:
    fn()  # warm: compiles, or loads from numba's cache, and touches the weights
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return 1e3 * statistics.median(times)


def measure_here() -> dict:
    """This process's measurements (its setting of RETROSPEC_CPU_BF16_DOT), as the module docstring lists them."""
    import torch

    from benchmarks.linear_rows import model_linears
    from drafter.tree import DraftTree
    from orchestrator.roofline import ModelShape
    from trt_engines.base import VerifyItem
    from trt_engines.cpu_kernels import BF16_DOT_PRODUCTS, bf16_bits
    from trt_engines.prepare import resolve_model_dir
    from trt_engines.torch_engine import TorchEngine

    digest = hashlib.sha256()
    linears = model_linears(ModelShape.from_config(resolve_model_dir("default")))
    generator = torch.Generator().manual_seed(1)
    linear_ms = {}
    for rows in ROWS:
        inputs = {k: bf16_bits((torch.randn(rows, k, generator=generator)).to(torch.bfloat16))
                  for k in {layer.in_features for layer in linears}}
        linear_ms[rows] = _median_ms(lambda: [layer.bits(inputs[layer.in_features]) for layer in linears])
        for layer in linears[:4] + linears[-1:]:
            digest.update(layer.bits(inputs[layer.in_features], fp32_out=True).tobytes())

    engine = TorchEngine("default", dtype=torch.bfloat16, num_blocks=512, cpu_kernels="numba")
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(100, engine.vocab_size, CONTEXT)]
    tokens = [int(t) for t in rng.integers(100, engine.vocab_size, max(NODES))]

    def prefill() -> None:
        engine.add_request("prefill", prompt)
        engine.release("prefill")

    engine.reset_prefix_cache()
    prefill_ms = _median_ms(lambda: (prefill(), engine.reset_prefix_cache()))
    engine.add_request("r", prompt)
    digest.update(engine.debug_logits([prompt])[0].float().numpy().tobytes())
    step_ms = {}
    for nodes in NODES:
        tree = DraftTree.chain(tokens[:nodes]) if nodes else DraftTree.empty()
        step_ms[nodes] = _median_ms(lambda: engine.verify([VerifyItem("r", tree)]))
    out = engine.verify([VerifyItem("r", DraftTree.chain(tokens))], return_logits=True)
    digest.update(out.results[0].logits.float().numpy().tobytes())
    return {"bf16_dot": BF16_DOT_PRODUCTS, "linear_ms": linear_ms, "step_ms": step_ms, "prefill_ms": prefill_ms,
            "digest": digest.hexdigest()}


def run(rounds: int) -> dict:
    from trt_engines.cpu_kernels import BF16_DOT_PRODUCTS, cpu_description

    if not BF16_DOT_PRODUCTS:
        raise SystemExit("bf16_dot compares the linear kernel with and without VDPBF16PS: this CPU has no "
                         "AVX512-BF16 (or RETROSPEC_CPU_BF16_DOT=0 is set), so there is nothing to compare")
    runs: dict[str, list[dict]] = {"0": [], "1": []}
    for r in range(rounds):
        for setting in ("0", "1") if r % 2 == 0 else ("1", "0"):
            env = {**os.environ, "RETROSPEC_CPU_BF16_DOT": setting}
            done = subprocess.run([sys.executable, "-m", "benchmarks.bf16_dot", "--here"], env=env,
                                  capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(f"the RETROSPEC_CPU_BF16_DOT={setting} process failed:\n{done.stderr[-3000:]}")
            runs[setting].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1}/{rounds} RETROSPEC_CPU_BF16_DOT={setting}: plain step "
                  f"{runs[setting][-1]['step_ms']['0']:.2f} ms", flush=True)

    def medians(setting: str, key: str) -> dict[str, float]:
        return {k: statistics.median(run[key][k] for run in runs[setting]) for k in runs[setting][0][key]}

    result = {"cpu": cpu_description(), "rounds": rounds, "context": CONTEXT,
              "identical_bits": len({run["digest"] for setting in runs for run in runs[setting]}) == 1}
    for setting, name in (("0", "fma"), ("1", "bf16_dot")):
        result[name] = {"linear_ms": medians(setting, "linear_ms"), "step_ms": medians(setting, "step_ms"),
                        "prefill_ms": statistics.median(run["prefill_ms"] for run in runs[setting])}
    fma, dot = result["fma"], result["bf16_dot"]
    result["summary"] = {
        **{f"linear_ratio_rows{k}": dot["linear_ms"][k] / fma["linear_ms"][k] for k in fma["linear_ms"]},
        **{f"step_ratio_nodes{k}": dot["step_ms"][k] / fma["step_ms"][k] for k in fma["step_ms"]},
        "prefill_ratio": dot["prefill_ms"] / fma["prefill_ms"],
        "identical_bits": result["identical_bits"],
    }
    return result


def write_markdown(path, result: dict) -> None:
    fma, dot = result["fma"], result["bf16_dot"]
    lines = ["# bf16_dot: the CPU linear kernel with and without VDPBF16PS", "",
             f"Command: `{result['command']}` on {result['cpu']}. {result['rounds']} rounds, each a fresh process per "
             "setting (`RETROSPEC_CPU_BF16_DOT` 0, then 1, order alternating); each process's median of "
             f"{REPEATS} calls, then the median over rounds. Default model, bf16, random weights for the linear "
             f"layers; whole steps on the real model, one request over a {result['context']}-token context "
             "(`benchmarks/bf16_dot.py` docstring).", "",
             f"Same bits with and without: **{'yes' if result['identical_bits'] else 'NO'}** (one digest of every "
             "process's linear outputs, prefill logits and 16-node verify logits).", "",
             "## Every linear layer of the model (30 layers and the LM head)", "",
             "| input rows | FMA ms | VDPBF16PS ms | ratio |", "|---|---|---|---|"]
    lines += [f"| {k} | {fma['linear_ms'][k]:.2f} | {dot['linear_ms'][k]:.2f} | "
              f"{dot['linear_ms'][k] / fma['linear_ms'][k]:.2f} |" for k in fma["linear_ms"]]
    lines += ["", "## Whole engine steps", "", "| step | FMA ms | VDPBF16PS ms | ratio | / plain step (FMA) | "
              "/ plain step (VDPBF16PS) |", "|---|---|---|---|---|---|"]
    for k in fma["step_ms"]:
        name = "plain decode" if k == "0" else f"verify, {k} draft nodes"
        lines.append(f"| {name} | {fma['step_ms'][k]:.2f} | {dot['step_ms'][k]:.2f} | "
                     f"{dot['step_ms'][k] / fma['step_ms'][k]:.2f} | {fma['step_ms'][k] / fma['step_ms']['0']:.2f} | "
                     f"{dot['step_ms'][k] / dot['step_ms']['0']:.2f} |")
    lines.append(f"| prefill, {result['context']} tokens | {fma['prefill_ms']:.1f} | {dot['prefill_ms']:.1f} | "
                 f"{dot['prefill_ms'] / fma['prefill_ms']:.2f} | | |")
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--here", action="store_true", help=argparse.SUPPRESS)  # one process's measurements
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1; got {args.rounds}")
    if args.here:
        print(json.dumps(measure_here()))
        return 0
    result = run(args.rounds)
    result["command"] = "python -m benchmarks.bf16_dot" + ("" if args.rounds == 6 else f" --rounds {args.rounds}")
    path = save_results("bf16_dot", result, write_markdown)
    print(path.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
