"""Measure this device's matmul FLOP/s and streaming bandwidth into a hardware profile for the roofline model.

    python -m tools.profile_hardware --out benchmarks/results/hardware_cpu.json

FLOP/s: the best of several square matmuls per dtype (large enough to be compute-bound). Bandwidth: `a + b -> c`
over arrays far larger than the caches, counted as 3 transfers (SSSD's method). Overhead: a tiny matmul's wall time.
Works on CPU and on CUDA (`--device cuda`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from orchestrator.profiling import measure_hardware


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--out", required=True, help="the profile JSON to write (its folder is created)")
    args = parser.parse_args(argv)
    # refused before measuring, not after it
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: PyTorch sees no CUDA device here (a CPU-only build, or no GPU); profile the "
                     "CPU with --device cpu")
    try:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        parser.error(f"--out {args.out}: cannot create its folder ({exc.strerror})")
    spec = measure_hardware(args.device)
    spec.to_json(args.out)
    print(f"{spec.name}: " + ", ".join(f"{k} {v / 1e9:.1f} GFLOP/s" for k, v in spec.peak_flops.items())
          + f", bandwidth {spec.mem_bandwidth / 1e9:.1f} GB/s -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
