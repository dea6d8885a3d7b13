"""The Triton front end against a real tritonserver (pytriton's bundle) on 127.0.0.1: the decoupled generate model
over gRPC streaming and the drafting service over HTTP, with bad input, load and KV-leak checks."""

from __future__ import annotations

import logging
import os
import queue
import sysconfig
import threading
import time

import httpx
import numpy as np
import pytest

from tests.test_serving_http import MAX_TOKENS, PROMPTS, forget_running_requests, build_test_datastore, wait_until
from trt_engines.prepare import default_model_dir, is_complete

pytestmark = pytest.mark.skipif(not is_complete(default_model_dir()), reason="default model not prepared")
grpcclient = pytest.importorskip("tritonclient.grpc")
httpclient = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException, np_to_triton_dtype  # noqa: E402


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from orchestrator.serving.stack import ServingConfig, ServingStack
    from orchestrator.serving.triton_server import TritonPorts, start_triton
    from orchestrator.spec_loop import generate

    ds = build_test_datastore(tmp_path_factory.mktemp("ds") / "code")
    config = ServingConfig(dtype="float32", num_blocks=320, max_context=512, datastores=(ds,), hardware="nominal",
                           fit_step_model=False, max_body_bytes=64 * 1024, draft_idle_timeout_s=2.0)
    stack = ServingStack.build(config)
    prompts = [stack.encode(p) for p in PROMPTS]
    reference, _ = generate(stack.engine, prompts, max_new_tokens=MAX_TOKENS, id_prefix="ref")
    ports = TritonPorts.free()
    triton = start_triton(stack, ports=ports)  # sets LD_LIBRARY_PATH for the tritonserver subprocess itself
    try:
        yield {"stack": stack, "ports": ports, "triton": triton, "prompts": prompts, "reference": reference,
               "datastore": ds}
    finally:
        stack.shutdown(cancel_inflight=True, timeout=30)
        triton.stop()


def tensor(module, name: str, array: np.ndarray):
    t = module.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
    t.set_data_from_numpy(array)
    return t


def stream_generate(url: str, inputs: dict[str, np.ndarray], *, timeout: float = 120) -> dict:
    """One request over a gRPC stream; returns tokens, text, finish reason and the last statistics (or the error)."""
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        client.async_stream_infer("retrospec_generate", [tensor(grpcclient, k, v) for k, v in inputs.items()])
        out = {"tokens": [], "text": "", "finish": "", "error": None, "responses": 0}
        deadline = time.monotonic() + timeout
        while not out["finish"]:
            result, error = results.get(timeout=max(0.1, deadline - time.monotonic()))
            if error is not None:
                out["error"] = error
                break
            out["responses"] += 1
            out["tokens"] += result.as_numpy("output_ids").tolist()
            out["text"] += result.as_numpy("text_output")[0].decode()
            out["finish"] = result.as_numpy("finish_reason")[0].decode()
            out["steps"] = int(result.as_numpy("steps")[0])
            out["accepted"] = int(result.as_numpy("accepted_tokens")[0])
            out["tokens_per_step"] = float(result.as_numpy("tokens_per_step")[0])
            for name in ("output_log_probs", "top_logprob_ids", "top_logprobs"):  # sent where logprobs was asked
                if result.as_numpy(name) is not None:
                    out.setdefault(name, []).append(result.as_numpy(name))
        return out
    finally:
        client.stop_stream()
        client.close()


def grpc_url(server) -> str:
    return f"127.0.0.1:{server['ports'].grpc}"


def test_launcher_put_libpython_on_the_library_path(server):
    assert sysconfig.get_config_var("LIBDIR") in os.environ["LD_LIBRARY_PATH"].split(":")


