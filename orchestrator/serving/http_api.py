"""OpenAI-compatible HTTP API (FastAPI): `/v1/completions`, `/v1/chat/completions` (server-sent events when
`stream` is true), `/v1/models`, `/health`, `/metrics` (Prometheus text).

Bad input gets a 4xx with OpenAI's error shape, `{"error": {"message", "type", "param", "code"}}` (`param`: the
field at fault), and damages nothing else. `stream_options.include_usage` gives OpenAI's stream shape (`_sse`).
Extensions beyond OpenAI's fields: `top_k`, `ignore_eos`, `tpot_ms` (the request's time-per-output-token objective)
and `cache_salt` (vLLM's: requests share cached prompt prefixes only with the same salt) in requests; `token_ids`
per choice and a `retrospec` object with speculation statistics (steps, accepted draft tokens, tokens per step) in
responses, and `usage.prompt_tokens_details.cached_tokens` as OpenAI reports it. Like OpenAI,
`temperature` defaults to 1.0 (sampling): send `"temperature": 0` for greedy output, and without `max_tokens` (or
with null) a completion stops after 16 tokens and a chat reply runs to EOS, a stop string or the end of the context.

Log probabilities as OpenAI returns them: a completion's `logprobs: N` gives `choices[].logprobs` = {tokens,
token_logprobs, top_logprobs (the N most likely per position), text_offset}; a chat reply's `logprobs: true` (with
`top_logprobs: N`) gives `choices[].logprobs.content` = [{token, logprob, bytes, top_logprobs}]; streamed, each chunk
carries its own tokens'. N is at most 20 (`MAX_LOGPROBS`; OpenAI's completions stop at 5). They are the model's own
(log_softmax of its logits, before temperature, top-k and top-p, as vLLM returns by default), and speculation does
not change them: bitwise where the engine's numerics are batch-invariant (bf16 on the CPU), up to rounding in fp32.

Fields that OpenAI defines but this server cannot honour are refused unless they carry their default (null, false or
0): `echo`, and `presence_penalty` / `frequency_penalty` (a penalty changes the distribution that verification must
reproduce). A client that sends the defaults explicitly is served; one that asks for more gets a 400 naming the field,
never output silently without it.

Example:

    curl -s localhost:8000/v1/completions -H 'content-type: application/json' \
        -d '{"model": "retrospec", "prompt": "def add(a, b):", "max_tokens": 16, "temperature": 0}'
"""

from __future__ import annotations

import itertools
import json
import time
import uuid
from contextlib import aclosing
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from orchestrator.request import FinishReason, GenerationRequest, RequestOutput, TokenLogprob, merged_output
from orchestrator.serving.stack import ServingStack
from trt_engines.base import MAX_LOGPROBS, InvalidField

_FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.CANCELLED: "abort"}
_FIELDS = {"model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
           "seed", "stop", "stream", "stream_options", "ignore_eos", "tpot_ms", "cache_salt", "n", "user", "logprobs",
           "top_logprobs", "echo", "presence_penalty", "frequency_penalty"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.kind, "param": self.param,
                                       "code": self.code}}, status_code=self.status)


def create_app(stack: ServingStack) -> FastAPI:
    app = FastAPI(title="retrospec", docs_url=None, redoc_url=None)
    limit = stack.config.max_body_bytes
    name = stack.config.model_name

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        stack.metrics.rejected.labels(frontend="http").inc()
        return exc.response()

    @app.middleware("http")
    async def _body_limit(request: Request, call_next):
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            stack.metrics.rejected.labels(frontend="http").inc()
            return ApiError(413, f"the request body has {length} bytes; the limit is {limit} "
                                 "(ServingConfig.max_body_bytes / --max-body-bytes)").response()
        return await call_next(request)

    @app.get("/health")
    async def health() -> Response:
        if not stack.runner.alive:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(stack.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "retrospec"}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await _read_json(request, limit)
        _check_model(body, name)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            gen = _build(stack, body, chat=False, text=prompt)
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            gen = _build(stack, body, chat=False, prompt_ids=prompt)
        else:
            raise ApiError(400, "prompt must be a string or a list of token ids (one prompt per request)", param="prompt")
        return await _respond(stack, body, gen, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await _read_json(request, limit)
        _check_model(body, name)
        try:
            text = stack.render_chat(body.get("messages"))
        except ValueError as exc:
            raise ApiError(400, str(exc), param="messages") from None
        return await _respond(stack, body, _build(stack, body, chat=True, text=text), chat=True)

    return app


async def _read_json(request: Request, limit: int) -> dict:
    body = b""
    async for chunk in request.stream():  # counts bytes as they come: chunked bodies have no content-length
        body += chunk
        if len(body) > limit:
            raise ApiError(413, f"the request body exceeds the limit of {limit} bytes "
                                "(ServingConfig.max_body_bytes / --max-body-bytes)")
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the body is not valid JSON ({exc}); send a JSON object") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object")
    unknown = sorted(set(data) - _FIELDS)
    if unknown:
        raise ApiError(400, f"unknown field(s) {unknown}; supported: {sorted(_FIELDS)}", param=unknown[0])
    return data


