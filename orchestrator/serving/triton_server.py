"""Triton Inference Server front end through `nvidia-pytriton` (which bundles tritonserver and its Python backend).

Models:

`retrospec_generate` (decoupled: one response per streamed update, or with stream=false one for the whole output)
    inputs   text_input BYTES[1] | input_ids INT32[-1] (one of them), max_tokens INT32[1], temperature FP32[1],
             top_p FP32[1], top_k INT32[1], seed INT64[1], stop BYTES[-1], tpot_ms FP32[1], ignore_eos BOOL[1],
             cache_salt BYTES[1] (prefix-cache namespace), logprobs INT32[1] (k in 0..20: return log probabilities),
             stream BOOL[1] (false: one response when the request finishes, which Triton's HTTP `generate`
             endpoint needs: it refuses a model's second response)
             (all optional but the prompt; defaults: 16 tokens, greedy, no log probabilities, streamed)
    outputs  output_ids INT32[-1] and text_output BYTES[1] (the delta), finish_reason BYTES[1] ("" until the last
             response: stop | length | cancelled), steps INT32[1], accepted_tokens INT32[1], tokens_per_step FP32[1]
             (request statistics so far; final on the last response); with `logprobs`, per token of output_ids:
             output_log_probs FP32[-1] (its log probability under the model) and, for k >= 1, top_logprob_ids
             INT32[-1, k], top_logprobs FP32[-1, k] (the k most likely tokens there, most likely first)

`retrospec_draft` (one response per call)
    inputs   request_id BYTES[1], input_ids INT32[-1] (the prompt on the first call, newly accepted tokens after),
             budget INT32[1] (draft nodes, default 16), end BOOL[1] (release the request's state)
    outputs  draft_tokens INT32[-1], draft_parents INT32[-1] (-1 = child of the last context token),
             draft_probs FP32[-1] (calibrated path-acceptance probabilities), best_path INT32[-1] (token ids of the
             linear draft with the most expected accepted tokens, for engines that verify chains)

Triton loads its Python backend stub through libpython, so `LD_LIBRARY_PATH` must include Python's LIBDIR before
tritonserver starts (otherwise model loading fails with an `_thread.RLock` error): `start_triton` adds it to this
process's environment, which the tritonserver subprocess inherits.

Cancellation: pytriton's proxy model (the Python-backend model inside tritonserver that forwards requests here)
ignores Triton's request cancellation, so `start_triton` puts `templates/pytriton_cancel_model.py` in front of it for
the generate model. That model tags each request with a key and reports the keys of cancelled requests (a client
that cancels its gRPC stream or disconnects) to a `CancellationListener` on a unix datagram socket in pytriton's
workspace; `GenerateModel.cancel` then cancels the generation, which frees its KV blocks. The same file stands in
front of `retrospec_draft`, so that its bad input is a 400 with the message rather than pytriton's 500 (the
template's docstring).
"""

from __future__ import annotations

import logging
import os
import socket
import sysconfig
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from orchestrator.request import FinishReason, RequestOutput, merged_output
from orchestrator.serving.draft_service import DraftService
from orchestrator.serving.stack import ServingStack, make_drafter
from orchestrator.serving.triton_repo import DRAFT_INPUTS, DRAFT_OUTPUTS, GENERATE_INPUTS, GENERATE_OUTPUTS

GENERATE_MODEL = "retrospec_generate"
DRAFT_MODEL = "retrospec_draft"
# shared with templates/pytriton_cancel_model.py, which runs inside tritonserver and cannot import this module
CANCEL_KEY_PARAMETER = "retrospec_cancel_key"
CANCEL_SOCKET_NAME = "retrospec-cancel.sock"
CANCEL_PROXY_TEMPLATE = Path(__file__).parent / "templates" / "pytriton_cancel_model.py"
_LOG = logging.getLogger(__name__)


@dataclass(frozen=True)
class TritonPorts:
    http: int = 8000
    grpc: int = 8001
    metrics: int = 8002

    @classmethod
    def free(cls) -> "TritonPorts":
        return cls(*free_ports(3))