def test_generate_streams_greedy_output_with_statistics(server):
    stack = server["stack"]
    ids = np.asarray(server["prompts"][0], np.int32)
    out = stream_generate(grpc_url(server), {"input_ids": ids, "max_tokens": np.array([MAX_TOKENS], np.int32)})
    assert out["error"] is None and out["tokens"] == server["reference"][0]
    assert out["text"] == stack.tokenizer.decode(server["reference"][0])
    assert out["finish"] in ("stop", "length") and out["steps"] >= 1
    assert out["tokens_per_step"] == pytest.approx((out["accepted"] + out["steps"]) / out["steps"])
    by_text = stream_generate(grpc_url(server), {"text_input": np.array([PROMPTS[0].encode()], np.object_),
                                                 "max_tokens": np.array([MAX_TOKENS], np.int32),
                                                 "cache_salt": np.array([b"tenant-1"], np.object_)})
    assert by_text["tokens"] == server["reference"][0]


def test_stream_false_sends_the_whole_output_as_one_response_which_http_generate_needs(server):
    # Triton's HTTP `generate` endpoint refuses a model's second response; with stream=false the model sends one,
    # the same tokens, text, statistics and log probabilities the stream would have brought in pieces.
    stack, reference = server["stack"], server["reference"][1]
    body = {"text_input": PROMPTS[1], "max_tokens": MAX_TOKENS, "stream": False, "logprobs": 1}
    response = httpx.post(f"http://127.0.0.1:{server['ports'].http}/v2/models/retrospec_generate/generate",
                          json=body, timeout=120)
    assert response.status_code == 200, response.text
    whole = response.json()
    assert whole["output_ids"] == reference and whole["text_output"] == stack.tokenizer.decode(reference)
    assert whole["finish_reason"] in ("stop", "length") and whole["steps"] >= 1
    assert len(whole["output_log_probs"]) == len(reference) and whole["top_logprob_ids"] == reference  # greedy
    ids = np.asarray(server["prompts"][1], np.int32)
    inputs = {"input_ids": ids, "max_tokens": np.array([MAX_TOKENS], np.int32)}
    once = stream_generate(grpc_url(server), {**inputs, "stream": np.array([False])})
    streamed = stream_generate(grpc_url(server), {**inputs, "stream": np.array([True])})
    assert once["error"] is None and once["responses"] == 1 and once["tokens"] == reference
    assert streamed["tokens"] == reference and streamed["responses"] > 1
    bad = httpx.post(f"http://127.0.0.1:{server['ports'].http}/v2/models/retrospec_generate/generate",
                     json={**body, "max_tokens": 0}, timeout=60)
    assert bad.status_code == 400 and "max_tokens" in bad.json()["error"]


def test_generate_streams_log_probabilities_per_output_token_where_asked(server):
    # logprobs: k gives, per token of each response's output_ids, its log probability and the k most likely
    # tokens', as the orchestrator returns them; a request that does not ask gets none of these outputs.
    stack = server["stack"]
    ids = np.asarray(server["prompts"][0], np.int32)
    out = stream_generate(grpc_url(server), {"input_ids": ids, "max_tokens": np.array([MAX_TOKENS], np.int32),
                                             "logprobs": np.array([3], np.int32)})
    assert out["error"] is None and out["tokens"] == server["reference"][0]
    chosen = np.concatenate(out["output_log_probs"])
    top_ids, top = np.concatenate(out["top_logprob_ids"]), np.concatenate(out["top_logprobs"])
    n = len(out["tokens"])
    assert chosen.shape == (n,) and top_ids.shape == top.shape == (n, 3)
    assert top_ids[:, 0].tolist() == out["tokens"] and np.array_equal(top[:, 0], chosen)  # greedy: the likeliest
    assert (np.diff(top, axis=1) <= 0).all() and (chosen <= 0).all()
    direct = stack.runner.generate(stack.make_request(prompt_ids=ids.tolist(), max_tokens=MAX_TOKENS, logprobs=3),
                                   timeout=120)
    assert direct.token_ids == out["tokens"]
    # fp32: the two runs verify other trees (the drafter learnt from the first), the same up to rounding
    np.testing.assert_allclose(chosen, [e.logprob for e in direct.logprobs], atol=1e-4)
    assert top_ids.tolist() == [[t for t, _ in e.top] for e in direct.logprobs]
    np.testing.assert_allclose(top, [[v for _, v in e.top] for e in direct.logprobs], atol=1e-4)
    zero = stream_generate(grpc_url(server), {"input_ids": ids, "max_tokens": np.array([4], np.int32),
                                              "logprobs": np.array([0], np.int32)})
    assert zero["error"] is None and "top_logprob_ids" not in zero and "top_logprobs" not in zero  # k = 0
    np.testing.assert_allclose(np.concatenate(zero["output_log_probs"]), chosen[:4], atol=1e-4)
    plain = stream_generate(grpc_url(server), {"input_ids": ids, "max_tokens": np.array([4], np.int32)})
    assert plain["error"] is None and "output_log_probs" not in plain and "top_logprobs" not in plain