def _check_model(body: dict, name: str) -> None:
    model = body.get("model")
    if model is None:
        raise ApiError(400, f"the field `model` is required; this server serves {name!r}", param="model")
    if model != name:
        raise ApiError(404, f"the model {model!r} does not exist; this server serves {name!r} (see /v1/models)",
                       param="model", code="model_not_found")


# OpenAI fields this server accepts only at their default (null or false, and 0 where `zero_is_default`):
# (field, zero_is_default, why it cannot be honoured, what to send instead)
_PENALTY = "penalties are not supported: they change the distribution that lossless verification reproduces"
_DEFAULT_ONLY = (
    ("echo", False, "the prompt is not echoed", "leave it out, or send false; the prompt's text is the caller's"),
    ("presence_penalty", True, _PENALTY, "leave it out, or send 0"),
    ("frequency_penalty", True, _PENALTY, "leave it out, or send 0"),
)
_FLAGS = ("stream", "ignore_eos", "echo")  # JSON booleans: a string such as "no" must not read as true


def _check_fields(body: dict) -> None:
    """Refuse, naming the field, what this server would otherwise have to ignore or guess."""
    for name in _FLAGS:
        value = body.get(name)
        if value is not None and not isinstance(value, bool):
            raise ApiError(400, f"{name} must be true or false; got {value!r}", param=name)
    for name, zero_is_default, why, fix in _DEFAULT_ONLY:
        value = body.get(name)
        zero = zero_is_default and type(value) in (int, float) and value == 0
        if not (value is None or value is False or zero):
            raise ApiError(400, f"{name}={value!r} cannot be honoured: {why}; {fix}", param=name)
    if body.get("n", 1) not in (1, None) or isinstance(body.get("n"), bool):
        raise ApiError(400, "only n=1 is supported", param="n")
    _include_usage(body)


def _include_usage(body: dict) -> bool:
    """`stream_options.include_usage`: OpenAI's only stream option, allowed (as OpenAI and vLLM have it) only with
    `stream: true`."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not body.get("stream"):
        raise ApiError(400, "stream_options is only allowed with stream: true", param="stream_options")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise ApiError(400, f"stream_options must be an object with the one key include_usage; got {options!r}",
                       param="stream_options")
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise ApiError(400, f"stream_options.include_usage must be true or false; got {include!r}",
                       param="stream_options")
    return include


# `InvalidField.field` (what the stack's request building calls a field) -> the request field a client sent
_PARAMS = {"prompt_ids": "prompt", "tpot_s": "tpot_ms", "stop_strings": "stop"}


def _param(field: str, body: dict, *, chat: bool) -> str:
    if field in ("prompt", "prompt_ids"):
        return "messages" if chat else "prompt"
    if field == "max_tokens" and body.get("max_completion_tokens") is not None:
        return "max_completion_tokens"
    return _PARAMS.get(field, field)


def _max_tokens(body: dict, *, chat: bool) -> int | None:
    """`max_completion_tokens`, else `max_tokens` (null counts as absent); neither: 16 for a completion (OpenAI's
    default), None for a chat reply (as many as the context holds)."""
    for name in ("max_completion_tokens", "max_tokens"):
        if body.get(name) is not None:
            return body[name]
    return None if chat else 16


def _logprobs(body: dict, *, chat: bool) -> int | None:
    """How many of the most likely tokens to return per position (None: no log probabilities): a completion's
    `logprobs: N`; a chat reply's `logprobs: true` with `top_logprobs: N` (0 when left out), as OpenAI has them."""
    logprobs, top = body.get("logprobs"), body.get("top_logprobs")
    if not chat:
        if top is not None:
            raise ApiError(400, "top_logprobs is a chat completions field; a completion takes logprobs: N (the most "
                                "likely tokens per position)", param="top_logprobs")
        if isinstance(logprobs, bool):
            raise ApiError(400, f"logprobs must be an integer (the most likely tokens per position) for a "
                                f"completion; got {logprobs!r}", param="logprobs")
        return logprobs
    if logprobs is not None and not isinstance(logprobs, bool):
        raise ApiError(400, f"logprobs must be true or false for a chat completion (top_logprobs: N sets how many "
                            f"of the most likely tokens); got {logprobs!r}", param="logprobs")
    if top is not None and not logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    if not logprobs:
        return None
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_LOGPROBS):
        raise ApiError(400, f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}] (the most likely tokens per "
                            f"position); got {top!r}", param="top_logprobs")
    return 0 if top is None else top


