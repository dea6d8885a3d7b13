"""The hardware profile the step-time model starts from: measured on this machine, in the dtypes asked for."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from orchestrator.profiling import measure_hardware
from orchestrator.roofline import StepTimeModel
from tests.test_budget import SMOLLM2


def test_measure_hardware_times_only_the_dtypes_asked_for():
    spec = measure_hardware("cpu", size=256, stream_mb=8, repeats=1, dtypes=("float32",))
    assert set(spec.peak_flops) == {"float32"}
    assert spec.peak_flops["float32"] > 0 and spec.mem_bandwidth > 0 and spec.overhead_s > 0
    fp32 = StepTimeModel(SMOLLM2, spec, dtype="float32")
    assert fp32.predict(np.ones(2), np.full(2, 64.0)) > 0
    with pytest.raises(ValueError, match="no peak FLOP/s for dtype 'bfloat16'"):
        StepTimeModel(SMOLLM2, spec, dtype="bfloat16").predict(np.ones(1), np.full(1, 64.0))


def test_measure_hardware_default_profile_has_both_dtypes_and_refuses_unknown_ones():
    spec = measure_hardware("cpu", size=128, stream_mb=8, repeats=1, cpu_kernels=True)
    assert set(spec.peak_flops) == {"float32", "bfloat16"}
    for bad in ((), ("fp4",), ("float32", "int8")):
        with pytest.raises(ValueError, match=r"dtypes=.*one or more of \['float32', 'bfloat16', 'float16'\]"):
            measure_hardware("cpu", size=128, stream_mb=8, repeats=1, dtypes=bad)


def test_serving_stack_builds_on_its_runner_thread_and_measures_only_its_own_dtype():
    """Everything of the stack's start-up that runs parallel kernels runs on the runner thread, which steps the
    engine after: built on the main thread and stepped on another, a decode step took ~3x as long
    (`benchmarks/results/thread_pools.md`). And `retrospec serve --dtype float32` profiles fp32 alone: on a CPU
    without bf16 instructions, timing PyTorch's bf16 matmul as well took minutes before the server could start."""
    import sys
    import threading

    from orchestrator.profiling import fit_step_model
    from orchestrator.serving.stack import ServingConfig, ServingStack, make_drafter
    from trt_engines.prepare import resolve_model_dir
    from trt_engines.torch_engine import TorchEngine

    watched = {f.__code__: f.__qualname__ for f in (resolve_model_dir, TorchEngine.__init__, make_drafter,
                                                     measure_hardware, fit_step_model)}
    ran_on: dict[str, set[str]] = {}

    def record(frame, event, arg):
        if event == "call" and frame.f_code in watched:
            ran_on.setdefault(watched[frame.f_code], set()).add(threading.current_thread().name)

    # Python 3.11 has no setprofile for running threads: hook this one and every thread started from now on.
    threading.setprofile(record)
    sys.setprofile(record)
    try:
        stack = ServingStack.build(ServingConfig(dtype="float32", num_blocks=32, max_context=256, datastores=(),
                                                 hardware="measure", fit_step_model=True, max_running=2,
                                                 row_table_rows=6))
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    def unhook() -> str:
        sys.setprofile(None)  # the runner thread's own hook, set when it started
        return threading.current_thread().name

    try:
        runner_thread = stack.runner.call(unhook)
        assert runner_thread != threading.current_thread().name
        assert ran_on == {name: {runner_thread} for name in watched.values()}
        hardware = stack.orchestrator.budget.step_model.hardware
        assert hardware.name.startswith("measured:") and set(hardware.peak_flops) == {"float32"}
        assert stack.orchestrator.budget.step_model.row_seconds.shape == (6,)  # the table it was asked for
    finally:
        stack.shutdown()


def test_profile_hardware_refuses_bad_options_before_measuring(tmp_path, capsys):
    import torch

    from tools.profile_hardware import main

    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(SystemExit) as exit_info:
        main(["--out", str(blocker / "hw.json")])  # its folder would have to be inside a file
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and f"--out {blocker / 'hw.json'}: cannot create its folder" in err
    with pytest.raises(SystemExit):
        main(["--device", "gpu", "--out", str(tmp_path / "hw.json")])
    assert "invalid choice: 'gpu'" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            main(["--device", "cuda", "--out", str(tmp_path / "hw.json")])
        assert "PyTorch sees no CUDA device here" in capsys.readouterr().err
    assert not (tmp_path / "hw.json").exists()


def test_row_table_is_measured_on_the_engine_and_the_fit_reads_it():
    """The start-up fit measures the engine's row table first (one request, 1..rows rows), frees what it held, and
    the fitted model prices rows by it; an engine too short for the table keeps the roofline's row terms."""
    from orchestrator.profiling import fit_step_model, measure_row_seconds
    from orchestrator.roofline import HardwareSpec
    from trt_engines.torch_engine import TorchEngine

    engine = TorchEngine("default", dtype=torch.float32, num_blocks=64, max_context=256)
    free = engine.free_blocks()
    table = measure_row_seconds(engine, rows=6, rounds=1)
    assert table.shape == (6,) and table[0] == 0.0 and (table >= 0).all() and np.isfinite(table).all()
    assert engine.free_blocks() == free and not engine.requests
    for bad in ({"rows": 1}, {"rounds": 0}):
        with pytest.raises(ValueError, match="row table needs rows >= 2 and rounds >= 1"):
            measure_row_seconds(engine, **bad)
    model = StepTimeModel.for_engine(engine, SMOLLM2, HardwareSpec("cpu", {"float32": 1e11}, 2e10),
                                     dtype="float32")
    before = model.coefficients.copy()
    for bad in (1, -2):  # refused before anything is measured; the model keeps its pricing
        with pytest.raises(ValueError, match=f"table_rows must be 0 \\(no row table\\) or an int >= 2; got {bad}"):
            fit_step_model(engine, model, table_rows=bad)
    assert model.row_seconds is None and np.array_equal(model.coefficients, before)
    error = fit_step_model(engine, model, batches=(1, 2), nodes=(0, 7), contexts=(32,), repeats=1, table_rows=8)
    assert model.row_seconds.shape == (8,) and np.isfinite(error)
    assert engine.free_blocks() == free and not engine.requests
    short = TorchEngine("default", dtype=torch.float32, num_blocks=16, max_context=40)
    assert measure_row_seconds(short, rows=8) is None  # 32 cached tokens + 8 rows do not fit in 40
    # a fit that asked for a table it cannot measure says so, and prices rows by the roofline
    on_short = StepTimeModel.for_engine(short, SMOLLM2, HardwareSpec("cpu", {"float32": 1e11}, 2e10), dtype="float32")
    with pytest.warns(RuntimeWarning, match="no row table: the engine cannot hold 32 cached tokens \\+ 8 rows"):
        fit_step_model(short, on_short, batches=(1,), nodes=(0, 3), contexts=(16,), repeats=1, table_rows=8)
    assert on_short.row_seconds is None and not short.requests
