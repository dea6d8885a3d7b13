"""TorchEngine's choices for CUDA that do not need the default model (random weights): which SDPA kernels its
forwards may run. The GPU test runs where CUDA is (`-m gpu`); the rest runs anywhere."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from drafter.tree import DraftTree
from trt_engines.base import VerifyItem


def test_cuda_forwards_choose_among_every_sdpa_backend_but_cudnn_and_leave_the_choice_as_it_was():
    # The switches are process-wide settings, so the context can be checked without a GPU; the GPU test below
    # checks which kernel a real verify step runs.
    from trt_engines.torch_engine import SHAPE_STABLE_SDPA_BACKENDS, sdpa_backends_for

    cuda = torch.backends.cuda
    switches = {"cudnn": cuda.cudnn_sdp_enabled, "flash": cuda.flash_sdp_enabled,
                "efficient": cuda.mem_efficient_sdp_enabled, "math": cuda.math_sdp_enabled}
    before = {name: on() for name, on in switches.items()}
    assert before["cudnn"], "PyTorch enables cuDNN attention by default; this test assumes the default"
    with sdpa_backends_for(torch.device("cuda")):
        assert {name: on() for name, on in switches.items()} == {
            "cudnn": False, "flash": True, "efficient": True, "math": True}
    assert {name: on() for name, on in switches.items()} == before
    with sdpa_backends_for(torch.device("cpu")):
        assert {name: on() for name, on in switches.items()} == before
    assert torch.nn.attention.SDPBackend.CUDNN_ATTENTION not in SHAPE_STABLE_SDPA_BACKENDS


@pytest.mark.gpu
def test_gpu_verify_steps_never_run_cudnn_attention():
    # cuDNN attention builds an execution graph for every new shape (tens of ms of host time); a serving step's
    # keys and tree rows change every step, so the engine keeps SDPA off it (`SHAPE_STABLE_SDPA_BACKENDS`).
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from torch.profiler import ProfilerActivity, profile

    from trt_engines.llama import Transformer
    from trt_engines.torch_engine import TorchEngine

    shape = {"hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 512}  # head_dim 128
    engine = TorchEngine(Transformer.random(shape, dtype=torch.bfloat16, device="cuda"), dtype=torch.bfloat16,
                         device="cuda", num_blocks=64)
    rng = np.random.default_rng(0)
    for rid, n in (("a", 37), ("b", 90)):
        engine.add_request(rid, rng.integers(0, 256, n).tolist())
    tree = DraftTree.from_arrays(tokens=[3, 4, 5, 6], parents=[-1, 0, 0, 1])
    cudnn_before = torch.backends.cuda.cudnn_sdp_enabled()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = engine.verify([VerifyItem("a", tree), VerifyItem("b", DraftTree.empty())])
    ops = {event.key for event in prof.key_averages()}
    assert [len(r.target_tokens) for r in out.results] == [5, 1]
    assert not any("cudnn_attention" in op for op in ops), sorted(op for op in ops if "attention" in op)
    assert any(op.startswith("aten::_scaled_dot_product_") for op in ops), sorted(ops)
    assert torch.backends.cuda.cudnn_sdp_enabled() == cudnn_before
