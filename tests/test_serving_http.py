"""The OpenAI-compatible HTTP API against a real uvicorn server on 127.0.0.1, the real default model (fp32), a real
datastore and the real drafter. Greedy references come from plain greedy decoding (`spec_loop.generate`)."""

from __future__ import annotations

import asyncio
import json
import sysconfig
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from trt_engines.prepare import default_model_dir, is_complete

pytestmark = pytest.mark.skipif(not is_complete(default_model_dir()), reason="default model not prepared")

PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "import os\nimport sys\n\n\ndef main(argv):\n",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "Hello! How are you today?",
    "for i in range(10):\n    for j in range(10):\n",
]
MAX_TOKENS = 16


def build_test_datastore(out: Path) -> str:
    from tokenizers import Tokenizer

    from datastore import build_from_token_docs

    tokenizer = Tokenizer.from_file(str(default_model_dir() / "tokenizer.json"))
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [(stdlib / name).read_text() for name in ("functools.py", "contextlib.py", "textwrap.py", "fnmatch.py")]
    docs = [np.asarray(e.ids, np.int32) for e in tokenizer.encode_batch(texts)]
    return str(build_from_token_docs(docs, out, vocab_size=tokenizer.get_vocab_size(), tokenizer_id="test"))


def wait_until(condition, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from orchestrator.serving.http_api import serve_http
    from orchestrator.serving.stack import ServingConfig, ServingStack
    from orchestrator.serving.triton_server import free_ports
    from orchestrator.spec_loop import generate

    ds = build_test_datastore(tmp_path_factory.mktemp("ds") / "code")
    config = ServingConfig(dtype="float32", num_blocks=320, max_context=512, datastores=(ds,), hardware="nominal",
                           fit_step_model=False, max_body_bytes=64 * 1024)
    stack = ServingStack.build(config)
    prompts = [stack.encode(p) for p in PROMPTS]
    reference, _ = generate(stack.engine, prompts, max_new_tokens=MAX_TOKENS, id_prefix="ref")  # runner is idle
    port = free_ports(1)[0]
    uv = serve_http(stack, port=port)
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    try:
        assert wait_until(lambda: uv.started, 30), "uvicorn did not start"
        yield {"url": f"http://127.0.0.1:{port}", "stack": stack, "prompts": prompts, "reference": reference}
    finally:
        stack.shutdown(cancel_inflight=True, timeout=30)
        uv.should_exit = True
        thread.join(30)


def completion(prompt, **extra) -> dict:
    return {"model": "retrospec", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}


def test_models_health_completions_chat_and_metrics(server):
    url, stack = server["url"], server["stack"]
    with httpx.Client(base_url=url, timeout=60) as client:
        assert client.get("/health").json() == {"status": "ok"}
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["retrospec"]
        body = client.post("/v1/completions", json=completion(server["prompts"][0])).json()
        choice = body["choices"][0]
        assert choice["token_ids"] == server["reference"][0]
        assert choice["text"] == stack.tokenizer.decode(server["reference"][0])
        assert body["usage"]["completion_tokens"] == len(server["reference"][0])
        assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}  # fp32: no prefix cache by default
        assert body["retrospec"]["steps"] >= 1
        text_body = client.post("/v1/completions", json=completion(PROMPTS[0])).json()  # text prompt, same ids
        assert text_body["choices"][0]["token_ids"] == server["reference"][0]
        chat = client.post("/v1/chat/completions", json={
            "model": "retrospec", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8,
            "temperature": 0}).json()
        rendered = stack.render_chat([{"role": "user", "content": "Say hi."}])
        assert "Say hi." in rendered and rendered != "Say hi."  # the template wrapped the message
        assert chat["object"] == "chat.completion" and chat["choices"][0]["message"]["role"] == "assistant"
        assert chat["usage"]["prompt_tokens"] == len(stack.encode(rendered))
        metrics = client.get("/metrics").text
    assert 'retrospec_requests_total{finish_reason="length",frontend="http"}' in metrics or \
           'retrospec_requests_total{finish_reason="stop",frontend="http"}' in metrics
    for name in ("retrospec_generation_tokens_total", "retrospec_draft_nodes_total", "retrospec_accepted_tokens_total",
                 "retrospec_draft_seconds_count", "retrospec_verify_seconds_count", "retrospec_step_nodes_count",
                 "retrospec_drafter_fallbacks_total", "retrospec_drafted_ahead_request_steps_total"):
        assert name in metrics


