"""Where benchmark results live, and the one way a benchmark writes its JSON and markdown there."""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Callable
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def save_results(name: str, result: dict, write_markdown: Callable[[Path, dict], None]) -> Path:
    """Write `results/<name>.json` and, through `write_markdown(path, result)`, `results/<name>.md`; returns the .md."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    markdown = RESULTS / f"{name}.md"
    write_markdown(markdown, result)
    return markdown


def cpu_description() -> str:
    """The CPU a CPU benchmark ran on, as its results quote it: architecture, cores, PyTorch's vector ISA, and
    whether it has bf16 dot-product instructions (without them PyTorch's bf16 matmuls take a slow path and
    `TorchEngine` runs its numba kernels: `trt_engines.cpu_kernels`)."""
    import torch

    from trt_engines.cpu_kernels import cpu_has_native_bf16

    bf16 = "bf16 dot products" if cpu_has_native_bf16() else "no bf16 dot-product instructions"
    return f"{platform.machine()} {os.cpu_count()} cores ({torch.backends.cpu.get_cpu_capability()}, {bf16})"
