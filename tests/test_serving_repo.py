"""`retrospec export-triton-repo`: the files render, the model.py files compile, and the configuration round-trips."""

from __future__ import annotations

import json
import os
import py_compile
import re

import pytest

from datastore import build_from_token_docs
from orchestrator.cli import main as cli_main
from orchestrator.serving.stack import ServingConfig
from orchestrator.serving.triton_repo import DRAFT_INPUTS, DRAFT_OUTPUTS, GENERATE_INPUTS, GENERATE_OUTPUTS
from trt_engines.prepare import default_model_dir, is_complete


def _parameters(pbtxt: str) -> dict[str, str]:
    return {k: json.loads(v) for k, v in re.findall(r'parameters \{ key: "(\w+)" value: \{ string_value: (".*") \} \}',
                                                    pbtxt)}


needs_model = pytest.mark.skipif(not is_complete(default_model_dir()), reason="default model not prepared")


@needs_model
def test_export_writes_a_complete_repository_that_compiles(tmp_path, capsys, monkeypatch):
    # the datastore and the model folder are given relative to this directory: tritonserver may start in another
    # one, so the repository must hold their absolute paths
    build_from_token_docs([[1, 2, 3, 4], [2, 3, 5]], tmp_path / "ds", vocab_size=8)
    monkeypatch.chdir(tmp_path)
    model = os.path.relpath(default_model_dir(), tmp_path)
    assert cli_main(["export-triton-repo", str(tmp_path / "repo"), "--policy", "fixed:8", "--num-blocks", "64",
                     "--hardware", "nominal", "--no-fit", "--datastore", "ds", "--model", model]) == 0
    printed = capsys.readouterr().out.split()
    repo = tmp_path / "repo"
    for name, inputs, outputs, decoupled in (("retrospec_generate", GENERATE_INPUTS, GENERATE_OUTPUTS, True),
                                             ("retrospec_draft", DRAFT_INPUTS, DRAFT_OUTPUTS, False)):
        config = (repo / name / "config.pbtxt").read_text()
        assert f'name: "{name}"' in config and 'backend: "python"' in config
        assert ("decoupled: true" in config) == decoupled
        for tensor in [i[0] for i in inputs] + [o[0] for o in outputs]:
            assert f'name: "{tensor}"' in config
        assert config.count("{") == config.count("}")
        params = _parameters(config)
        serving = ServingConfig(**json.loads(params["serving_config"]))
        want = ("fixed:8", 64, (str((tmp_path / "ds").resolve()),), str(default_model_dir().resolve()))
        assert (serving.policy, serving.num_blocks, tuple(serving.datastores), serving.model) == want
        assert any((p.rstrip("/") + "/orchestrator").endswith("orchestrator") for p in json.loads(params["python_path"]))
        model = repo / name / "1" / "model.py"
        py_compile.compile(str(model), doraise=True)
        assert str(model) in printed and "class TritonPythonModel" in model.read_text()