BAD = [  # (case, body, status, a phrase of the message, OpenAI's `param`: the request field at fault)
    ("malformed json", b"{not json", 400, "not valid JSON", None),
    ("empty prompt", completion(""), 400, "prompt is empty", "prompt"),
    ("negative max_tokens", completion("hi", max_tokens=-3), 400, "max_tokens", "max_tokens"),
    ("huge max_tokens", completion("hi", max_tokens=10**9), 400, "max_tokens", "max_tokens"),
    ("prompt longer than context", completion([5] * 600), 400, "context", "prompt"),
    ("bad temperature", completion("hi", temperature=-1), 400, "temperature", "temperature"),
    ("bad top_p", completion("hi", top_p=2.0), 400, "top_p", "top_p"),
    ("token id out of vocab", completion([1, 10**7]), 400, "token ids", "prompt"),
    ("unknown model", completion("hi", model="gpt-4"), 404, "does not exist", "model"),
    ("oversized body", completion("x" * 100_000), 413, "limit", None),
    ("unknown field", completion("hi", frobnicate=1), 400, "unknown field", "frobnicate"),
    ("bad cache_salt", completion("hi", cache_salt=5), 400, "cache_salt", "cache_salt"),
    ("chat without messages", {"model": "retrospec", "messages": []}, 400, "messages", "messages"),
    ("chat image part", {"model": "retrospec", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]}, 400, "text part", "messages"),
    ("chat tool role", {"model": "retrospec", "messages": [{"role": "tool", "content": "42"}]}, 400, "role",
     "messages"),
    # log probabilities: a completion's logprobs is a count, a chat's a flag with top_logprobs the count (OpenAI's)
    ("logprobs beyond 20", completion("hi", logprobs=21), 400, "logprobs", "logprobs"),
    ("negative logprobs", completion("hi", logprobs=-1), 400, "logprobs", "logprobs"),
    ("completion logprobs true", completion("hi", logprobs=True), 400, "integer", "logprobs"),
    ("completion logprobs a string", completion("hi", logprobs="2"), 400, "integer", "logprobs"),
    ("completion top_logprobs", completion("hi", top_logprobs=2), 400, "chat completions field", "top_logprobs"),
    ("chat logprobs a count", {"model": "retrospec", "messages": [{"role": "user", "content": "hi"}], "logprobs": 2},
     400, "true or false", "logprobs"),
    ("chat top_logprobs without logprobs", {"model": "retrospec", "messages": [{"role": "user", "content": "hi"}],
                                            "top_logprobs": 2}, 400, "logprobs: true", "top_logprobs"),
    ("chat top_logprobs beyond 20", {"model": "retrospec", "messages": [{"role": "user", "content": "hi"}],
                                     "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs must be", "top_logprobs"),
    ("chat top_logprobs a string", {"model": "retrospec", "messages": [{"role": "user", "content": "hi"}],
                                    "logprobs": True, "top_logprobs": "3"}, 400, "integer", "top_logprobs"),
    # fields OpenAI defines that this server cannot honour: refused, never silently ignored
    ("echo", completion("hi", echo=True), 400, "echo", "echo"),
    ("presence penalty", completion("hi", presence_penalty=0.5), 400, "presence_penalty", "presence_penalty"),
    ("frequency penalty", completion("hi", frequency_penalty=-1), 400, "frequency_penalty", "frequency_penalty"),
    ("stream not a boolean", completion("hi", stream="yes"), 400, "stream", "stream"),
    ("ignore_eos not a boolean", completion("hi", ignore_eos="no"), 400, "ignore_eos", "ignore_eos"),
    ("n of two", completion("hi", n=2), 400, "n=1", "n"),
    # a field of the wrong type is the client's error (a number as `stop` was a 500, an object's keys were stops)
    ("stop a number", completion("hi", stop=5), 400, "stop must be", "stop"),
    ("stop an object", completion("hi", stop={"a": 1}), 400, "stop must be", "stop"),
    # falsy values of the wrong type too (0, false and "" read as "no stop", a false top_k as no top-k)
    ("stop zero", completion("hi", stop=0), 400, "stop must be", "stop"),
    ("stop false", completion("hi", stop=False), 400, "stop must be", "stop"),
    ("stop empty", completion("hi", stop=""), 400, "non-empty", "stop"),
    ("stop empty in a list", completion("hi", stop=["a", ""]), 400, "non-empty", "stop"),
    ("top_k false", completion("hi", top_k=False), 400, "top_k", "top_k"),
    ("top_k a string", completion("hi", top_k=""), 400, "top_k", "top_k"),
    ("seed not an integer", completion("hi", seed="7"), 400, "seed", "seed"),
    ("max_completion_tokens of zero", completion("hi", max_completion_tokens=0), 400, "max_tokens",
     "max_completion_tokens"),
    ("negative tpot_ms", completion("hi", tpot_ms=-5), 400, "tpot", "tpot_ms"),
    ("stream_options without stream", completion("hi", stream_options={"include_usage": True}), 400, "stream: true",
     "stream_options"),
    ("stream_options unknown key", completion("hi", stream=True, stream_options={"include_usag": True}), 400,
     "include_usage", "stream_options"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input_gets_a_clear_4xx_and_the_server_keeps_serving(server, case):
    _, payload, status, needle, param = case
    path = "/v1/chat/completions" if "messages" in (payload if isinstance(payload, dict) else {}) else "/v1/completions"
    with httpx.Client(base_url=server["url"], timeout=60) as client:
        content = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        response = client.post(path, content=content, headers={"content-type": "application/json"})
        assert response.status_code == status
        error = response.json()["error"]
        assert needle.lower() in error["message"].lower() and error["type"]
        assert error["param"] == param
        good = client.post("/v1/completions", json=completion(server["prompts"][1]))
        assert good.status_code == 200 and good.json()["choices"][0]["token_ids"] == server["reference"][1]
    stack = server["stack"]
    assert wait_until(lambda: stack.engine.free_blocks() == stack.engine.total_blocks())


def _stream_chunks(client, path: str, body: dict) -> list[dict]:
    with client.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200
        events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_logprobs_in_openais_shapes_whole_and_streamed(server):
    # A completion's logprobs: N and a chat reply's logprobs + top_logprobs: one entry per generated token, the
    # greedy token the most likely one, tokens whose bytes spell the text, and streamed chunks that add up to the
    # whole response (text offsets continuing across chunks).
    stack = server["stack"]
    with httpx.Client(base_url=server["url"], timeout=120) as client:
        body = completion(server["prompts"][0], logprobs=3)
        whole = client.post("/v1/completions", json=body).json()["choices"][0]
        assert whole["token_ids"] == server["reference"][0]
        lp = whole["logprobs"]
        n = len(whole["token_ids"])
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
        assert "".join(lp["tokens"]) == whole["text"]  # code tokens: whole characters each
        assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(n)]
        for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
            assert len(top) == 3 and top[token] == logprob == max(top.values()) and logprob <= 0
        chunks = _stream_chunks(client, "/v1/completions", body)
        streamed = {key: [v for c in chunks for v in c["choices"][0]["logprobs"][key]] for key in lp}
        assert streamed["tokens"] == lp["tokens"] and streamed["text_offset"] == lp["text_offset"]
        # fp32 (this server's dtype) verifies other trees this time (the drafter learnt from the first): the same
        # up to rounding; bitwise in bf16 with the batch-invariant kernels (`tests/test_engine.py`)
        np.testing.assert_allclose(streamed["token_logprobs"], lp["token_logprobs"], atol=1e-4)
        assert [list(t) for t in streamed["top_logprobs"]] == [list(t) for t in lp["top_logprobs"]]
        np.testing.assert_allclose([list(t.values()) for t in streamed["top_logprobs"]],
                                   [list(t.values()) for t in lp["top_logprobs"]], atol=1e-4)
        assert client.post("/v1/completions", json=completion(server["prompts"][0])).json()["choices"][0][
            "logprobs"] is None  # not asked for

        chat_body = {"model": "retrospec", "messages": [{"role": "user", "content": "Say hello in French."}],
                     "temperature": 0, "max_tokens": 12, "ignore_eos": True, "logprobs": True, "top_logprobs": 2}
        reply = client.post("/v1/chat/completions", json=chat_body).json()["choices"][0]
        content = reply["logprobs"]["content"]
        assert len(content) == len(reply["token_ids"]) == 12
        for entry, token_id in zip(content, reply["token_ids"]):
            assert bytes(entry["bytes"]) == stack.token_bytes(token_id)
            assert entry["token"] == bytes(entry["bytes"]).decode("utf-8", errors="replace")
            assert len(entry["top_logprobs"]) == 2 and entry["top_logprobs"][0]["logprob"] == entry["logprob"]
            assert entry["top_logprobs"][0]["bytes"] == entry["bytes"]
        specials = set(stack.tokenizer.get_added_tokens_decoder())  # left out of the text, as decoding skips them
        spelled = b"".join(bytes(e["bytes"]) for e, t in zip(content, reply["token_ids"]) if t not in specials)
        assert spelled.decode("utf-8", errors="replace") == reply["message"]["content"]
        chat_chunks = _stream_chunks(client, "/v1/chat/completions", chat_body)
        streamed = [e for c in chat_chunks for e in c["choices"][0]["logprobs"]["content"]]
        assert [(e["token"], e["bytes"]) for e in streamed] == [(e["token"], e["bytes"]) for e in content]
        np.testing.assert_allclose([e["logprob"] for e in streamed], [e["logprob"] for e in content], atol=1e-4)
        plain = client.post("/v1/chat/completions", json={**chat_body, "logprobs": False, "top_logprobs": None})
        assert plain.json()["choices"][0]["logprobs"] is None
        only_chosen = client.post("/v1/chat/completions", json={**chat_body, "top_logprobs": None}).json()
        assert [e["top_logprobs"] for e in only_chosen["choices"][0]["logprobs"]["content"]] == [[]] * 12


def test_fields_sent_at_their_defaults_are_served(server):
    # Clients often send every field, unset ones as null or their default; null max_tokens is OpenAI's 16 here.
    assert MAX_TOKENS == 16
    defaults = completion(server["prompts"][0], max_tokens=None, logprobs=None, echo=False, presence_penalty=0,
                          frequency_penalty=0.0, n=1, stream=False, ignore_eos=False, seed=None, top_p=None,
                          stop=None, top_k=None)
    with httpx.Client(base_url=server["url"], timeout=60) as client:
        for body in (defaults, {**defaults, "stop": [], "top_k": 0}):
            response = client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["token_ids"] == server["reference"][0]


def test_chat_reads_text_parts_and_replies_to_eos_without_max_tokens(server):
    def chat(messages, **extra) -> dict:
        with httpx.Client(base_url=server["url"], timeout=120) as client:
            response = client.post("/v1/chat/completions", json={"model": "retrospec", "messages": messages,
                                                                  "temperature": 0, **extra})
        assert response.status_code == 200, response.text
        return response.json()

    parts = chat([{"role": "developer", "content": "Be brief."},
                  {"role": "user", "content": [{"type": "text", "text": "Say"}, {"type": "text", "text": "hi."}]}],
                 max_tokens=8)
    plain = chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say\nhi."}], max_tokens=8)
    assert parts["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    assert parts["choices"][0]["token_ids"] == plain["choices"][0]["token_ids"]
    # No max_tokens: the reply runs to EOS (25 tokens from this model in fp32), not to a completion's 16-token default.
    reply = chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}])
    assert reply["choices"][0]["finish_reason"] == "stop" and reply["usage"]["completion_tokens"] > 16


