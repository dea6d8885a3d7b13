"""Measure this device's matmul FLOP/s and streaming bandwidth into a hardware profile for the roofline model.

    python -m tools.profile_hardware --out benchmarks/results/hardware_cpu.json

FLOP/s: the best of several square matmuls per dtype (large enough to be compute-bound). Bandwidth: `a + b -> c`
over arrays far larger than the caches, counted as 3 transfers (SSSD's method). Overhead: a tiny matmul's wall time.
Works on CPU and on CUDA (`--device cuda`).
"""

from __future__ import annotations

import argparse
import time

import torch

from orchestrator.roofline import HardwareSpec


def _timed(fn, sync, repeats: int) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - started)
    return best


def profile(device: str = "cpu", *, size: int = 2048, stream_mb: int = 512, repeats: int = 5) -> HardwareSpec:
    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    flops = {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        a = torch.randn(size, size, device=dev, dtype=dtype)
        b = torch.randn(size, size, device=dev, dtype=dtype)
        seconds = _timed(lambda: a @ b, sync, repeats)
        flops[name] = 2 * size**3 / seconds
    n = stream_mb * (1 << 20) // 4
    x, y = torch.ones(n, device=dev), torch.ones(n, device=dev)
    out = torch.empty(n, device=dev)
    seconds = _timed(lambda: torch.add(x, y, out=out), sync, repeats)
    bandwidth = 3 * n * 4 / seconds
    small = torch.randn(8, 8, device=dev)
    overhead = _timed(lambda: small @ small, sync, 50)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu-{torch.get_num_threads()}threads"
    return HardwareSpec(name=f"measured:{name}", peak_flops=flops, mem_bandwidth=bandwidth, overhead_s=overhead)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    spec = profile(args.device)
    spec.to_json(args.out)
    print(f"{spec.name}: " + ", ".join(f"{k} {v / 1e9:.1f} GFLOP/s" for k, v in spec.peak_flops.items())
          + f", bandwidth {spec.mem_bandwidth / 1e9:.1f} GB/s -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