def free_ports(n: int) -> list[int]:
    """n distinct free TCP ports on 127.0.0.1 (held open together so they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def ensure_libpython_on_ld_path() -> str:
    """Add Python's LIBDIR to LD_LIBRARY_PATH (for child processes: the tritonserver and its backend stubs)."""
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    parts = [p for p in os.environ.get("LD_LIBRARY_PATH", "").split(":") if p]
    if libdir and libdir not in parts:
        os.environ["LD_LIBRARY_PATH"] = ":".join([libdir, *parts])
    return os.environ.get("LD_LIBRARY_PATH", "")


class GenerateModel:
    """The `retrospec_generate` inference callable (an async generator: pytriton runs many concurrently)."""

    def __init__(self, stack: ServingStack, *, remember_cancelled_s: float = 60.0) -> None:
        self.stack = stack
        self.remember_cancelled_s = remember_cancelled_s
        self._cancelled: dict[str, float] = {}  # keys tritonserver reported cancelled -> when (monotonic)
        self._lock = threading.Lock()

    def cancel(self, key: str) -> None:
        """The client of the request tagged `key` cancelled it (called from the `CancellationListener` thread)."""
        now = time.monotonic()
        with self._lock:
            self._cancelled = {k: t for k, t in self._cancelled.items() if now - t < self.remember_cancelled_s}
            self._cancelled[key] = now
        # Stops a running or waiting request now; a report that beats the request's submission is caught by the
        # stream loop below, which leaves (and so cancels) at the request's first output.
        self.stack.runner.cancel(_request_id(key))

    def was_cancelled(self, key: str | None) -> bool:
        with self._lock:
            return key is not None and key in self._cancelled

    async def __call__(self, requests):
        if len(requests) != 1:  # the model is not batched, so Triton hands over one request per call
            raise ValueError(f"{GENERATE_MODEL} takes one request per call; got {len(requests)}")
        try:
            request = self.stack_request(requests[0])
            streamed = wants_stream(requests[0])
        except ValueError as exc:
            self.stack.metrics.rejected.labels(frontend="triton").inc()
            # as a plain ValueError, which the client and the log get as its message alone (_BadInputInOneLine; the
            # cancellation proxy's `client_message`)
            raise ValueError(str(exc)) from None
        key = (requests[0].parameters or {}).get(CANCEL_KEY_PARAMETER)
        if self.was_cancelled(key):
            return
        updates = []  # not streamed: every update, sent as one response when the request finishes
        async for out in self.stack.stream(request, frontend="triton",
                                           request_id=None if key is None else _request_id(key)):
            if self.was_cancelled(key):
                return  # the client is gone: leaving the stream cancels the request (if it is still running)
            if out.finish_reason == FinishReason.ERROR:
                raise ValueError(out.error or "the request failed")
            if streamed:
                yield [generate_outputs(out, logprobs=request.sampling.logprobs)]
            else:
                updates.append(out)
        if updates:
            yield [generate_outputs(merged_output(updates), logprobs=request.sampling.logprobs)]

    def stack_request(self, req):
        limit = self.stack.config.max_body_bytes
        text = _scalar(req, "text_input")
        ids = req.data.get("input_ids")
        if (text is None) == (ids is None):
            raise ValueError("send exactly one of text_input (BYTES[1]) or input_ids (INT32[-1])")
        if text is not None:
            if len(text) > limit:
                raise ValueError(f"text_input has {len(text)} bytes; the limit is {limit} (--max-body-bytes)")
            text = _utf8(text, "text_input")
        elif ids.ndim != 1:
            raise ValueError(f"input_ids must be 1-D INT32[-1]; got shape {list(ids.shape)}")
        stop = req.data.get("stop")
        stops = [] if stop is None else [_utf8(s, "stop") for s in stop.reshape(-1)]
        tpot_ms = _scalar(req, "tpot_ms")
        if tpot_ms is not None and not (float(tpot_ms) >= 0):  # NaN too; 0 is the default: no objective
            raise ValueError(f"tpot_ms must be a number of milliseconds >= 0 (0: no objective); got {tpot_ms!r}")
        seed = _scalar(req, "seed")
        salt = _scalar(req, "cache_salt")
        # Decoded leniently, two tenants' different salts could read alike and share cached prompts.
        salt = None if salt is None else _utf8(salt, "cache_salt")
        logprobs = _scalar(req, "logprobs")
        return self.stack.make_request(
            text=text, prompt_ids=None if ids is None else ids,
            max_tokens=_as_int(_scalar(req, "max_tokens", 16)),
            temperature=float(_scalar(req, "temperature", 0.0)),
            top_p=float(_scalar(req, "top_p", 1.0)),
            top_k=_as_int(_scalar(req, "top_k", 0)),
            seed=None if seed is None else _as_int(seed),
            stop=stops,
            tpot_s=None if tpot_ms is None or float(tpot_ms) == 0 else float(tpot_ms) / 1e3,
            ignore_eos=bool(_scalar(req, "ignore_eos", False)),
            cache_salt=salt,
            logprobs=None if logprobs is None else _as_int(logprobs),
        )