def _build(stack: ServingStack, body: dict, *, chat: bool, **prompt) -> GenerationRequest:
    _check_fields(body)
    logprobs = _logprobs(body, chat=chat)
    tpot_ms = body.get("tpot_ms")
    if tpot_ms is not None and (isinstance(tpot_ms, bool) or not isinstance(tpot_ms, (int, float)) or
                                not tpot_ms > 0):
        raise ApiError(400, f"tpot_ms must be a positive number of milliseconds; got {tpot_ms!r}", param="tpot_ms")
    # null alone is "none": a falsy value of the wrong type (0, false, "") is refused as its truthy kin are
    stop = body.get("stop")
    try:
        return stack.make_request(
            **prompt,
            max_tokens=_max_tokens(body, chat=chat),
            temperature=body.get("temperature", 1.0) if body.get("temperature") is not None else 1.0,
            top_p=body.get("top_p", 1.0) if body.get("top_p") is not None else 1.0,
            top_k=body.get("top_k") if body.get("top_k") is not None else 0,
            seed=body.get("seed"),
            stop=() if stop is None else stop,
            tpot_s=None if tpot_ms is None else tpot_ms / 1e3,
            ignore_eos=bool(body.get("ignore_eos")),
            cache_salt=body.get("cache_salt"),
            logprobs=logprobs,
        )
    except ValueError as exc:
        field = exc.field if isinstance(exc, InvalidField) else None
        raise ApiError(400, str(exc), param=field and _param(field, body, chat=chat)) from None


async def _respond(stack: ServingStack, body: dict, gen: GenerationRequest, *, chat: bool) -> Response:
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    created = int(time.time())
    model = stack.config.model_name
    if not stack.runner.alive:
        raise ApiError(503, "the server is shutting down", kind="server_error")
    outputs = stack.stream(gen, frontend="http")
    try:
        first = await outputs.__anext__()  # submit errors (validation, shutdown) surface here, before any byte is sent
    except ValueError as exc:
        raise ApiError(400, str(exc)) from None
    except RuntimeError as exc:
        raise ApiError(503, str(exc), kind="server_error") from None

    async def all_outputs() -> AsyncIterator[RequestOutput]:
        async with aclosing(outputs):  # an early exit (client gone) closes the stream, which cancels the request
            yield first
            async for out in outputs:
                yield out

    if body.get("stream"):
        return StreamingResponse(_sse_closing(all_outputs(), stack, rid, created, model, gen, chat=chat,
                                              include_usage=_include_usage(body)),
                                 media_type="text/event-stream")
    async with aclosing(all_outputs()) as stream:
        final = merged_output([out async for out in stream])
    tokens, logprobs, text = final.token_ids, final.logprobs or [], final.text
    if final.finish_reason == FinishReason.ERROR:
        raise ApiError(500 if final.server_error else 400, final.error or "the request failed",
                       kind=_error_kind(final))
    choice = {"index": 0, "finish_reason": _FINISH.get(final.finish_reason, "stop"), "token_ids": tokens}
    wire_logprobs = _wire_logprobs(stack, gen, logprobs, chat=chat)
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
        choice["logprobs"] = wire_logprobs
    else:
        choice.update(text=text, logprobs=wire_logprobs)
    return JSONResponse({
        "id": rid, "object": "chat.completion" if chat else "text_completion", "created": created, "model": model,
        "choices": [choice], "usage": _usage(gen, len(tokens), final), "retrospec": _stats(final),
    })


def _wire_logprobs(stack: ServingStack, gen: GenerationRequest, entries: list[TokenLogprob], *, chat: bool,
                   text_offset: int = 0) -> dict | None:
    """OpenAI's `logprobs` object of a choice (or of one streamed chunk) for these tokens' entries; None where the
    request did not ask for log probabilities. A token's text is its bytes decoded (a part of a UTF-8 character
    reads as U+FFFD; `bytes` has the bytes themselves); a completion's `text_offset` counts characters of those
    texts from `text_offset` on."""
    if gen.sampling.logprobs is None:
        return None

    def token(token_id: int) -> tuple[str, bytes]:
        raw = stack.token_bytes(token_id)
        return raw.decode("utf-8", errors="replace"), raw

    if chat:
        def item(token_id: int, logprob: float) -> dict:
            text, raw = token(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(raw)}

        return {"content": [item(e.token_id, e.logprob) | {"top_logprobs": [item(i, lp) for i, lp in e.top]}
                            for e in entries], "refusal": None}
    texts = [token(e.token_id)[0] for e in entries]
    offsets = list(itertools.accumulate((len(t) for t in texts[:-1]), initial=text_offset))[: len(texts)]
    return {"tokens": texts, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{token(i)[0]: lp for i, lp in e.top} for e in entries], "text_offset": offsets}