def test_draft_service_matches_a_fresh_drafter_and_releases_state(server):
    from orchestrator.serving.stack import make_drafter

    url = f"127.0.0.1:{server['ports'].http}"
    client = httpclient.InferenceServerClient(url)
    service = server["triton"].draft_service
    local = make_drafter(server["stack"].config)  # the same calls on a fresh drafter give the reference trees
    prompt = np.asarray(server["stack"].encode("def wraps(wrapped, assigned=WRAPPER_ASSIGNMENTS,"), np.int32)

    def call(rid, ids, budget=16, end=None):
        inputs = [tensor(httpclient, "request_id", np.array([rid.encode()], np.object_)),
                  tensor(httpclient, "input_ids", np.asarray(ids, np.int32)),
                  tensor(httpclient, "budget", np.array([budget], np.int32))]
        if end is not None:
            inputs.append(tensor(httpclient, "end", np.array([end], np.bool_)))
        r = client.infer("retrospec_draft", inputs)
        return {k: r.as_numpy(k) for k in ("draft_tokens", "draft_parents", "draft_probs", "best_path")}

    try:
        first = call("c1", prompt)
        local.start_request("c1", prompt)
        expected = local.draft([("c1", 16)])[0]
        assert len(first["draft_tokens"]) > 0
        np.testing.assert_array_equal(first["draft_tokens"], expected.tokens)
        np.testing.assert_array_equal(first["draft_parents"], expected.parents)
        np.testing.assert_allclose(first["draft_probs"], expected.probs)
        np.testing.assert_array_equal(first["best_path"], expected.best_path().tokens)
        accepted = first["best_path"][:2]
        second = call("c1", accepted)
        local.extend("c1", accepted)
        np.testing.assert_array_equal(second["draft_tokens"], local.draft([("c1", 16)])[0].tokens)
        assert "c1" in service.active
        call("c1", np.zeros(0, np.int32), end=True)
        assert "c1" not in service.active
        call("idle", prompt)
        time.sleep(2.5)  # longer than draft_idle_timeout_s
        call("other", prompt)
        assert "idle" not in service.active and "other" in service.active
        # bad input: a 400 with the message (pytriton made each a 500 wrapped in two tracebacks)
        bad = [("budget must lie in", lambda: call("c2", prompt, budget=10_000)),
               ("first call", lambda: call("c3", np.zeros(0, np.int32))),
               ("request_id must be UTF-8", lambda: client.infer("retrospec_draft", [
                   tensor(httpclient, "request_id", np.array([b"\xff"], np.object_)),
                   tensor(httpclient, "input_ids", prompt)]))]
        for needle, send in bad:
            with pytest.raises(InferenceServerException, match=needle) as info:
                send()
            assert info.value.status() == "400" and "Traceback" not in str(info.value), str(info.value)
        assert call("c5", prompt)["draft_tokens"].size > 0  # and it drafts on
    finally:
        client.close()


