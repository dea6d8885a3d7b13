"""The CPU verify forward's decoder layers as one compiled call (`cpu_forward._decoder_layers`) against the Python
loop over the same kernels (`FusedCpuDecoder(one_call=False)`), side by side in one process.

    python -m benchmarks.one_call [--rounds 80]     # ~1 minute on 2 CPU cores

`TorchEngine` on the default model (bf16, "numba" kernels), one request over a 512-token context. Its decoder is
called on the arguments the engine passed it for a plain decode step, verify steps of 4, 8 and 16 draft nodes (a
chain) and the prefill of the 512-token prompt, each way in turn (order alternating by round). Each call writes its
tokens' keys and values to the same slots, so every call sees the same cache. Reported per shape: the median time of
each way, the median of the per-round differences and ratios, and whether the two ways' hidden states were the same
bits. The forward only: the engine's own work around it (packing the step, the LM head, sampling) is the same either
way.

Writes benchmarks/results/one_call.json and .md.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.results_files import rounds_benchmark_main

NODES = (0, 4, 8, 16)
CONTEXT = 512
PREFILL_ROUND_EVERY = 5  # the prefill (~0.4 s a call) is timed every fifth round


def measure(rounds: int) -> dict:
    from drafter.tree import DraftTree
    from trt_engines.base import VerifyItem
    from trt_engines.cpu_forward import FusedCpuDecoder
    from trt_engines.cpu_kernels import cpu_description
    from trt_engines.torch_engine import TorchEngine

    engine = TorchEngine("default", dtype=torch.bfloat16, num_blocks=128, cpu_kernels="numba")
    one_call = engine._fused
    if not one_call.one_call:
        raise SystemExit("this engine's decoder does not run its layers as one call (PyTorch's linear layers?)")
    loop = FusedCpuDecoder(engine.model, one_call=False)
    calls: list[tuple] = []  # the decoder's arguments, call by call
    engine._fused = lambda *args: (calls.append(args), one_call(*args))[1]
    rng = np.random.default_rng(0)
    engine.add_request("r", [int(t) for t in rng.integers(100, engine.vocab_size, CONTEXT)])
    drafted = [int(t) for t in rng.integers(100, engine.vocab_size, max(NODES))]
    for nodes in NODES:
        engine.verify([VerifyItem("r", DraftTree.chain(drafted[:nodes]) if nodes else DraftTree.empty())])
    names = [f"prefill, {CONTEXT} tokens"] + [f"verify, {n} draft nodes" if n else "plain decode" for n in NODES]
    shapes = dict(zip(names, calls, strict=True))
    ways = {"loop": loop, "one call": one_call}
    same_bits = {}
    for shape, args in shapes.items():
        same_bits[shape] = torch.equal(loop(*args).view(torch.int16), one_call(*args).view(torch.int16))
    seconds = {(shape, way): [] for shape in shapes for way in ways}
    for r in range(rounds):
        order = list(ways) if r % 2 == 0 else list(ways)[::-1]
        for shape, args in shapes.items():
            if shape.startswith("prefill") and r % PREFILL_ROUND_EVERY:
                continue
            for way in order:
                started = time.perf_counter()
                ways[way](*args)
                seconds[(shape, way)].append(time.perf_counter() - started)
    rows = []
    for shape in shapes:
        loop_s, one_s = np.array(seconds[(shape, "loop")]), np.array(seconds[(shape, "one call")])
        rows.append({"shape": shape, "rows": int(len(shapes[shape][0])), "calls": int(loop_s.size),
                     "loop_ms": 1e3 * float(np.median(loop_s)), "one_call_ms": 1e3 * float(np.median(one_s)),
                     "saved_ms": 1e3 * float(np.median(loop_s - one_s)),
                     "ratio": float(np.median(one_s / loop_s)), "same_bits": same_bits[shape]})
    return {"machine": cpu_description(), "threads": torch.get_num_threads(), "rounds": rounds, "context": CONTEXT,
            "rows": rows, "same_bits": all(same_bits.values()),
            "saved_ms_plain_step": next(r["saved_ms"] for r in rows if r["shape"] == "plain decode")}


def write_markdown(path: Path, result: dict) -> None:
    lines = [
        "# one_call: the CPU verify forward's layers as one compiled call",
        "",
        f"Command: `python -m benchmarks.one_call --rounds {result['rounds']}` on {result['machine']}. Default model, "
        f"bf16, \"numba\" kernels, one request over a {result['context']}-token context; the decoder's Python loop over "
        "its kernels (`FusedCpuDecoder(one_call=False)`) and the one compiled call (`cpu_forward._decoder_layers`) "
        "on the same arguments, in turn, in one process (`benchmarks/one_call.py` docstring). The forward only.",
        "",
        f"Same bits both ways, every shape: **{'yes' if result['same_bits'] else 'NO'}**.",
        "",
        "| shape | rows | calls | loop ms | one call ms | saved ms (median of pairs) | one call / loop |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [f"| {r['shape']} | {r['rows']} | {r['calls']} | {r['loop_ms']:.2f} | {r['one_call_ms']:.2f} | "
              f"{r['saved_ms']:.3f} | {r['ratio']:.3f} |" for r in result["rows"]]
    lines += ["", "What the loop adds is Python between the kernels (`Bf16Linear.bits`, the attention's wrapper, each "
              "call's dispatch), a fixed cost per layer whatever the step's shape; each kernel call still starts "
              "numba's threads either way. Where the kernels' arithmetic dominates (a prefill) that cost is lost in "
              "it, and on this 2-core machine the two ways then differ by a few percent either way from run to run.",
              ""]
    path.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    return rounds_benchmark_main("one_call", __doc__, measure, write_markdown, argv, default_rounds=80)


if __name__ == "__main__":
    raise SystemExit(main())
