"""The event-clock simulator: `SimulatedEngine` replays recorded trajectories; `tools.simulate` drives the real
orchestrator, drafter and budget controller over it. Trajectories are the committed recordings; the datastore is
built here from the calibration split's outputs (never the evaluated prompts)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from datastore import Datastore, build_from_token_docs
from drafter.drafter import Drafter, DrafterConfig
from drafter.tree import DraftTree
from orchestrator.roofline import (
    KNOWN_HARDWARE,
    HardwareSpec,
    ModelShape,
    StepTimeModel,
)
from tools.simulate import (
    Deployment,
    Workload,
    closed_loop_arrivals,
    model_config,
    poisson_arrivals,
    simulate,
    trace_arrivals,
)
from tools.simulate import (
    main as simulate_main,
)
from tools.trajectories import load_trajectories, trajectory_path
from trt_engines.base import RequestError, SamplingParams, VerifyItem
from trt_engines.simulated_engine import SimClock, SimulatedEngine

LLAMA_8B = ModelShape.from_config(model_config("llama-3.1-8b"))


@pytest.fixture(scope="module")
def eval_trajectories():
    return load_trajectories(trajectory_path("grounded", "eval"))[:6]


@pytest.fixture(scope="module")
def drafter(tmp_path_factory):
    calib = load_trajectories(trajectory_path("grounded", "calib")) + load_trajectories(trajectory_path("humaneval", "calib"))
    docs = [np.concatenate([t.prompt_ids, t.output_ids]) for t in calib]
    path = build_from_token_docs(docs, tmp_path_factory.mktemp("ds") / "calib", vocab_size=49152, tokenizer_id="test")
    return Drafter(DrafterConfig(), datastores=[Datastore.open(path)])


def h100() -> Deployment:
    return Deployment(LLAMA_8B, KNOWN_HARDWARE["H100-SXM"])


def test_engine_answers_with_the_recorded_tokens_and_charges_the_step_model(eval_trajectories):
    tr = eval_trajectories[0]
    out = tr.output_ids
    clock = SimClock()
    model = StepTimeModel(LLAMA_8B, KNOWN_HARDWARE["H100-SXM"])
    engine = SimulatedEngine(model, clock, trajectories={tuple(tr.prompt_ids): out}, vocab_size=LLAMA_8B.vocab)
    assert engine.add_request("r", tr.prompt_ids.tolist(), SamplingParams()) == out[0]
    prefill = model.predict(np.array([len(tr.prompt_ids)]), np.array([0]))
    assert clock.now == pytest.approx(prefill)

    # A tree with the right chain of 3, a wrong sibling at depth 1 and a wrong child under the right chain.
    tree = DraftTree.from_arrays(tokens=[out[1], out[2], out[3], (out[1] + 1) % 49152, (out[3] + 1) % 49152],
                                 parents=[-1, 0, 1, -1, 1])
    result = engine.verify([VerifyItem("r", tree)]).results[0].target_tokens
    assert result[0] == out[1]  # after the root
    assert result[1:4].tolist() == [out[2], out[3], out[4]]  # after each node of the right chain
    assert clock.now == pytest.approx(prefill + model.predict(np.array([6]), np.array([len(tr.prompt_ids)])))
    with pytest.raises(RequestError, match="not the recorded token"):
        engine.commit("r", [0, 1], next_root=int(out[3]) + 1)

    engine.verify([VerifyItem("r", DraftTree.chain(out[1:3]))])
    engine.commit("r", [0, 1], next_root=int(out[3]))
    assert engine.verify([VerifyItem("r", DraftTree.empty())]).results[0].target_tokens.tolist() == [out[4]]
    engine.release("r")
    assert engine.free_blocks() == engine.total_blocks()


def test_engine_refuses_unknown_prompts_and_sampling(eval_trajectories):
    tr = eval_trajectories[0]
    engine = SimulatedEngine(StepTimeModel(LLAMA_8B, KNOWN_HARDWARE["H100-SXM"]), SimClock(),
                             trajectories={tuple(tr.prompt_ids): tr.output_ids}, vocab_size=LLAMA_8B.vocab)
    with pytest.raises(RequestError, match="no recorded trajectory"):
        engine.add_request("x", [1, 2, 3], SamplingParams())
    with pytest.raises(RequestError, match="greedy"):
        engine.add_request("y", tr.prompt_ids.tolist(), SamplingParams(temperature=0.7))
    with pytest.raises(RequestError, match="log probabilities"):  # it replays tokens: it has none to give
        engine.add_request("z", tr.prompt_ids.tolist(), SamplingParams(logprobs=2))
    assert engine.free_blocks() == engine.total_blocks() and not engine.requests
    # the orchestrator says so at submit, naming the field (a 400 over HTTP), before anything is queued
    from orchestrator.budget import BudgetController, BudgetPolicy
    from orchestrator.core import Orchestrator
    from orchestrator.request import GenerationRequest
    from trt_engines.base import InvalidField

    orchestrator = Orchestrator(engine, Drafter(DrafterConfig(sources="input")), BudgetController(
        BudgetPolicy.parse("none"), StepTimeModel(LLAMA_8B, KNOWN_HARDWARE["H100-SXM"])))
    with pytest.raises(InvalidField, match="SimulatedEngine does not return log probabilities") as refused:
        orchestrator.submit(GenerationRequest(prompt_ids=tuple(tr.prompt_ids.tolist()),
                                              sampling=SamplingParams(logprobs=0)))
    assert refused.value.field == "logprobs" and orchestrator.idle


def test_prefix_caching_charges_only_the_prompt_tokens_no_earlier_request_left(eval_trajectories):
    first, second = eval_trajectories[0], eval_trajectories[1]
    shared = next(i for i, (x, y) in enumerate(zip(first.prompt_ids, second.prompt_ids)) if x != y)
    assert shared >= 16  # the chat template's head: at least one full block in common
    model = StepTimeModel(LLAMA_8B, KNOWN_HARDWARE["H100-SXM"])
    clock = SimClock()
    engine = SimulatedEngine(model, clock, trajectories={tuple(t.prompt_ids): t.output_ids for t in (first, second)},
                             vocab_size=LLAMA_8B.vocab, prefix_caching=True)
    engine.add_request("a", first.prompt_ids.tolist())
    assert engine.cached_prompt_tokens("a") == 0
    before = clock.now
    engine.add_request("b", second.prompt_ids.tolist())
    cached = shared // 16 * 16
    assert engine.cached_prompt_tokens("b") == cached
    assert clock.now - before == pytest.approx(model.predict(np.array([len(second.prompt_ids) - cached]),
                                                             np.array([cached])))
    engine.add_request("c", first.prompt_ids.tolist(), cache_salt="other")  # another salt shares nothing
    assert engine.cached_prompt_tokens("c") == 0


@pytest.mark.parametrize("policy", ["none", "fixed:8", "goodput"])
def test_simulation_reproduces_the_trajectories_and_counts_time(eval_trajectories, drafter, policy):
    max_tokens = 48
    workload = Workload(tuple(eval_trajectories), max_tokens, tuple(closed_loop_arrivals(len(eval_trajectories))), 3)
    result = simulate(h100(), workload, policy, drafter, host_time="none")
    # every request produced exactly its recorded greedy tokens (up to EOS or the token limit)
    assert result.outputs == [t.output_ids[:max_tokens].tolist() for t in eval_trajectories]
    m = result.metrics
    assert m["host_s"] == 0 and result.seconds == pytest.approx(m["engine_s"])  # no host time charged
    assert 0 < m["ttft_p50_s"] <= m["latency_p50_s"]
    if policy == "none":
        assert m["tau"] == 1.0 and m["mean_nodes_per_request_step"] == 0
    else:
        assert m["tau"] > 1.0


def test_goodput_speculates_at_low_load_and_less_at_high_load(eval_trajectories, drafter):
    # A device with a low ridge (a CPU-like roofline) so that six requests already fill it.
    cpu = Deployment(ModelShape.from_config(model_config("smollm2-135m")),
                     HardwareSpec("cpu-like", {"bfloat16": 3e11}, mem_bandwidth=2e10, overhead_s=5e-3))
    trajectories = tuple(eval_trajectories)
    nodes = []
    for concurrency in (1, 6):
        workload = Workload(trajectories, 32, tuple(closed_loop_arrivals(len(trajectories))), concurrency)
        none = simulate(cpu, workload, "none", drafter, host_time="none")
        goodput = simulate(cpu, workload, "goodput", drafter, host_time="none")
        assert goodput.metrics["tokens_per_s"] >= none.metrics["tokens_per_s"]
        nodes.append(goodput.metrics["mean_nodes_per_request_step"])
    assert nodes[0] > nodes[1] > 0


def test_poisson_arrivals_leave_the_server_idle_between_requests(eval_trajectories, drafter):
    arrivals = poisson_arrivals(len(eval_trajectories), 0.5, seed=3)
    assert np.all(np.diff(arrivals) > 0)
    workload = Workload(tuple(eval_trajectories), 16, tuple(arrivals), 8)
    result = simulate(h100(), workload, "none", drafter, host_time="none")
    simulated_span = result.seconds  # event-clock time, not wall time: deterministic for this workload
    assert simulated_span < arrivals[-1] - arrivals[0] + 5  # the clock jumps over idle gaps: no busy loop
    assert result.metrics["latency_p50_s"] < 1.0  # at 0.5 requests/s an H100 serves each alone


def test_trace_arrivals_from_csv(tmp_path):
    with_header = tmp_path / "trace.csv"
    with_header.write_text("request,timestamp\na,10.0\nb,10.5\nc,12.0\n")
    assert trace_arrivals(with_header, 5).tolist() == pytest.approx([0.0, 0.5, 2.0, 3.0, 3.5])
    bare = tmp_path / "bare.csv"
    bare.write_text("3\n1\n2\n")
    assert trace_arrivals(bare, 3).tolist() == [0.0, 1.0, 2.0]
    bad = tmp_path / "bad.csv"
    bad.write_text("timestamp\nsoon\n")
    with pytest.raises(ValueError, match="bad.csv"):
        trace_arrivals(bad, 2)
    with pytest.raises(ValueError, match="cannot read"):
        trace_arrivals(tmp_path / "missing.csv", 2)


def test_cli_errors_name_the_fix(capsys, tmp_path):
    with pytest.raises(SystemExit):
        simulate_main(["--model", "llama-9000"])
    assert "unknown model 'llama-9000'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        simulate_main(["--hardware", "TPU-v9"])
    assert "unknown hardware" in capsys.readouterr().err
    for bad, message in (("0", "micro_batches must be an int >= 1"), ("two", "--micro-batches: invalid")):
        with pytest.raises(SystemExit):
            simulate_main(["--micro-batches", bad])
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        simulate_main(["--micro-batches", "2", "--host-time", "measured"])
    assert "needs --host-time draft, plan or none" in capsys.readouterr().err
    # an arrival trace that is not there: refused with the other bad options, before anything is simulated
    with pytest.raises(SystemExit):
        simulate_main(["--trace", str(tmp_path / "missing.csv"), "--prompts", "2"])
    err = capsys.readouterr().err
    assert "missing.csv: cannot read the arrival trace" in err and "Traceback" not in err
    # numbers out of range: one line naming the option (they raised a traceback, or divided by zero, before)
    for argv, message in ((["--tp", "0"], "tensor-parallel degree"), (["--tp", "3"], "divides the model's 32"),
                          (["--prompts", "0"], "--prompts must be >= 1"), (["--max-tokens", "0"], "max_tokens must"),
                          (["--concurrency", "4", "0"], "concurrency (requests running at once) must be >= 1"),
                          (["--rates", "-1"], "rate must be > 0"),
                          (["--rates", "1", "--max-running", "0"], "--max-running must be >= 1")):
        with pytest.raises(SystemExit):
            simulate_main([*argv, "--prompts", argv[1] if argv[0] == "--prompts" else "2"])
        assert message in capsys.readouterr().err, argv


def test_split_batches_reproduce_the_trajectories_and_hide_drafting(eval_trajectories, drafter):
    # Micro-batches that take turns on a simulated H100: each step verifies half the batch while the other half is
    # drafted, so a step waits for drafting only where nothing was drafted ahead. Counted in requests, not seconds:
    # the drafting's wall time on a shared CI machine is not the test's to bound.
    workload = Workload(tuple(eval_trajectories), 32, tuple(closed_loop_arrivals(len(eval_trajectories))), 6)
    whole = simulate(h100(), workload, "fixed:4", drafter, host_time="draft")
    split = simulate(h100(), workload, "fixed:4", drafter, host_time="draft", micro_batches=2)
    assert split.outputs == whole.outputs == [t.output_ids[:32].tolist() for t in eval_trajectories]
    # every step splits but the last few, where one request is left and cannot be
    assert split.metrics["steps"] > split.metrics["split_steps"] > 0.8 * split.metrics["steps"]
    assert whole.metrics["split_steps"] == 0
    assert whole.metrics["drafted_ahead"] == 0
    # all but the first micro-batch, and a request or two where finishing requests leave the turns uneven
    assert split.metrics["drafted_ahead"] > 0.9 * split.metrics["request_steps"]
    with pytest.raises(ValueError, match="micro-batches need host_time"):
        simulate(h100(), workload, "fixed:4", drafter, host_time="measured", micro_batches=2)


def test_host_overhead_is_charged_per_step_and_per_running_request(eval_trajectories, drafter):
    workload = Workload(tuple(eval_trajectories), 32, tuple(closed_loop_arrivals(len(eval_trajectories))), 3)
    per_step, per_request = 0.004, 0.001
    plain = simulate(h100(), workload, "fixed:4", drafter, host_time="none")
    loaded = simulate(dataclasses.replace(h100(), host_overhead=(per_step, per_request)), workload, "fixed:4", drafter,
                      host_time="none")
    assert loaded.outputs == plain.outputs and loaded.metrics["steps"] == plain.metrics["steps"]
    request_steps = (loaded.tokens - len(eval_trajectories)) / loaded.metrics["tau"]  # sum of batch sizes
    expected = per_step * loaded.metrics["steps"] + per_request * request_steps
    assert loaded.metrics["host_s"] == pytest.approx(expected, rel=1e-6)
    # simulated time, not wall time: the charged overhead lowers simulated throughput
    assert loaded.metrics["tokens_per_s"] < plain.metrics["tokens_per_s"]


def test_host_overhead_fit_recovers_a_per_step_and_per_request_cost():
    from benchmarks.throughput import fit_host_overhead

    rng = np.random.default_rng(0)
    batches = rng.integers(1, 33, 400)
    seconds = 0.0006 + 0.00005 * batches + rng.normal(0, 1e-5, batches.size)
    a, b = fit_host_overhead(list(zip(batches.tolist(), seconds.tolist())))
    assert a == pytest.approx(0.0006, rel=0.05) and b == pytest.approx(0.00005, rel=0.05)
    assert fit_host_overhead([]) == [0.0, 0.0]
    assert min(fit_host_overhead([(1, 0.001), (2, 0.0005), (4, 0.0001)])) >= 0  # never a negative cost


def test_a_grouped_deployment_prices_attention_calls_by_its_device():
    # TorchEngine splits a step's attention into calls at its device's price; the simulator's step model must too
    from trt_engines.attention_groups import call_cost_for

    gpu = dataclasses.replace(h100(), attention_layout="grouped")
    cpu = dataclasses.replace(gpu, device="cpu")
    assert gpu.step_model().attention_call_cost == call_cost_for("cuda") > call_cost_for("cpu")
    assert cpu.step_model(prefill=True).attention_call_cost == call_cost_for("cpu")
    tokens, context = np.array([5.0] + [1.0] * 15), np.full(16, 600.0)
    assert gpu.step_model().extra_attention_calls(tokens, context) == 0
    assert cpu.step_model().extra_attention_calls(tokens, context) > 0
