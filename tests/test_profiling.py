"""The hardware profile the step-time model starts from: measured on this machine, in the dtypes asked for."""

from __future__ import annotations

import numpy as np
import pytest

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


def test_serving_stack_measures_only_its_own_dtype():
    """`retrospec serve --dtype float32` profiles fp32 alone: on a CPU without bf16 instructions, timing PyTorch's
    bf16 matmul as well took minutes before the server could start."""
    from orchestrator.serving.stack import ServingConfig, ServingStack

    stack = ServingStack.build(ServingConfig(dtype="float32", num_blocks=32, max_context=256, datastores=(),
                                             hardware="measure", fit_step_model=False, max_running=2))
    try:
        hardware = stack.orchestrator.budget.step_model.hardware
        assert hardware.name.startswith("measured:") and set(hardware.peak_flops) == {"float32"}
    finally:
        stack.shutdown()