def _bad_cases(server):
    ids = np.asarray(server["prompts"][1], np.int32)
    good = {"input_ids": ids, "max_tokens": np.array([4], np.int32)}
    return [
        ("wrong dtype", {"input_ids": ids.astype(np.float32)}, "input_ids"),
        ("wrong shape", {**good, "max_tokens": np.array([4, 5], np.int32)}, "max_tokens"),
        ("no prompt", {"max_tokens": np.array([4], np.int32)}, "text_input"),
        ("empty prompt", {"text_input": np.array([b""], np.object_)}, "empty"),
        ("negative max_tokens", {**good, "max_tokens": np.array([-2], np.int32)}, "max_tokens"),
        ("huge max_tokens", {**good, "max_tokens": np.array([2**30], np.int32)}, "max_tokens"),
        ("prompt longer than context", {"input_ids": np.full(600, 5, np.int32)}, "context"),
        ("token id out of vocab", {"input_ids": np.array([1, 10**7], np.int32)}, "token ids"),
        ("bad temperature", {**good, "temperature": np.array([-1.0], np.float32)}, "temperature"),
        ("bad top_p", {**good, "top_p": np.array([3.0], np.float32)}, "top_p"),
        ("oversized text", {"text_input": np.array([b"x" * 100_000], np.object_)}, "limit"),
        ("empty cache_salt", {**good, "cache_salt": np.array([b""], np.object_)}, "cache_salt"),
        # bytes that are not UTF-8 are refused, not read with replacement characters (two tenants' salts could
        # then read alike), and a negative TPOT objective is not taken for none
        ("cache_salt not UTF-8", {**good, "cache_salt": np.array([b"\xff\xfe"], np.object_)}, "cache_salt"),
        ("stop not UTF-8", {**good, "stop": np.array([b"\xff"], np.object_)}, "stop"),
        ("negative tpot_ms", {**good, "tpot_ms": np.array([-5.0], np.float32)}, "tpot_ms"),
        ("logprobs beyond 20", {**good, "logprobs": np.array([21], np.int32)}, "logprobs"),
        ("negative logprobs", {**good, "logprobs": np.array([-1], np.int32)}, "logprobs"),
    ]


def test_bad_input_gets_a_clear_error_and_the_server_keeps_serving(server, caplog):
    url = grpc_url(server)
    with caplog.at_level(logging.WARNING, logger="pytriton.proxy.inference"):
        for name, inputs, needle in _bad_cases(server):
            out = stream_generate(url, inputs)
            assert out["error"] is not None, name
            assert needle.lower() in str(out["error"]).lower(), (name, str(out["error"]))
            assert "Traceback" not in str(out["error"]), (name, str(out["error"]))  # the message, not our stack
    # the server's log says each refusal in one line too
    refusals = [r.getMessage() for r in caplog.records if r.name == "pytriton.proxy.inference"]
    assert any("refused a request (bad input): max_tokens" in m for m in refusals), refusals
    assert not any("Traceback" in m for m in refusals), refusals
    client = grpcclient.InferenceServerClient(url)
    with pytest.raises(InferenceServerException, match="unknown_model|not found|unavailable"):
        client.infer("unknown_model", [tensor(grpcclient, "input_ids", np.array([1, 2], np.int32))])
    client.close()
    good = stream_generate(url, {"input_ids": np.asarray(server["prompts"][1], np.int32),
                                 "max_tokens": np.array([MAX_TOKENS], np.int32)})
    assert good["tokens"] == server["reference"][1]
    stack = server["stack"]
    assert wait_until(lambda: stack.engine.free_blocks() == stack.engine.total_blocks())


def test_load_32_concurrent_grpc_streams_are_exact_and_leak_nothing(server):
    stack, prompts, reference = server["stack"], server["prompts"], server["reference"]
    jobs = [i % len(prompts) for i in range(32)]
    results: list = [None] * len(jobs)
    barrier = threading.Barrier(len(jobs))

    def client(i: int) -> None:
        barrier.wait(60)
        try:
            results[i] = stream_generate(grpc_url(server), {"input_ids": np.asarray(prompts[jobs[i]], np.int32),
                                                            "max_tokens": np.array([MAX_TOKENS], np.int32)}, timeout=240)
        except Exception as exc:  # noqa: BLE001 - reported below
            results[i] = {"error": exc, "tokens": None}

    steps_before = len(stack.orchestrator.records)
    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert [r["error"] for r in results] == [None] * len(jobs)
    assert [r["tokens"] for r in results] == [reference[j] for j in jobs]
    assert max(r.batch for r in list(stack.orchestrator.records)[steps_before:]) > 8
    assert wait_until(lambda: stack.engine.free_blocks() == stack.engine.total_blocks())