def test_a_seeded_sampled_completion_returns_the_same_tokens_again(server):
    # Each position is sampled with a uniform of (seed, position): the second and third requests draft from the
    # first one's output (the output history), verify other trees, and still sample the same tokens. Before, the
    # draws followed the tree sizes and a repeated seeded request came back different after a few tokens.
    url, stack = server["url"], server["stack"]
    body = completion(PROMPTS[2], temperature=0.8, top_p=0.95, seed=11, ignore_eos=True)
    with httpx.Client(base_url=url, timeout=60) as client:
        answers = [client.post("/v1/completions", json=body).json() for _ in range(3)]
    tokens = [a["choices"][0]["token_ids"] for a in answers]
    assert len(tokens[0]) == MAX_TOKENS and tokens[1] == tokens[0] and tokens[2] == tokens[0]
    assert all(a["choices"][0]["text"] == stack.tokenizer.decode(tokens[0]) for a in answers)
    assert sum(a["retrospec"]["accepted_tokens"] for a in answers) > 0  # speculation took part


def test_client_disconnect_mid_stream_cancels_and_frees_kv(server):
    stack = server["stack"]
    with httpx.Client(base_url=server["url"], timeout=60) as client:
        with client.stream("POST", "/v1/completions", json=completion(server["prompts"][2], max_tokens=400,
                                                                        ignore_eos=True, stream=True)) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["choices"][0]["token_ids"]
            assert stack.engine.free_blocks() < stack.engine.total_blocks()  # the request holds KV now
        # leaving the block closed the connection mid-stream
    assert wait_until(lambda: stack.orchestrator.idle and stack.engine.free_blocks() == stack.engine.total_blocks())
    metrics = httpx.get(server["url"] + "/metrics").text
    assert 'retrospec_requests_total{finish_reason="cancelled",frontend="http"}' in metrics


