"""Chunked prefill: `TorchEngine` prefills a prompt over several calls, bitwise as if whole (the batch-invariant
prefill, on the default model in bf16), and the orchestrator spreads a long prompt over steps while the running
requests keep decoding; the simulator charges it chunk by chunk."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from drafter.drafter import Drafter, DrafterConfig
from drafter.tree import DraftTree
from orchestrator.budget import BudgetController, BudgetPolicy
from orchestrator.core import Orchestrator
from orchestrator.request import FinishReason, GenerationRequest
from orchestrator.roofline import KNOWN_HARDWARE, HardwareSpec, ModelShape, StepTimeModel
from orchestrator.spec_loop import generate
from tests.test_prefix_cache import _assert_same_bits, _decode
from tools.simulate import Deployment, Workload, model_config, simulate
from tools.trajectories import load_trajectories, trajectory_path
from trt_engines.base import RequestError, SamplingParams, VerifyItem
from trt_engines.prepare import default_model_dir, is_complete
from trt_engines.simulated_engine import SimClock, SimulatedEngine

BLOCK = 16
BLOCKS = 96
needs_model = pytest.mark.skipif(not is_complete(default_model_dir()), reason="default model not prepared")


@pytest.fixture(scope="module")
def engine():
    from trt_engines.torch_engine import TorchEngine

    torch.set_num_threads(2)
    # prefix caching asked for explicitly: it makes the prefill batch-invariant with the numba attention whichever
    # linear layers this CPU gets, so chunks are exact here as with the numba kernels
    return TorchEngine("default", dtype=torch.bfloat16, num_blocks=BLOCKS, block_size=BLOCK, max_context=1024,
                       prefix_caching=True)


@needs_model
def test_a_prompt_prefilled_in_chunks_decodes_bitwise_as_prefilled_whole(engine):
    rng = np.random.default_rng(11)
    prompt = [1] + rng.integers(2, 49152, 74).tolist()  # 75 tokens; chunks of 20, 30, 25 cross block boundaries
    engine.reset_prefix_cache()
    assert engine.add_request("c", prompt, prefill_tokens=20) is None
    assert engine.prompt_tokens_left("c") == 55 and engine.context_length("c") == 20
    assert engine.kv.cached_blocks() == 1  # each full block is published as soon as a chunk completes it
    with pytest.raises(RequestError, match="still being prefilled"):
        engine.verify([VerifyItem("c", DraftTree.empty())])
    assert engine.prompt_tokens_left("c") == 55
    assert engine.prefill("c", 30) is None
    assert engine.prompt_tokens_left("c") == 25 and engine.kv.cached_blocks() == 3
    root = engine.prefill("c", 1000)  # more than is left: the rest
    assert root is not None and engine.prompt_tokens_left("c") == 0
    with pytest.raises(RequestError, match="prefilled already"):
        engine.prefill("c", 5)
    got = _decode(engine, "c", 8)
    engine.release("c")

    engine.reset_prefix_cache()
    assert engine.add_request("whole", prompt) == root and engine.prompt_tokens_left("whole") == 0
    want = _decode(engine, "whole", 8)
    engine.release("whole")
    _assert_same_bits(got, want)
    assert engine.free_blocks() == BLOCKS


@needs_model
def test_bad_chunk_sizes_are_refused_and_change_nothing(engine):
    prompt = list(range(1, 41))
    free = engine.free_blocks()
    for bad in (0, -3, True, 2.5, "8"):
        with pytest.raises(RequestError, match="prefill_tokens must be an int >= 1"):
            engine.add_request("bad", prompt, prefill_tokens=bad)
    assert "bad" not in engine.requests and engine.free_blocks() == free
    engine.add_request("p", prompt, prefill_tokens=8)
    with pytest.raises(RequestError, match="max_tokens must be an int >= 1"):
        engine.prefill("p", 0)
    with pytest.raises(RequestError, match="unknown request"):
        engine.prefill("nobody", 8)
    assert engine.prompt_tokens_left("p") == 32
    engine.release("p")  # mid-prefill: its blocks go back
    assert engine.free_blocks() == free
    with pytest.raises(ValueError, match="prefill_chunk must be an int >= 1"):
        Orchestrator(engine, Drafter(DrafterConfig(sources="input"), vocab_size=engine.vocab_size),
                     BudgetController(BudgetPolicy.parse("none"), _step_model()), prefill_chunk=0)


@needs_model
def test_serving_chunks_prompts_by_default_only_where_chunks_are_exact(engine):
    from orchestrator.serving.stack import AUTO_PREFILL_CHUNK, ServingConfig, serving_prefill_chunk
    from trt_engines.torch_engine import TorchEngine

    assert ServingConfig().prefill_chunk == "auto"
    assert engine.exact_chunked_prefill  # the bf16 numba attention: chunks give a whole prefill's bits (test above)
    assert serving_prefill_chunk("auto", engine) == AUTO_PREFILL_CHUNK
    fp32 = TorchEngine("default", dtype=torch.float32, num_blocks=8, block_size=BLOCK, max_context=128)
    assert not fp32.exact_chunked_prefill and serving_prefill_chunk("auto", fp32) is None  # whole prompts there
    assert serving_prefill_chunk(None, engine) is None and serving_prefill_chunk(64, fp32) == 64  # asked for: kept
    with pytest.raises(ValueError, match="prefill_chunk must be 'auto', an int >= 1"):
        ServingConfig(prefill_chunk="whole")


def _step_model() -> StepTimeModel:
    cpu = HardwareSpec("test-cpu", {"bfloat16": 3e11}, mem_bandwidth=2e10, overhead_s=5e-3)
    return StepTimeModel(ModelShape.from_config(default_model_dir()), cpu)


def _orchestrator(engine, *, policy: str, prefill_chunk: int | None, max_running: int = 4) -> Orchestrator:
    return Orchestrator(engine, Drafter(DrafterConfig(sources="input"), vocab_size=engine.vocab_size),
                        BudgetController(BudgetPolicy.parse(policy), _step_model()), max_running=max_running,
                        prefill_chunk=prefill_chunk)


@needs_model
def test_a_long_prompt_is_prefilled_over_steps_while_running_requests_decode(engine):
    rng = np.random.default_rng(12)
    short = [[1] + rng.integers(2, 49152, n).tolist() for n in (9, 20)]
    long = [1] + rng.integers(2, 49152, 299).tolist()
    engine.reset_prefix_cache()
    # the short requests outlast the long prompt's prefill (at most 5 tokens a step, 12 steps)
    reference, _ = generate(engine, short, max_new_tokens=96, stop_at_eos=False, id_prefix="ref")
    reference += generate(engine, [long], max_new_tokens=24, stop_at_eos=False, id_prefix="ref-long")[0]
    engine.reset_prefix_cache()
    orchestrator = _orchestrator(engine, policy="fixed:4", prefill_chunk=32)
    outputs: dict[str, list[int]] = {}
    first_token_step: dict[str, int] = {}

    def collect(out):
        if out.token_ids and out.request_id not in first_token_step:
            first_token_step[out.request_id] = len(orchestrator.records)  # the index of the step streaming it
        outputs.setdefault(out.request_id, []).extend(out.token_ids)

    ids = [orchestrator.submit(GenerationRequest(prompt_ids=tuple(p), max_tokens=96, ignore_eos=True), collect)
           for p in short]
    orchestrator.step()  # both short prompts fit the step's 32 tokens
    orchestrator.step()
    ids.append(orchestrator.submit(GenerationRequest(prompt_ids=tuple(long), max_tokens=24, ignore_eos=True), collect))
    orchestrator.run_until_idle()

    assert [outputs[i] for i in ids] == reference  # chunks and speculation change no token
    records = list(orchestrator.records)
    assert records[0].prefill_tokens == [10, 21] and not records[1].prefill_tokens
    assert all(sum(r.prefill_tokens) <= 32 for r in records)
    # the long prompt took ceil(300 / 32) = 10 steps' chunks, every one beside a verify of the short requests; it
    # streamed its first token in the step of its last chunk and joined that step's verify
    long_steps = records[2:12]
    assert [r.prefill_tokens for r in long_steps] == [[32]] * 9 + [[12]]
    assert [r.prefill_context[0] for r in long_steps] == list(range(0, 300, 32))
    assert [r.batch for r in long_steps] == [2] * 9 + [3]
    assert first_token_step[ids[2]] == 11 and not any(r.prefill_tokens for r in records[12:])
    assert engine.free_blocks() == BLOCKS


@needs_model
def test_steps_that_only_prefill_are_recorded_so_every_prompt_token_is_accounted(engine):
    # A lone prompt in chunks: no request runs until its last chunk, and those steps verify nothing. They are
    # still step records (batch 0), so the records hold every chunk's tokens and seconds, as they hold a whole
    # prefill's; the serving metrics count only verification steps.
    from orchestrator.serving.metrics import ServingMetrics

    engine.reset_prefix_cache()
    orchestrator = _orchestrator(engine, policy="none", prefill_chunk=32)
    orchestrator.submit(GenerationRequest(prompt_ids=tuple(range(1, 101)), max_tokens=4, ignore_eos=True))
    orchestrator.run_until_idle()
    records = list(orchestrator.records)
    assert [(r.batch, r.prefill_tokens, r.prefill_context) for r in records[:4]] == [
        (0, [32], [0]), (0, [32], [32]), (0, [32], [64]), (1, [4], [96])]
    assert sum(sum(r.prefill_tokens) for r in records) == 100
    assert all(r.step_s >= sum(r.prefill_s) > 0 for r in records[:4])
    metrics = ServingMetrics()
    for r in records:
        metrics.observe_step(r)
    verify_steps = sum(r.batch > 0 for r in records)
    assert verify_steps == len(records) - 3
    assert metrics.registry.get_sample_value("retrospec_steps_total") == verify_steps
    assert engine.free_blocks() == BLOCKS


@needs_model
def test_cancelling_a_request_mid_prefill_frees_its_blocks(engine):
    engine.reset_prefix_cache()
    orchestrator = _orchestrator(engine, policy="none", prefill_chunk=16)
    finished = []
    rid = orchestrator.submit(GenerationRequest(prompt_ids=tuple(range(1, 101)), max_tokens=8),
                              lambda out: finished.append(out) if out.finished else None)
    record = orchestrator.step()  # prefilled its first chunk; nothing runs yet: a step without a verify
    assert record.batch == 0 and record.prefill_tokens == [16] and record.measured_s == 0.0
    assert rid in orchestrator.prefilling and rid in orchestrator.request_ids() and not orchestrator.idle
    assert engine.prompt_tokens_left(rid) == 84
    assert orchestrator.cancel(rid)
    assert finished[0].finish_reason == FinishReason.CANCELLED and finished[0].token_ids == []
    assert orchestrator.idle and rid not in engine.requests and engine.free_blocks() == BLOCKS


def test_the_simulator_charges_each_chunk_and_refuses_to_verify_a_prompt_in_progress():
    tr = max(load_trajectories(trajectory_path("grounded", "eval")), key=lambda t: len(t.prompt_ids))
    shape = ModelShape.from_config(model_config("llama-3.1-8b"))
    model = StepTimeModel(shape, KNOWN_HARDWARE["H100-SXM"])
    clock = SimClock()
    engine = SimulatedEngine(model, clock, trajectories={tuple(tr.prompt_ids): tr.output_ids}, vocab_size=shape.vocab)
    n = len(tr.prompt_ids)
    assert engine.add_request("r", tr.prompt_ids.tolist(), SamplingParams(), prefill_tokens=64) is None
    with pytest.raises(RequestError, match="still being prefilled"):
        engine.verify([VerifyItem("r", DraftTree.empty())])
    first = None
    while first is None:
        first = engine.prefill("r", 64)
    assert first == tr.output_ids[0] and engine.prompt_tokens_left("r") == 0
    chunks = [(start, min(64, n - start)) for start in range(0, n, 64)]
    charged = sum(model.predict(np.array([size]), np.array([start])) for start, size in chunks)
    assert clock.now == pytest.approx(charged)


def test_simulated_chunked_prefill_shortens_the_stream_gaps_a_long_prompt_causes():
    trajectories = load_trajectories(trajectory_path("grounded", "eval"))
    longest = max(trajectories, key=lambda t: len(t.prompt_ids))
    others = [t for t in trajectories if t is not longest][:3]
    workload = Workload(tuple(others + [longest]), 48, (0.0, 0.0, 0.0, 0.05), 4)
    deployment = Deployment(ModelShape.from_config(model_config("llama-3.1-8b")), KNOWN_HARDWARE["H100-SXM"])
    drafter = Drafter(DrafterConfig(sources="input"), vocab_size=deployment.shape.vocab)
    whole = simulate(deployment, workload, "none", drafter, host_time="none")
    chunked = simulate(deployment, workload, "none", drafter, host_time="none", prefill_chunk=64)
    assert chunked.outputs == whole.outputs
    # the whole prefill of the long prompt stalls the three streams once; in chunks it is spread thin
    assert chunked.metrics["stream_gap_max_s"] < whole.metrics["stream_gap_max_s"]
    assert chunked.metrics["ttft_p99_s"] >= whole.metrics["ttft_p99_s"]  # the long prompt itself waits longer


def test_a_steps_prefill_counts_against_the_running_requests_tpot_objective():
    # Three short requests with a TPOT objective are decoding (goodput speculates for them) when a long prompt arrives
    # and is prefilled in chunks beside them. A chunk delays their next token as much as the verify does, so goodput
    # may only spend what the chunk left of the objective: the prediction plus the step's prefill stays within it.
    longest = max(load_trajectories(trajectory_path("grounded", "eval")), key=lambda t: len(t.prompt_ids))
    short = sorted(load_trajectories(trajectory_path("mtbench", "eval")), key=lambda t: len(t.prompt_ids))[:3]
    shape = ModelShape.from_config(model_config("llama-3.1-8b"))
    model = StepTimeModel(shape, KNOWN_HARDWARE["H100-SXM"])
    clock = SimClock()
    engine = SimulatedEngine(model, clock, trajectories={tuple(t.prompt_ids): t.output_ids for t in short + [longest]},
                             vocab_size=shape.vocab)
    orchestrator = Orchestrator(engine, Drafter(DrafterConfig(sources="input"), vocab_size=shape.vocab),
                                BudgetController(BudgetPolicy.parse("goodput"), model.clone()), clock=clock,
                                prefill_chunk=256)
    plain_s = model.predict(np.ones(3), np.array([len(t.prompt_ids) for t in short], np.float64))
    chunk_s = model.predict(np.array([256.0]), np.array([0.0]))
    tpot = plain_s + 0.5 * chunk_s  # room to speculate in a step without a prefill, none in one with a chunk
    for t in short:
        orchestrator.submit(GenerationRequest(prompt_ids=tuple(int(i) for i in t.prompt_ids), tpot_s=tpot,
                                              max_tokens=min(64, len(t.output_ids)), ignore_eos=True), lambda out: None)
    before = [orchestrator.step() for _ in range(4)]  # admitted and decoding
    orchestrator.submit(GenerationRequest(prompt_ids=tuple(int(i) for i in longest.prompt_ids), max_tokens=8,
                                          ignore_eos=True), lambda out: None)
    during = [orchestrator.step()]
    while orchestrator.prefilling:
        during.append(orchestrator.step())
    records = [r for r in before + during if r is not None]
    chunks = [r for r in during if r is not None and r.prefill_tokens == [256]]
    assert len(chunks) >= 2
    # timed by the orchestrator's clock, here the simulated one, which the engine advanced by the chunk's cost
    assert all(sum(r.prefill_s) >= 0.5 * chunk_s for r in chunks)
    for r in records:
        if sum(r.nodes):
            assert r.predicted_s + sum(r.prefill_s) <= tpot * (1 + 1e-9)
    assert any(sum(r.nodes) for r in records if not r.prefill_s)  # without a prefill beside them, they speculate
