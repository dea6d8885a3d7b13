"""The verify forward over bf16 bits (`trt_engines.cpu_forward`): each operator rounds where PyTorch's does (bitwise
PyTorch's, or within one bf16 step where its sums or exp are computed otherwise), rows never depend on the batch,
and the engine's fused steps decode what the model's own forward decodes. Batch invariance of whole engine steps is
tested in `test_engine.py`."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trt_engines.cpu_forward import (PARALLEL_ELEMENTS, FusedCpuDecoder, add_rms_norm, residual_add, rms_norm,
                                     rope_and_store, row_parts, silu_and_mul)
from trt_engines.cpu_kernels import bf16_bits
from trt_engines.llama import RMSNorm, Transformer, apply_rope
from trt_engines.prepare import default_model_dir, is_complete

HYP = settings(max_examples=20, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))


def _bf16(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.from_numpy(rng.standard_normal(shape).astype(np.float32) * scale).bfloat16()


def _as_bf16(bits: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(bits).view(torch.bfloat16)


def _bf16_step(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 numbers at |x| (8 significant bits)."""
    return 2.0 ** (torch.floor(torch.log2(x.abs().clamp_min(2.0 ** -126))) - 7)


@HYP
@given(rows=st.integers(1, 40), seed=st.integers(0, 2**32 - 1), scale=st.sampled_from([0.01, 1.0, 30.0]))
def test_operators_round_where_pytorch_does(rows, seed, scale):
    rng = np.random.default_rng(seed)
    heads, kv_heads, dim = 4, 2, 32
    # RoPE and the K/V writes: bitwise `apply_rope`, each token's k and v in its slot
    qkv = _bf16(rng, rows, (heads + 2 * kv_heads) * dim, scale=scale)
    positions = torch.as_tensor(rng.integers(0, 4096, rows))
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2).float() / dim))
    angles = positions.float()[:, None] * inv_freq[None, :]
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    q_ref, k_ref, v_ref = qkv.split((heads * dim, kv_heads * dim, kv_heads * dim), dim=-1)
    q = np.empty((rows, heads, dim), np.uint16)
    k_pool, v_pool = np.zeros((kv_heads, rows + 5, dim), np.uint16), np.zeros((kv_heads, rows + 5, dim), np.uint16)
    slots = rng.permutation(rows + 5)[:rows].astype(np.int64)
    rope_and_store(bf16_bits(qkv), cos.numpy(), sin.numpy(), heads, kv_heads, q, k_pool, v_pool, slots)
    assert torch.equal(_as_bf16(q), apply_rope(q_ref.reshape(rows, heads, dim), cos, sin))
    k_want = apply_rope(k_ref.reshape(rows, kv_heads, dim), cos, sin)
    assert torch.equal(_as_bf16(np.ascontiguousarray(k_pool[:, slots].transpose(1, 0, 2))), k_want)
    assert torch.equal(_as_bf16(np.ascontiguousarray(v_pool[:, slots].transpose(1, 0, 2))),
                       v_ref.reshape(rows, kv_heads, dim))
    # SwiGLU's activation: bf16 `F.silu(gate) * up` within one bf16 step (its exp is not the same code as
    # PyTorch's; on 786k values tried it gave the same bits everywhere)
    gate_up = _bf16(rng, rows, 2 * 48, scale=scale)
    act = np.empty((rows, 48), np.uint16)
    silu_and_mul(bf16_bits(gate_up), act)
    gate, up = gate_up.chunk(2, dim=-1)
    want = (F.silu(gate) * up).float()
    assert ((_as_bf16(act).float() - want).abs() <= _bf16_step(want)).all()
    # the residual add: bitwise bf16 `x + delta`; RMSNorm within one bf16 step of PyTorch's (its sum of squares
    # is summed in another order), and the same whether it follows the add or not
    x, delta = _bf16(rng, rows, 96, scale=scale), _bf16(rng, rows, 96, scale=scale)
    norm = RMSNorm(96, 1e-5).bfloat16().requires_grad_(False)
    norm.weight.copy_(_bf16(rng, 96).abs() + 0.5)
    weight = norm.weight.float().numpy().copy()
    h = bf16_bits(x).copy()
    normed, normed_again = np.empty_like(h), np.empty_like(h)
    add_rms_norm(h, bf16_bits(delta), weight, np.float32(1e-5), normed)
    assert torch.equal(_as_bf16(h), x + delta)
    rms_norm(h, weight, np.float32(1e-5), normed_again)
    assert np.array_equal(normed, normed_again)
    want = norm(x + delta).float()
    assert ((_as_bf16(normed).float() - want).abs() <= _bf16_step(want)).all()
    plain = bf16_bits(x).copy()
    residual_add(plain, bf16_bits(delta))
    assert np.array_equal(plain, h)