def forget_running_requests(stack) -> list[str]:
    """Make the engine forget every running request, on the runner thread between steps, as an engine that lost
    them would: each one's next verify is refused (RequestError)."""
    def forget():
        ids = list(stack.orchestrator.running)
        for request_id in ids:
            stack.engine.release(request_id)
        return ids

    return stack.runner.call(forget)


def test_a_request_the_engine_refuses_mid_generation_is_a_server_error_and_the_server_serves_on(server):
    stack = server["stack"]
    long = completion(server["prompts"][2], max_tokens=400, ignore_eos=True)
    with httpx.Client(base_url=server["url"], timeout=60) as client:
        with client.stream("POST", "/v1/completions", json={**long, "stream": True}) as response:
            lines = (line for line in response.iter_lines() if line.startswith("data: "))
            assert json.loads(next(lines)[6:])["choices"][0]["token_ids"]
            assert forget_running_requests(stack)
            events = [json.loads(line[6:]) for line in lines if line != "data: [DONE]"]
        assert events[-1]["error"]["type"] == "server_error" and "unknown request" in events[-1]["error"]["message"]

        answer: dict = {}
        thread = threading.Thread(target=lambda: answer.update(r=client.post("/v1/completions", json=long)))
        thread.start()
        assert wait_until(lambda: stack.orchestrator.running)
        assert forget_running_requests(stack)
        thread.join(60)
        assert answer["r"].status_code == 500 and answer["r"].json()["error"]["type"] == "server_error"

        good = client.post("/v1/completions", json=completion(server["prompts"][1]))
        assert good.json()["choices"][0]["token_ids"] == server["reference"][1]
    assert stack.runner.alive and stack.orchestrator.engine_refusals == 2
    assert wait_until(lambda: stack.engine.free_blocks() == stack.engine.total_blocks())
    metrics = httpx.get(server["url"] + "/metrics").text
    assert 'retrospec_requests_total{finish_reason="error",frontend="http"} 2.0' in metrics