def wants_stream(req) -> bool:
    """Whether a `retrospec_generate` request asked for its updates as they come (`stream`, default true) or for one
    response with the whole output."""
    return bool(_scalar(req, "stream", True))


def generate_outputs(out: RequestOutput, *, logprobs: int | None) -> dict[str, np.ndarray]:
    """One streamed update as `retrospec_generate`'s output tensors (both servers send these). With `logprobs` (the
    request's k) also, per token of `output_ids`, its log probability (`output_log_probs`) and, for k >= 1, the k
    most likely tokens' there (`top_logprob_ids`, `top_logprobs`: [tokens, k], most likely first)."""
    stats = out.stats
    outputs = {
        "output_ids": np.asarray(out.token_ids, dtype=np.int32),
        "text_output": np.array([out.text.encode()], dtype=np.object_),
        "finish_reason": np.array([out.finish_reason.value.encode() if out.finished else b""], dtype=np.object_),
        "steps": np.array([stats.steps if stats else 0], dtype=np.int32),
        "accepted_tokens": np.array([stats.accepted if stats else 0], dtype=np.int32),
        "tokens_per_step": np.array([stats.tokens_per_step if stats else 0.0], dtype=np.float32),
    }
    if logprobs is None:
        return outputs
    entries = out.logprobs or []
    outputs["output_log_probs"] = np.array([e.logprob for e in entries], dtype=np.float32)
    if logprobs > 0:  # k = 0: no top tensors (Triton does not pass on a [n, 0] tensor)
        shape = (len(entries), logprobs)  # given, for an update without tokens
        outputs["top_logprob_ids"] = np.array([[t for t, _ in e.top] for e in entries], np.int32).reshape(shape)
        outputs["top_logprobs"] = np.array([[v for _, v in e.top] for e in entries], np.float32).reshape(shape)
    return outputs


def pytriton_tensors(spec) -> list:
    """pytriton `Tensor`s for a `triton_repo` contract list (name, Triton type, dims[, optional])."""
    from pytriton.model_config import Tensor

    dtypes = {"TYPE_STRING": bytes, "TYPE_INT32": np.int32, "TYPE_INT64": np.int64, "TYPE_FP32": np.float32,
              "TYPE_BOOL": np.bool_}
    return [Tensor(name=name, dtype=dtypes[kind], shape=tuple(int(d) for d in dims.split(",")),
                   optional=bool(rest and rest[0]))
            for name, kind, dims, *rest in spec]