@HYP
@given(rows=st.integers(2, 40), row=st.integers(0, 39), seed=st.integers(0, 2**32 - 1))
def test_rows_do_not_depend_on_the_batch(rows, row, seed):
    rng = np.random.default_rng(seed)
    row = row % rows
    x, gate_up = bf16_bits(_bf16(rng, rows, 576, scale=3.0)), bf16_bits(_bf16(rng, rows, 256, scale=3.0))
    weight = np.abs(rng.standard_normal(576)).astype(np.float32) + 0.5
    batch, alone = np.empty_like(x), np.empty_like(x[:1])
    rms_norm(x, weight, np.float32(1e-6), batch)
    rms_norm(x[row:row + 1].copy(), weight, np.float32(1e-6), alone)
    assert np.array_equal(batch[row], alone[0])
    act, act_alone = np.empty((rows, 128), np.uint16), np.empty((1, 128), np.uint16)
    silu_and_mul(gate_up, act)
    silu_and_mul(gate_up[row:row + 1].copy(), act_alone)
    assert np.array_equal(act[row], act_alone[0])


@HYP
@given(rows=st.integers(1, 80), parts=st.integers(2, 4), seed=st.integers(0, 2**32 - 1))
def test_rows_cut_into_parts_across_threads_come_out_as_in_one_pass(rows, parts, seed):
    # From PARALLEL_ELEMENTS elements on (a prefill, a large batch's verify step) the row-wise operators share the rows out
    # in parts across numba's threads: each row must get the bits the single pass gives it, or a token's logits
    # would depend on the batch it is verified in.
    rng = np.random.default_rng(seed)
    heads, kv_heads, dim, width, inner = 9, 3, 64, 576, 256
    x, delta = bf16_bits(_bf16(rng, rows, width, scale=3.0)), bf16_bits(_bf16(rng, rows, width, scale=3.0))
    weight = np.abs(rng.standard_normal(width)).astype(np.float32) + 0.5
    qkv = bf16_bits(_bf16(rng, rows, (heads + 2 * kv_heads) * dim, scale=3.0))
    angles = rng.uniform(0, 100, (rows, dim)).astype(np.float32)
    cos, sin = np.cos(angles), np.sin(angles)
    slots = rng.permutation(rows + 7)[:rows].astype(np.int64)
    gate_up = bf16_bits(_bf16(rng, rows, 2 * inner, scale=3.0))

    def run(n: int) -> list[np.ndarray]:
        normed, residual, after_add = np.empty_like(x), x.copy(), np.empty_like(x)
        rms_norm(x, weight, np.float32(1e-6), normed, n)
        add_rms_norm(residual, delta, weight, np.float32(1e-6), after_add, n)
        q = np.empty((rows, heads, dim), np.uint16)
        k_pool, v_pool = np.zeros((kv_heads, rows + 7, dim), np.uint16), np.zeros((kv_heads, rows + 7, dim), np.uint16)
        rope_and_store(qkv, cos, sin, heads, kv_heads, q, k_pool, v_pool, slots, n)
        act = np.empty((rows, inner), np.uint16)
        silu_and_mul(gate_up, act, n)
        return [normed, residual, after_add, q, k_pool, v_pool, act]

    for one_pass, in_parts in zip(run(1), run(parts)):
        assert np.array_equal(one_pass, in_parts)
    assert row_parts(1, PARALLEL_ELEMENTS - 1, 2) == 1 and row_parts(2, PARALLEL_ELEMENTS // 2, 4) == 2
    assert row_parts(500, 576, 1) == 1


def test_refuses_models_it_cannot_run():
    tiny = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 256}
    with pytest.raises(ValueError, match="runs bf16 models; this one is torch.float32"):
        FusedCpuDecoder(Transformer.random(tiny, dtype=torch.float32))
    with pytest.raises(ValueError, match="RoPE needs an even head_dim; got 15"):
        FusedCpuDecoder(Transformer.random({**tiny, "head_dim": 15}, dtype=torch.bfloat16))