def _events(client: httpx.Client, body: dict) -> list[dict]:
    with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


def test_a_stream_reports_usage_as_its_stream_options_ask(server):
    # OpenAI's include_usage: every chunk has usage null, and a last chunk without choices carries the usage; a
    # plain stream carries it on its last chunk, beside the choice.
    reference = server["reference"][0]
    body = completion(server["prompts"][0], stream=True)
    with httpx.Client(base_url=server["url"], timeout=60) as client:
        asked = _events(client, body | {"stream_options": {"include_usage": True}})
        plain = _events(client, body)
    *content, totals = asked
    assert all(chunk["usage"] is None and len(chunk["choices"]) == 1 for chunk in content)
    assert [t for chunk in content for t in chunk["choices"][0]["token_ids"]] == reference
    assert totals["choices"] == [] and totals["usage"]["completion_tokens"] == len(reference)
    assert totals["usage"]["prompt_tokens"] == len(server["prompts"][0]) and totals["retrospec"]["steps"] >= 1
    assert [t for chunk in plain for t in chunk["choices"][0]["token_ids"]] == reference
    assert "usage" not in plain[0] and plain[-1]["usage"] == totals["usage"]


async def _stream_one(client: httpx.AsyncClient, prompt: list[int]) -> tuple[list[int], str]:
    tokens: list[int] = []
    finish = None
    async with client.stream("POST", "/v1/completions", json=completion(prompt, stream=True)) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            tokens += chunk["choices"][0]["token_ids"]
            finish = chunk["choices"][0]["finish_reason"] or finish
    return tokens, finish