class DraftModel:
    """The `retrospec_draft` inference callable."""

    def __init__(self, service: DraftService) -> None:
        self.service = service

    async def __call__(self, requests):
        try:
            return [self.respond(req) for req in requests]
        except ValueError as exc:  # a plain ValueError: the proxy answers with its message, as a 400
            raise ValueError(str(exc)) from None

    def respond(self, req) -> dict[str, np.ndarray]:
        """One request's outputs (`req.data`: input name -> array; the stock-tritonserver model calls this too).
        ValueError: bad input, this request only."""
        rid = _scalar(req, "request_id")
        if rid is None:
            raise ValueError("request_id (BYTES[1]) is required")
        ids = req.data.get("input_ids")
        tree = self.service.draft(_utf8(rid, "request_id"),
                                  np.zeros(0, np.int32) if ids is None else ids.reshape(-1),
                                  budget=_as_int(_scalar(req, "budget", 16)),
                                  end=bool(_scalar(req, "end", False)))
        return {"draft_tokens": tree.tokens.astype(np.int32), "draft_parents": tree.parents.astype(np.int32),
                "draft_probs": tree.probs.astype(np.float32), "best_path": tree.best_path().tokens.astype(np.int32)}


def _request_id(key: str) -> str:
    return f"triton-{key}"


class CancellationListener:
    """Receives the keys of cancelled requests from the generate model's proxy inside tritonserver (datagrams on a
    unix socket) and hands each to `on_cancel`. Its thread ends when `close()` is called or the socket file is
    removed (pytriton deletes its workspace on `Triton.stop()`)."""

    def __init__(self, path: Path, on_cancel: Callable[[str], None]) -> None:
        if len(os.fsencode(path)) >= 104:  # sun_path is 104-108 bytes depending on the platform
            raise RuntimeError(f"the cancellation socket path {path} is too long for a unix socket; "
                               "set TMPDIR to a shorter directory")
        self.path = Path(path)
        self.on_cancel = on_cancel
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._socket.bind(str(self.path))
        self._socket.settimeout(0.5)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="retrospec-triton-cancel", daemon=True)

    def start(self) -> "CancellationListener":
        self._thread.start()
        return self

    def close(self) -> None:
        self._closed.set()
        self._thread.join(2)
        self._socket.close()

    def _run(self) -> None:
        try:
            while not self._closed.is_set() and self.path.exists():
                try:
                    data = self._socket.recv(512)
                except TimeoutError:
                    continue
                try:
                    self.on_cancel(data.decode())
                except Exception:  # noqa: BLE001 - one bad report must not stop cancellation for everyone else
                    _LOG.exception("cancelling the Triton request reported as %r failed", data)
        except OSError:  # the socket was closed under us
            pass
        finally:
            self._socket.close()


def install_cancellation_proxy(triton, model_name: str) -> None:
    """Load `templates/pytriton_cancel_model.py` as `model_name`'s model.py, in front of pytriton's proxy model (sent
    along as `pytriton_model.py`, the module the template subclasses). pytriton ships a model's files to tritonserver
    through the model-control API when the server starts (`Model.get_proxy_model_files`); call this after `bind`."""
    models = [m for m in getattr(getattr(triton, "_model_manager", None), "models", ()) if m.model_name == model_name]
    if len(models) != 1 or not callable(getattr(models[0], "get_proxy_model_files", None)):
        raise RuntimeError(f"cannot find pytriton's bound model {model_name!r}; retrospec's cancellation proxy expects "
                           "nvidia-pytriton 0.7.0 (the version pinned in requirements.txt)")
    model = models[0]
    pytriton_files = model.get_proxy_model_files

    def files_with_cancellation_proxy() -> dict[str, bytes]:
        files = dict(pytriton_files())
        version = model.model_version
        files[f"file:{version}/pytriton_model.py"] = files.pop(f"file:{version}/model.py")
        files[f"file:{version}/model.py"] = CANCEL_PROXY_TEMPLATE.read_bytes()
        return files

    model.get_proxy_model_files = files_with_cancellation_proxy


def _scalar(req, name: str, default=None):
    value = req.data.get(name)
    if value is None:
        return default
    if value.size != 1:
        raise ValueError(f"input {name} must hold exactly one value; got shape {list(value.shape)}")
    return value.reshape(-1)[0]