@pytest.mark.skipif(not is_complete(default_model_dir()), reason="default model not prepared")
@pytest.mark.parametrize("kernels", ["numba", "attention"])
def test_engine_steps_decode_what_the_model_forward_decodes(kernels):
    # Verify steps on the numba attention run the fused forward (with the numba or PyTorch's linear layers); the
    # same engine with it switched off runs `Transformer.forward` on the same kernels. Greedy decoding of a real
    # prompt, then the fused forward along that path (teacher-forced), speculating the next three tokens every other
    # step: logits close, and the same greedy token wherever the reference's choice was not a near-tie. The two
    # forwards round differently (RMSNorm, SiLU), and bf16 logits tie exactly often enough (3 of this prompt's
    # first 9 steps) that free-running decodes part after a few steps.
    import warnings

    from drafter.tree import DraftTree
    from trt_engines.base import VerifyItem
    from trt_engines.torch_engine import TorchEngine

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "attention" where PyTorch's bf16 linear layers are not batch-invariant
        engine = TorchEngine("default", dtype=torch.bfloat16, num_blocks=64, max_context=1024, cpu_kernels=kernels)
    assert engine._fused is not None
    prompt = [1, 504, 3458, 282, 4649, 314, 260, 1345, 282, 30, 2399, 28, 339, 4510, 253, 1233]
    steps = 20

    def decode(fused, truth=None):
        """Greedy tokens and the logits they came from; along `truth` (each step's next root), when given."""
        engine._fused = fused
        rid = f"r{fused is None}"
        root = engine.add_request(rid, prompt)
        tokens, logits = [root], []
        try:
            while len(tokens) < steps:
                chain = truth[len(tokens):len(tokens) + 3] if truth and len(tokens) % 2 else []
                res = engine.verify([VerifyItem(rid, DraftTree.chain(chain) if chain else DraftTree.empty())],
                                    return_logits=True).results[0]
                accepted = 0
                while accepted < len(chain) and chain[accepted] == int(res.target_tokens[accepted]):
                    accepted += 1
                tokens += [int(t) for t in res.target_tokens[:accepted + 1]]
                logits += list(res.logits[:accepted + 1])
                next_root = truth[len(tokens) - 1] if truth and len(tokens) <= len(truth) else tokens[-1]
                engine.commit(rid, list(range(accepted)), next_root=next_root)
        finally:
            engine.release(rid)
        return tokens[:steps], torch.stack(logits[:steps - 1]).float()

    reference, reference_logits = decode(None)
    tokens, logits = decode(engine._fused, truth=reference)
    # one bf16 step apart somewhere in a hidden state grows over 20 steps: measured 0.5 at logits ~15, whose
    # bf16 spacing is 0.0625
    assert (logits - reference_logits).abs().max() <= 1.0
    assert tokens[0] == reference[0]  # the prefill's token
    for step, (ours, theirs) in enumerate(zip(tokens[1:], reference[1:])):
        # a different choice only where the reference's logits had it within the forwards' difference of its own
        assert ours == theirs or reference_logits[step, theirs] - reference_logits[step, ours] <= 0.5, step
    assert sum(a == b for a, b in zip(tokens, reference)) >= steps - 3


@pytest.mark.skipif(not is_complete(default_model_dir()), reason="default model not prepared")
def test_one_compiled_call_computes_what_the_layer_loop_computes():
    # With the numba linear layers the decoder's layers run as one compiled call; the Python loop over the same
    # kernels is the reference: the same bits for a prefill longer than one linear-kernel chunk (64 rows), a plain
    # step, a chain and a branching tree.
    from drafter.tree import DraftTree
    from trt_engines.base import VerifyItem
    from trt_engines.torch_engine import TorchEngine

    engine = TorchEngine("default", dtype=torch.bfloat16, num_blocks=64, max_context=1024, cpu_kernels="numba")
    fused = engine._fused
    loop = FusedCpuDecoder(engine.model, one_call=False)
    assert fused.one_call and not loop.one_call
    calls = []

    def captured(*args):
        calls.append(args)
        return fused(*args)

    engine._fused = captured
    rng = np.random.default_rng(0)
    engine.add_request("r", [int(t) for t in rng.integers(100, engine.vocab_size, 150)])
    drafted = [int(t) for t in rng.integers(100, engine.vocab_size, 6)]
    for tree in (DraftTree.empty(), DraftTree.chain(drafted[:4]),
                 DraftTree.from_arrays(tokens=drafted, parents=[-1, 0, 0, -1, 3, 1])):
        engine.verify([VerifyItem("r", tree)])
    assert [len(args[0]) for args in calls] == [150, 1, 5, 7]
    for args in calls:  # each call writes its tokens' keys and values to the same slots: the loop rewrites them
        ours, reference = fused(*args), loop(*args)
        assert torch.equal(ours.view(torch.int16), reference.view(torch.int16))
    # PyTorch's linear layers ("attention") keep the loop
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "attention" where PyTorch's bf16 linear layers are not batch-invariant
        engine = TorchEngine("default", dtype=torch.bfloat16, num_blocks=64, max_context=1024, cpu_kernels="attention")
    assert not engine._fused.one_call


def test_compiled_closures_close_over_constants_only():
    # numba's on-disk cache keys a closure on its cells' pickles: a compiled function in a cell pickles with a
    # per-process id, so every process would compile it afresh (and add another entry to the cache).
    from trt_engines.cpu_forward import _decoder_layers
    from trt_engines.cpu_kernels import _tree_attention_kernel

    for compiled in (_decoder_layers(64), _tree_attention_kernel(64), _tree_attention_kernel(64, True)):
        cells = [cell.cell_contents for cell in compiled.py_func.__closure__ or ()]
        assert cells and all(value is None or isinstance(value, (bool, int)) for value in cells), cells