def test_export_rejects_a_bad_policy_with_a_clear_message(tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli_main(["export-triton-repo", str(tmp_path / "repo"), "--policy", "fast"])
    assert "unknown budget policy" in capsys.readouterr().err
    assert not (tmp_path / "repo").exists()


@pytest.mark.parametrize("wrong", ["datastore", "model"])
def test_export_refuses_a_path_that_is_not_there_and_writes_nothing(tmp_path, capsys, wrong):
    # the server would load the repository and fail there, far from the typo: the export names the path instead
    path = tmp_path / "not_there"
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["export-triton-repo", str(tmp_path / "repo"), "--hardware", "nominal",
                  "--datastore" if wrong == "datastore" else "--model", str(path)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and f"{path}: no" in err and "Traceback" not in err
    assert not (tmp_path / "repo").exists()


@needs_model
def test_exported_repository_serves_in_the_bundled_stock_tritonserver(tmp_path):
    """The exported model.py files load in a plain tritonserver (not pytriton) and answer both models."""
    import queue
    import subprocess
    import time

    import numpy as np

    grpcclient = pytest.importorskip("tritonclient.grpc")
    from tritonclient.utils import np_to_triton_dtype

    from orchestrator.serving.triton_repo import bundled_tritonserver, export_repository
    from orchestrator.serving.triton_server import free_ports
    from orchestrator.spec_loop import generate
    from trt_engines.torch_engine import TorchEngine

    config = ServingConfig(dtype="float32", num_blocks=64, max_context=256, datastores=(), hardware="nominal", fit_step_model=False,
                           max_running=4, torch_threads=1)
    export_repository(tmp_path / "repo", config)
    http, grpc, metrics = free_ports(3)
    argv, env = bundled_tritonserver(tmp_path / "work", tmp_path / "repo", http_port=http, grpc_port=grpc,
                                     metrics_port=metrics)
    log = open(tmp_path / "tritonserver.log", "w")
    server = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc}")
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and server.poll() is None:
            try:
                if client.is_model_ready("retrospec_generate") and client.is_model_ready("retrospec_draft"):
                    break
            except Exception:  # noqa: BLE001 - not up yet
                pass
            time.sleep(0.5)
        assert server.poll() is None and client.is_model_ready("retrospec_generate"), \
            (tmp_path / "tritonserver.log").read_text()[-3000:]

        def log_text() -> str:
            log.flush()
            return (tmp_path / "tritonserver.log").read_text()

        def tensor(name, array):
            t = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
            t.set_data_from_numpy(array)
            return t

        prompt = [1, 9690, 198, 2683, 359, 253, 5356, 5646]
        engine = TorchEngine("default", dtype=__import__("torch").float32, num_blocks=16, max_context=256)
        reference = generate(engine, [prompt], max_new_tokens=8)[0][0]
        results: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        client.async_stream_infer("retrospec_generate", [tensor("input_ids", np.array(prompt, np.int32)),
                                                         tensor("max_tokens", np.array([8], np.int32))])
        tokens, finish = [], ""
        while not finish:
            result, error = results.get(timeout=120)
            assert error is None, str(error)
            tokens += result.as_numpy("output_ids").tolist()
            finish = result.as_numpy("finish_reason")[0].decode()
        client.async_stream_infer("retrospec_generate", [tensor("input_ids", np.array(prompt, np.int32)),
                                                         tensor("max_tokens", np.array([8], np.int32)),
                                                         tensor("logprobs", np.array([2], np.int32))])
        top_ids, chosen, finish = [], [], ""
        while not finish:  # the same outputs as pytriton's server sends (`triton_server.generate_outputs`)
            result, error = results.get(timeout=120)
            assert error is None, str(error)
            top_ids += result.as_numpy("top_logprob_ids").tolist()
            chosen += result.as_numpy("output_log_probs").tolist()
            finish = result.as_numpy("finish_reason")[0].decode()
        assert [row[0] for row in top_ids] == reference and all(len(row) == 2 for row in top_ids)
        assert len(chosen) == 8 and max(chosen) <= 0
        client.async_stream_infer("retrospec_generate", [tensor("input_ids", np.array(prompt, np.int32)),
                                                         tensor("max_tokens", np.array([8], np.int32)),
                                                         tensor("stream", np.array([False]))])
        result, error = results.get(timeout=120)  # stream=false: the whole output in one response, then no more
        assert error is None and result.as_numpy("output_ids").tolist() == reference
        assert result.as_numpy("finish_reason")[0] in (b"stop", b"length")
        client.async_stream_infer("retrospec_generate", [tensor("input_ids", np.array([], np.int32).reshape(0))])
        _, error = results.get(timeout=60)
        assert error is not None and "empty" in str(error)
        client.stop_stream()
        assert tokens == reference

        # A client that cancels its stream mid-generation: the model cancels the request, which frees its KV blocks
        # (the log line is written from the request's final "cancelled" update, after the engine released it).
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        client.async_stream_infer("retrospec_generate", [tensor("input_ids", np.array(prompt, np.int32)),
                                                         tensor("max_tokens", np.array([200], np.int32)),
                                                         tensor("ignore_eos", np.array([True]))])
        result, error = results.get(timeout=120)
        assert error is None and result.as_numpy("finish_reason")[0] == b""  # streaming, not finished
        client.stop_stream(cancel_requests=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and "cancelled by the client, KV blocks freed" not in log_text():
            time.sleep(0.2)
        assert "cancelled by the client, KV blocks freed" in log_text(), log_text()[-3000:]
        draft = client.infer("retrospec_draft", [tensor("request_id", np.array([b"r"], np.object_)),
                                                 tensor("input_ids", np.array(prompt * 3, np.int32)),
                                                 tensor("budget", np.array([8], np.int32))])
        assert len(draft.as_numpy("draft_tokens")) == len(draft.as_numpy("draft_parents"))
        from tritonclient.utils import InferenceServerException  # the same input checks as `retrospec serve --triton`

        with pytest.raises(InferenceServerException, match="request_id must be UTF-8") as refused:
            client.infer("retrospec_draft", [tensor("request_id", np.array([b"\xff"], np.object_)),
                                             tensor("input_ids", np.array(prompt, np.int32))])
        assert refused.value.status() == "StatusCode.INVALID_ARGUMENT"  # bad input, as over pytriton (HTTP 400)
        client.close()
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