def _utf8(value, name: str) -> str:
    """A BYTES element as text. Not decoded with replacement: two ids or salts that differ only in their invalid
    bytes would read as one."""
    if not isinstance(value, bytes):
        return str(value)
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{name} must be UTF-8 text") from None


def _as_int(value) -> int:
    if isinstance(value, (np.floating, float)):
        raise ValueError(f"expected an integer; got {value!r}")
    return int(value)


class _BadInputInOneLine(logging.Filter):
    """pytriton logs every request its inference callable raised on with the whole traceback (a warning of
    `pytriton.proxy.inference`). A ValueError is a client's bad input, whose client got the message: the log gets
    that message in one line. Anything else keeps its traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        if (isinstance(record.msg, str) and record.msg.startswith("Exception while performing inference")
                and len(args) == 2 and isinstance(args[1], str)):
            last = args[1].rstrip().rsplit("\n", 1)[-1]
            if last.startswith("ValueError: "):
                record.msg, record.args = "refused a request (bad input): %s", (last.removeprefix("ValueError: "),)
        return True


_BAD_INPUT_IN_ONE_LINE = _BadInputInOneLine()


def start_triton(stack: ServingStack, *, ports: TritonPorts = TritonPorts(), address: str = "127.0.0.1",
                 verbose: bool = False):
    """Start tritonserver (a subprocess) serving both models; returns the `pytriton.triton.Triton` (call `.stop()`).
    The generate model shares `stack`'s runner; the draft model gets its own drafter over the same datastores.
    A client that cancels its gRPC stream (or disconnects) cancels its generation here too (module docstring)."""
    ensure_libpython_on_ld_path()
    logging.getLogger("pytriton.proxy.inference").addFilter(_BAD_INPUT_IN_ONE_LINE)  # once: the same filter
    from pytriton.model_config import ModelConfig
    from pytriton.triton import Triton, TritonConfig
    from pytriton.utils.workspace import Workspace

    config = TritonConfig(http_address=address, http_port=ports.http, grpc_address=address, grpc_port=ports.grpc,
                          metrics_address=address, metrics_port=ports.metrics, exit_timeout_secs=10,
                          log_verbose=1 if verbose else None)
    workspace = Workspace()  # ours, so that the cancellation socket's path (in the workspace) is known here
    triton = Triton(config=config, workspace=workspace)
    listener = None
    generate = GenerateModel(stack)
    try:
        triton.bind(
            model_name=GENERATE_MODEL, infer_func=generate,
            inputs=pytriton_tensors(GENERATE_INPUTS), outputs=pytriton_tensors(GENERATE_OUTPUTS),
            config=ModelConfig(batching=False, decoupled=True),
            strict=True,
        )
        # built on the runner thread: a drafter compiles and warms its parallel kernels (`orchestrator.runner`)
        service = DraftService(stack.runner.call(lambda: make_drafter(stack.config)),
                               idle_timeout_s=stack.config.draft_idle_timeout_s, vocab_size=stack.engine.vocab_size)
        triton.bind(
            model_name=DRAFT_MODEL, infer_func=DraftModel(service),
            inputs=pytriton_tensors(DRAFT_INPUTS), outputs=pytriton_tensors(DRAFT_OUTPUTS),
            config=ModelConfig(batching=False),
            strict=True,
        )
        triton.draft_service = service  # for tests and operators: the live sessions
        install_cancellation_proxy(triton, GENERATE_MODEL)
        install_cancellation_proxy(triton, DRAFT_MODEL)  # for its error responses (the template's docstring)
        # its thread ends by itself once `triton.stop()` deletes the workspace, socket file included
        listener = CancellationListener(workspace.path / CANCEL_SOCKET_NAME, generate.cancel).start()
        triton.run()
    except BaseException:
        triton.stop()
        if listener is not None:
            listener.close()
        raise
    return triton