def _error_kind(out: RequestOutput) -> str:
    """OpenAI's error type for a failed request: the server's fault (the engine refused it mid-generation) or the
    request's (e.g. more KV blocks than the engine has)."""
    return "server_error" if out.server_error else "invalid_request_error"


async def _sse(outputs: AsyncIterator[RequestOutput], stack: ServingStack, rid: str, created: int, model: str,
               gen: GenerationRequest, *, chat: bool, include_usage: bool) -> AsyncIterator[bytes]:
    """The stream's events. With `include_usage`, OpenAI's shape: every chunk has `usage: null`, and one more chunk
    with no choices carries the usage (and the `retrospec` statistics) before `[DONE]`; without it, the last chunk
    carries them beside its choice."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    count = 0
    offset = 0  # characters of the token texts streamed so far (a completion's `text_offset`)
    first = True
    async for out in outputs:  # a client disconnect cancels this generator, and the stream cancels the request
        count += len(out.token_ids)
        if out.finish_reason == FinishReason.ERROR:
            error = {"error": {"message": out.error or "the request failed", "type": _error_kind(out),
                               "param": None, "code": None}}
            yield f"data: {json.dumps(error)}\n\n".encode()
            break
        choice: dict = {"index": 0, "token_ids": out.token_ids,
                        "finish_reason": _FINISH.get(out.finish_reason) if out.finished else None}
        wire_logprobs = _wire_logprobs(stack, gen, out.logprobs or [], chat=chat, text_offset=offset)
        if chat:
            choice["delta"] = ({"role": "assistant"} if first else {}) | {"content": out.text}
            choice["logprobs"] = wire_logprobs
        else:
            choice.update(text=out.text, logprobs=wire_logprobs)
            if wire_logprobs is not None:
                offset += sum(len(t) for t in wire_logprobs["tokens"])
        chunk = {"id": rid, "object": kind, "created": created, "model": model, "choices": [choice]}
        totals = {"usage": _usage(gen, count, out), "retrospec": _stats(out)} if out.finished else None
        if include_usage:
            chunk["usage"] = None
        elif totals:
            chunk |= totals
        first = False
        yield f"data: {json.dumps(chunk)}\n\n".encode()
        if include_usage and totals:
            usage_chunk = {"id": rid, "object": kind, "created": created, "model": model, "choices": []} | totals
            yield f"data: {json.dumps(usage_chunk)}\n\n".encode()
    yield b"data: [DONE]\n\n"


async def _sse_closing(outputs: AsyncIterator[RequestOutput], *args, **kwargs) -> AsyncIterator[bytes]:
    async with aclosing(outputs), aclosing(_sse(outputs, *args, **kwargs)) as events:
        async for event in events:
            yield event


def _usage(gen: GenerationRequest, completion_tokens: int, final: RequestOutput) -> dict:
    cached = final.stats.cached_prompt_tokens if final.stats is not None else 0
    return {"prompt_tokens": len(gen.prompt_ids), "completion_tokens": completion_tokens,
            "total_tokens": len(gen.prompt_ids) + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _stats(out: RequestOutput) -> dict:
    s = out.stats
    if s is None:
        return {}
    return {"steps": s.steps, "accepted_tokens": s.accepted, "drafted_tokens": s.drafted,
            "tokens_per_step": s.tokens_per_step, "drafter_fallbacks": s.fallbacks}


def serve_http(stack: ServingStack, *, host: str = "127.0.0.1", port: int = 8000, log_level: str = "warning"):
    """Build a uvicorn server for the app (call `.run()` to block, or run it in a thread and set `should_exit`)."""
    import contextlib

    import uvicorn

    class _Server(uvicorn.Server):
        # uvicorn re-raises SIGINT/SIGTERM after its own shutdown, which would kill the process before the caller
        # finishes in-flight Triton requests and stops tritonserver; the caller owns the signals instead.
        def capture_signals(self):
            return contextlib.nullcontext()

    return _Server(uvicorn.Config(create_app(stack), host=host, port=port, log_level=log_level,
                                  timeout_graceful_shutdown=30))