def test_load_32_concurrent_streams_are_exact_and_leak_nothing(server):
    stack, prompts, reference = server["stack"], server["prompts"], server["reference"]
    jobs = [i % len(prompts) for i in range(32)]

    async def run():
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=server["url"], timeout=120, limits=limits) as client:
            return await asyncio.gather(*(_stream_one(client, prompts[j]) for j in jobs), return_exceptions=True)

    results = asyncio.run(asyncio.wait_for(run(), 240))
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors
    assert [tokens for tokens, _ in results] == [reference[j] for j in jobs]
    assert all(finish in ("stop", "length") for _, finish in results)
    assert max(r.batch for r in stack.orchestrator.records) > 8  # the clients really were batched together
    assert wait_until(lambda: stack.engine.free_blocks() == stack.engine.total_blocks())


def test_graceful_shutdown_finishes_inflight_and_refuses_new(server):
    stack = server["stack"]
    done: dict = {}

    def long_request():
        with httpx.Client(base_url=server["url"], timeout=120) as client:
            done["response"] = client.post("/v1/completions", json=completion(server["prompts"][3], max_tokens=48,
                                                                               ignore_eos=True))

    thread = threading.Thread(target=long_request)
    thread.start()
    assert wait_until(lambda: len(stack.orchestrator.running) == 1, 30)
    stack.shutdown(cancel_inflight=False, timeout=120)  # returns when the in-flight request has finished
    thread.join(60)
    body = done["response"].json()
    assert body["choices"][0]["finish_reason"] == "length" and len(body["choices"][0]["token_ids"]) == 48
    refused = httpx.post(server["url"] + "/v1/completions", json=completion("hi"), timeout=30)
    assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
    assert httpx.get(server["url"] + "/health").status_code == 503
    assert stack.engine.free_blocks() == stack.engine.total_blocks()

