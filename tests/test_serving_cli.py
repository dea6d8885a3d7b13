"""`retrospec serve --triton --http` as a real process: both front ends answer, and SIGTERM shuts down gracefully
(the in-flight request finishes, the process exits 0, tritonserver goes away with it)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest

from orchestrator.serving.triton_server import free_ports
from trt_engines.prepare import default_model_dir, is_complete

pytestmark = pytest.mark.skipif(not is_complete(default_model_dir()), reason="default model not prepared")


def test_serve_both_front_ends_then_graceful_sigterm(tmp_path):
    grpcclient = pytest.importorskip("tritonclient.grpc")
    from tritonclient.utils import np_to_triton_dtype

    http_port, t_http, t_grpc, t_metrics = free_ports(4)
    log = open(tmp_path / "serve.log", "w")
    try:
        server = subprocess.Popen(
            [sys.executable, "-m", "orchestrator.cli", "serve", "--triton", "--http", "--http-port", str(http_port),
             "--triton-http-port", str(t_http), "--triton-grpc-port", str(t_grpc), "--triton-metrics-port",
             str(t_metrics), "--hardware", "nominal", "--no-fit", "--dtype", "float32", "--num-blocks", "96", "--max-context", "512"],
            stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{http_port}"
        deadline = time.monotonic() + 180
        ready = False
        while time.monotonic() < deadline and server.poll() is None and not ready:
            try:
                ready = httpx.get(url + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                time.sleep(0.5)
        assert ready, (tmp_path / "serve.log").read_text()[-3000:]
        assert "ready in" in (tmp_path / "serve.log").read_text()  # start-up says when it is done, and with what

        client = grpcclient.InferenceServerClient(f"127.0.0.1:{t_grpc}")
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not client.is_model_ready("retrospec_generate"):
            time.sleep(0.5)
        prompt = [1, 9690, 198, 2683, 359, 253, 5356, 5646]
        via_http = httpx.post(url + "/v1/completions", timeout=120, json={
            "model": "retrospec", "prompt": prompt, "max_tokens": 8, "temperature": 0}).json()
        inputs = []
        for name, array in (("input_ids", np.array(prompt, np.int32)), ("max_tokens", np.array([8], np.int32))):
            inputs.append(grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype)))
            inputs[-1].set_data_from_numpy(array)
        results = []
        client.start_stream(callback=lambda result, error: results.append((result, error)))
        client.async_stream_infer("retrospec_generate", inputs)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (results and (results[-1][1] or
                                                                results[-1][0].as_numpy("finish_reason")[0])):
            time.sleep(0.1)
        client.stop_stream()
        client.close()
        assert all(error is None for _, error in results)
        via_triton = [t for result, _ in results for t in result.as_numpy("output_ids").tolist()]
        assert via_triton == via_http["choices"][0]["token_ids"]  # one shared orchestrator, same greedy output

        done: dict = {}

        def inflight():
            done["body"] = httpx.post(url + "/v1/completions", timeout=120, json={
                "model": "retrospec", "prompt": prompt, "max_tokens": 40, "temperature": 0,
                "ignore_eos": True}).json()

        thread = threading.Thread(target=inflight)
        thread.start()
        metrics = ""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and "retrospec_running_requests 1.0" not in metrics:
            metrics = httpx.get(url + "/metrics", timeout=10).text
            time.sleep(0.2)
        server.send_signal(signal.SIGTERM)
        thread.join(120)
        assert server.wait(120) == 0
        body = done["body"]
        assert body["choices"][0]["finish_reason"] == "length" and len(body["choices"][0]["token_ids"]) == 40, body
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(30)
        log.close()
    leftover = subprocess.run(["pgrep", "-f", f"--grpc-port={t_grpc}"], capture_output=True, text=True).stdout
    assert not leftover.strip(), "tritonserver outlived the serve process"
    assert json.dumps(body)  # the completed response was well-formed JSON


@pytest.mark.parametrize("argv, message", [
    # range errors name the flag, not the config field behind it (`max_running must be an int >= 1` before)
    (["--micro-batches", "0"], "argument --micro-batches: expected a whole number >= 1, got '0'"),
    (["--row-table-rows", "1"], "argument --row-table-rows: expected 0 (no row table) or a whole number of rows >= 2, "
                                "got '1'"),
    (["--row-table-rows", "many"], "argument --row-table-rows: expected 0 (no row table) or a whole number"),
    (["--micro-batches", "two"], "argument --micro-batches: expected a whole number >= 1, got 'two'"),
    (["--hardware", "H999"], "unknown hardware 'H999': use one of H100-SXM"),
    (["--max-running", "0"], "argument --max-running: expected a whole number >= 1, got '0'"),
    (["--num-blocks", "0"], "argument --num-blocks: expected a whole number >= 1, got '0'"),
    (["--max-context", "1"], "argument --max-context: expected a whole number >= 2, got '1'"),
    (["--max-body-bytes", "512"], "argument --max-body-bytes: expected a whole number >= 1024, got '512'"),
    (["--model-name="], "argument --model-name: expected a name clients send as the OpenAI `model`, got ''"),
    (["--prefill-chunk", "-8"], "prefill_chunk must be 'auto', an int >= 1"),
    (["--prefill-chunk", "whole"], "expected auto, 0 (whole prompts) or prompt tokens per step, got 'whole'"),
    (["--draft-timeout-ms", "-1"], "--draft-timeout-ms: expected milliseconds > 0 (leave it out for no timeout), "
                                   "got '-1'"),
    (["--draft-timeout-ms", "nan"], "--draft-timeout-ms: expected milliseconds > 0"),
    (["--draft-timeout-ms", "soon"], "--draft-timeout-ms: expected milliseconds > 0"),
    # ports are checked before the model loads (uvicorn's bind failed after it, and 99999 raised an OverflowError)
    (["--http-port", "99999"], "argument --http-port: expected a TCP port (1-65535), got '99999'"),
    (["--triton", "--http-port", "8000"], "--http-port and --triton-http-port are both 8000: give each server its own"),
    (["--http-port", "9009", "--host", "nosuchhost.invalid"], "--http-port 9009: cannot listen on nosuchhost.invalid"),
])
def test_serve_refuses_bad_options_before_starting_anything(capsys, argv, message):
    from orchestrator.serving.cli import serve_main

    with pytest.raises(SystemExit) as exit_info:
        serve_main(["--http", *argv])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_the_config_and_the_flags_share_their_floors(capsys):
    # `INT_FLOORS` is the one table of least values: the config refuses just below each, and so does the serve
    # parser's flag for each field that has one
    import argparse

    from orchestrator.serving.cli import _config_args
    from orchestrator.serving.stack import INT_FLOORS, ServingConfig

    parser = argparse.ArgumentParser(exit_on_error=False)
    _config_args(parser)
    flags = {a.dest: a.option_strings[0] for a in parser._actions if a.dest in INT_FLOORS}
    assert set(flags) == {"num_blocks", "max_context", "max_running", "max_body_bytes"}
    for name, least in INT_FLOORS.items():
        assert getattr(ServingConfig(**{name: least}), name) == least
        with pytest.raises(ValueError, match=f"{name} must be an int >= {least}"):
            ServingConfig(**{name: least - 1})
        if name in flags:
            assert getattr(parser.parse_args([flags[name], str(least)]), name) == least
            with pytest.raises(argparse.ArgumentError, match=f"expected a whole number >= {least}"):
                parser.parse_args([flags[name], str(least - 1)])


def test_the_config_refuses_a_row_table_of_one_row():
    from orchestrator.serving.stack import ServingConfig

    assert ServingConfig().row_table_rows == 0 and ServingConfig(row_table_rows=2).row_table_rows == 2
    for bad in (1, -1, True, 2.5):
        with pytest.raises(ValueError, match="row_table_rows must be 0 \\(no row table\\) or an int >= 2"):
            ServingConfig(row_table_rows=bad)


def test_serve_refuses_a_port_in_use_before_loading_the_model(capsys):
    import socket

    from orchestrator.serving.cli import serve_main

    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        with pytest.raises(SystemExit) as exit_info:
            serve_main(["--http", "--http-port", str(port)])
    assert exit_info.value.code == 2
    assert f"--http-port {port}: cannot listen on 127.0.0.1:{port} (Address already in use)" in capsys.readouterr().err


@pytest.mark.parametrize("value, chunk", [(None, "auto"), ("auto", "auto"), ("0", None), ("64", 64)])
def test_serve_prefill_chunk_option(value, chunk):
    import argparse

    from orchestrator.serving.cli import _config, _config_args

    parser = argparse.ArgumentParser()
    _config_args(parser)
    args = parser.parse_args([] if value is None else ["--prefill-chunk", value])
    assert _config(args).prefill_chunk == chunk


@pytest.mark.parametrize("wrong", ["datastore", "model"])
def test_serve_refuses_a_wrong_path_in_one_line_before_loading_the_model(tmp_path, capsys, monkeypatch, wrong):
    # A start-up error a user makes (a datastore or model folder that is not there) is one line that names the path
    # and the fix, and exit status 2: no traceback, and no model loaded (and kernels compiled) first.
    from orchestrator.cli import main
    from trt_engines.torch_engine import TorchEngine

    engines = []
    build_engine = TorchEngine.__init__

    def recording_init(self, *args, **kwargs):
        engines.append(args)
        build_engine(self, *args, **kwargs)

    monkeypatch.setattr(TorchEngine, "__init__", recording_init)
    path = tmp_path / "not_there"
    option = ["--datastore", str(path)] if wrong == "datastore" else ["--model", str(path)]
    code = main(["serve", "--http", "--http-port", str(free_ports(1)[0]), "--hardware", "nominal", "--no-fit",
                 "--dtype", "float32", *option])
    err = capsys.readouterr().err
    assert code == 2 and engines == []
    want = ("no such datastore directory; build one with `build-datastore`" if wrong == "datastore" else
            "not a model folder (no config.json); pass a Hugging Face folder or `default`")
    assert err.startswith(f"retrospec serve: error: {path}") and want in err and "Traceback" not in err


@pytest.mark.parametrize("option, message", [
    (["--max-context", "100000"], "--max-context must lie in [2, 8192] (the model's max_position_embeddings); "
                                   "got 100000"),
    (["--dtype", "float16", "--device", "cpu"], "hardware 'nominal-cpu' has no peak FLOP/s for dtype 'float16'"),
])
def test_serve_refuses_options_the_model_or_hardware_cannot_take_in_one_line(capsys, option, message):
    # known only once the model's config or the hardware profile is read (at start-up), and still a user's error
    from orchestrator.cli import main

    assert main(["serve", "--http", "--http-port", str(free_ports(1)[0]), "--hardware", "nominal", "--no-fit",
                 *option]) == 2
    err = capsys.readouterr().err
    assert err.startswith("retrospec serve: error: ") and message in err and "Traceback" not in err