@pytest.mark.parametrize("script", ["triton_grpc_stream.py", "triton_http_client.py"])
def test_client_examples_run_against_the_server(server, script):
    import subprocess
    import sys
    from pathlib import Path

    port = server["ports"].grpc if "grpc" in script else server["ports"].http
    example = Path(__file__).resolve().parents[1] / "examples" / script
    run = subprocess.run([sys.executable, str(example), "--url", f"127.0.0.1:{port}", "--max-tokens", "8"],
                         capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "[length]" in run.stdout or "[stop]" in run.stdout
    if "http" in script:
        assert "draft tree:" in run.stdout and "best path" in run.stdout and "whole output:" in run.stdout


def test_a_client_that_cancels_its_stream_cancels_the_generation_and_frees_kv(server):
    """pytriton's proxy ignores Triton's cancellation; ours reports it, and the generation stops mid-way."""
    stack = server["stack"]
    ids = np.asarray(server["prompts"][0], np.int32)
    max_tokens = stack.engine.max_context - len(ids)  # far more than it can produce before the cancel lands
    cancelled = {"finish_reason": "cancelled", "frontend": "triton"}
    sample = stack.metrics.registry.get_sample_value
    before = sample("retrospec_requests_total", cancelled) or 0.0
    tokens_before = sample("retrospec_generation_tokens_total") or 0.0
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(grpc_url(server))
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        client.async_stream_infer("retrospec_generate", [
            tensor(grpcclient, "input_ids", ids), tensor(grpcclient, "max_tokens", np.array([max_tokens], np.int32)),
            tensor(grpcclient, "ignore_eos", np.array([True]))])
        streamed = 0
        while streamed < 4:  # a few tokens in: the request is running and holds KV blocks
            result, error = results.get(timeout=120)
            assert error is None, str(error)
            assert result.as_numpy("finish_reason")[0] == b""
            streamed += len(result.as_numpy("output_ids"))
        assert stack.engine.free_blocks() < stack.engine.total_blocks()
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()
    assert wait_until(lambda: (sample("retrospec_requests_total", cancelled) or 0.0) == before + 1, timeout=30)
    assert wait_until(lambda: stack.orchestrator.idle and stack.engine.free_blocks() == stack.engine.total_blocks())
    assert sample("retrospec_generation_tokens_total") - tokens_before < max_tokens / 2  # stopped, not ran out
    # the server keeps serving, exactly
    out = stream_generate(grpc_url(server), {"input_ids": ids, "max_tokens": np.array([MAX_TOKENS], np.int32)})
    assert out["error"] is None and out["tokens"] == server["reference"][0]


def test_a_request_the_engine_refuses_mid_generation_ends_its_stream_with_the_error_and_the_server_serves_on(server):
    stack = server["stack"]
    ids = np.asarray(server["prompts"][2], np.int32)
    outcome: dict = {}
    long = {"input_ids": ids, "max_tokens": np.array([400], np.int32), "ignore_eos": np.array([True])}
    thread = threading.Thread(target=lambda: outcome.update(stream_generate(grpc_url(server), long)))
    thread.start()
    assert wait_until(lambda: stack.orchestrator.running)
    assert forget_running_requests(stack)
    thread.join(120)
    assert "unknown request" in str(outcome["error"]) and len(outcome["tokens"]) < 400
    assert wait_until(lambda: stack.orchestrator.idle and stack.engine.free_blocks() == stack.engine.total_blocks())
    assert stack.runner.alive
    out = stream_generate(grpc_url(server), {"input_ids": ids, "max_tokens": np.array([MAX_TOKENS], np.int32)})
    assert out["error"] is None and out["tokens"] == server["reference"][2]


def test_the_cancellation_proxy_template_agrees_with_the_server_on_its_wire_names():
    from orchestrator.serving import triton_server

    template = triton_server.CANCEL_PROXY_TEMPLATE.read_text()
    assert f'CANCEL_KEY_PARAMETER = "{triton_server.CANCEL_KEY_PARAMETER}"' in template
    assert f'CANCEL_SOCKET_NAME = "{triton_server.CANCEL_SOCKET_NAME}"' in template
