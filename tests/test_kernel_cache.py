"""numba's on-disk cache of our kernels follows their imports (`kernel_cache`)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import kernel_cache

ROOT = Path(__file__).resolve().parents[1]

_RUN = textwrap.dedent("""
    import json, sys
    sys.path[:0] = [sys.argv[1], sys.argv[2]]
    import kernel_cache
    kernel_cache.track(sys.argv[2], ("pkg",))
    from pkg.kernels import plus_offset
    value = int(plus_offset(1))
    print(json.dumps({"value": value, "hits": sum(plus_offset.stats.cache_hits.values()),
                      "misses": sum(plus_offset.stats.cache_misses.values())}))
""")


def _package(tmp_path: Path, offset: int) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir(exist_ok=True)
    (pkg / "__init__.py").write_text("")
    # the helper is compiled into the kernel's cache entry: a file the kernel's own file stamp never sees
    (pkg / "helpers.py").write_text(f"from numba import njit\n\n\n@njit\ndef offset():\n    return {offset}\n")
    (pkg / "kernels.py").write_text(textwrap.dedent("""
        from numba import njit

        from .helpers import offset


        @njit(cache=True)
        def plus_offset(x):
            return x + offset()
    """))


def _run(tmp_path: Path) -> dict:
    script = tmp_path / "run.py"
    script.write_text(_RUN)
    done = subprocess.run([sys.executable, str(script), str(ROOT), str(tmp_path)], capture_output=True, text=True,
                          timeout=120, env={"PATH": "/usr/bin:/bin", "NUMBA_CACHE_DIR": str(tmp_path / "cache")})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_kernel_recompiles_when_a_file_it_imports_changes(tmp_path):
    _package(tmp_path, offset=1)
    assert _run(tmp_path) == {"value": 2, "hits": 0, "misses": 1}  # compiled, and saved
    assert _run(tmp_path) == {"value": 2, "hits": 1, "misses": 0}  # loaded from the cache
    _package(tmp_path, offset=10)  # only the imported file changes
    assert _run(tmp_path) == {"value": 11, "hits": 0, "misses": 1}  # numba alone would load the stale entry: 2
    assert _run(tmp_path) == {"value": 11, "hits": 1, "misses": 0}


def test_the_stamp_covers_imports_transitively_and_only_ours():
    stamp = dict(kernel_cache.source_stamp(ROOT / "trt_engines" / "cpu_forward.py"))
    # cpu_forward imports cpu_kernels (the linear and attention kernels it links) and llama (the model); numpy,
    # numba and torch are not ours
    assert {"trt_engines/cpu_forward.py", "trt_engines/cpu_kernels.py", "trt_engines/llama.py"} <= set(stamp)
    assert all(name.split("/")[0] in kernel_cache.PACKAGES for name in stamp)
    budget = dict(kernel_cache.source_stamp(ROOT / "orchestrator" / "budget.py"))
    assert {"orchestrator/recalibration.py", "drafter/calibration.py", "orchestrator/roofline.py"} <= set(budget)


def test_our_kernels_use_the_import_stamp():
    from trt_engines import cpu_forward, cpu_kernels

    if not cpu_kernels._CACHE:
        pytest.skip("numba's on-disk cache is off in this process (RETROSPEC_CPU_VECTOR_FLOATS)")
    for kernel in (cpu_forward.rms_norm, cpu_kernels._linear_kernel):
        assert isinstance(kernel._cache._impl.locator, kernel_cache.ImportsStampLocator)
