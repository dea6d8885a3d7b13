"""`retrospec_generate`'s model.py inside the tritonserver that `retrospec serve --triton` starts through pytriton.

pytriton's own proxy model (loaded beside this file as `pytriton_model.py`; see
`orchestrator.serving.triton_server.install_cancellation_proxy`) forwards requests to the retrospec process and
streams its responses back, but it never looks at Triton's request cancellation (nvidia-pytriton 0.7.0), so a gRPC
client that cancelled its stream left the generation running to max_tokens. This subclass adds what is missing:

- every request handed to the inference callable carries a key (request parameter `retrospec_cancel_key`);
- before each streamed response is passed on to Triton, the request's `is_cancelled()` is asked (Triton's request
  cancellation, r23.10+), and the key of a cancelled request is sent, once, as a datagram to the unix socket
  `retrospec-cancel.sock` in pytriton's workspace, where the retrospec process cancels the generation and frees its
  KV blocks;
- an error reaches the client as the exception's message (`max_tokens must be an integer >= 1; got 0`), not as the
  Python traceback pytriton formats in the retrospec process, which only its log needs.

`start_triton` loads this file in front of `retrospec_draft` too, which is not decoupled: there only the last point
applies, and more is needed. pytriton's batch handler turns a failed call into an exception that its `execute`
wraps in one more traceback, as an internal error (HTTP 500) for the whole call; `ClientErrorBatchHandler` answers
each request with an error response instead, carrying the message, INVALID_ARG (HTTP 400) for a ValueError.

Why in the response path and not from a polling thread: the backend frees a request's response factory once its
final response is sent, and `is_cancelled()` on it after that crashes tritonserver (seen under load). pytriton's
responses handler sends one response at a time and the final one last, so a check made before a response is handed
to it always runs while the request is alive. A running request streams a response every step, so a cancel is
noticed within a step.
"""

import asyncio
import concurrent.futures
import itertools
import json
import os
import pathlib
import socket

import triton_python_backend_utils as pb_utils  # type: ignore  # only inside tritonserver's Python backend

from . import pytriton_model
from .pytriton_model import TritonPythonModel as PyTritonProxyModel

CANCEL_KEY_PARAMETER = "retrospec_cancel_key"
CANCEL_SOCKET_NAME = "retrospec-cancel.sock"


class _CheckBeforeHandingOn:
    """The responses queue of one batch of requests, asking about cancellation (`check`, if any) before each response
    leaves it; an error leaves it as its message, which `errors` (if given) collects."""

    def __init__(self, queue, check=None, errors=None):
        self._queue, self._check, self._errors = queue, check, errors

    async def get(self):
        flags, payload = await self._queue.get()
        if self._check is not None:
            await self._check()
        if flags & pytriton_model.PyTritonResponseFlags.ERROR and isinstance(payload, bytes):
            payload, bad_input = _final_exception(payload)
            if self._errors is not None:
                self._errors.append((payload.decode("utf-8", "replace"), bad_input))
        return flags, payload

    def task_done(self):
        self._queue.task_done()


class ClientErrorBatchHandler(pytriton_model.BatchResponsesHandler):
    """pytriton's handler for a model that is not decoupled, answering a failed call with an error response per
    request (the message; INVALID_ARG where it was a ValueError) instead of an exception (module docstring)."""

    async def handle_responses(self, scope, responses_queue, responses_future):
        requests = list(self._requests_map[scope["requests_id"]])
        errors = []
        handled = concurrent.futures.Future()  # what pytriton's handler would hand `execute`
        result = await super().handle_responses(scope, _CheckBeforeHandingOn(responses_queue, errors=errors), handled)
        if errors:
            message, bad_input = errors[-1]
            code = pb_utils.TritonError.INVALID_ARG if bad_input else pb_utils.TritonError.INTERNAL
            result = [pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code)) for _ in requests]
        responses_future.set_result(result)
        return result


def client_message(error: bytes) -> bytes:
    """The message of the exception a formatted traceback ends with; a ValueError (bad input, by retrospec's
    contract) without its type's name. Anything else is passed on as it is."""
    return _final_exception(error)[0]


def _final_exception(error: bytes) -> tuple[bytes, bool]:
    """`client_message`, and whether the exception was a ValueError."""
    text = error.decode("utf-8", "replace")
    if not text.startswith("Traceback (most recent call last):"):
        return error, False
    lines = text.rstrip("\n").split("\n")
    frames = [i for i, line in enumerate(lines) if line.startswith(" ")]  # frames, their code and carets
    message = "\n".join(lines[frames[-1] + 1:] if frames else lines[1:])
    bad_input = message.startswith("ValueError: ")
    return message.removeprefix("ValueError: ").encode(), bad_input


class CancellationReportingHandler(pytriton_model.DecoupledResponsesHandler):
    """pytriton's decoupled responses handler, reporting cancelled requests to the retrospec process."""

    def __init__(self, requests_map, serializer_deserializer, model_outputs_dict, *, keys, socket_path):
        super().__init__(requests_map, serializer_deserializer, model_outputs_dict)
        self._keys = keys  # id(triton request) -> key, filled as requests are forwarded
        self._socket_path = socket_path
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)

    async def handle_responses(self, scope, responses_queue, responses_future):
        requests = list(self._requests_map[scope["requests_id"]])
        reported = set()
        loop = asyncio.get_running_loop()

        async def check():
            for request in requests:
                key = self._keys.get(id(request))
                if key is None or key in reported:
                    continue
                if await loop.run_in_executor(None, request.is_cancelled):
                    reported.add(key)
                    try:
                        self._socket.sendto(key.encode(), self._socket_path)
                    except OSError as exc:  # the retrospec process is gone or shutting down
                        pb_utils.Logger.log_warn(f"retrospec_generate: could not report {key} cancelled: {exc}")

        try:
            return await super().handle_responses(scope, _CheckBeforeHandingOn(responses_queue, check),
                                                  responses_future)
        finally:
            for request in requests:
                self._keys.pop(id(request), None)


class TritonPythonModel(PyTritonProxyModel):
    def initialize(self, args):
        config = json.loads(args["model_config"])
        socket_path = str(pathlib.Path(config["parameters"]["workspace-path"]["string_value"]) / CANCEL_SOCKET_NAME)
        keys = {}

        def handler(*handler_args):
            return CancellationReportingHandler(*handler_args, keys=keys, socket_path=socket_path)

        # pytriton's initialize picks its handler class by these module-level names
        originals = pytriton_model.DecoupledResponsesHandler, pytriton_model.BatchResponsesHandler
        pytriton_model.DecoupledResponsesHandler, pytriton_model.BatchResponsesHandler = handler, ClientErrorBatchHandler
        try:
            super().initialize(args)
        finally:
            pytriton_model.DecoupledResponsesHandler, pytriton_model.BatchResponsesHandler = originals
        server = getattr(self, "_requests_server", None)
        if not callable(getattr(server, "_wrap_request", None)):
            raise pb_utils.TritonModelException(
                "retrospec's cancellation proxy expects nvidia-pytriton 0.7.0's proxy model (its "
                "_requests_server._wrap_request); install the version pinned in requirements.txt")
        counter = itertools.count(1)
        prefix = f"{os.getpid()}-{args.get('model_instance_name', '')}-"
        wrap = server._wrap_request

        def wrap_with_key(triton_request, inputs, span=None):
            request = wrap(triton_request, inputs, span)
            key = f"{prefix}{next(counter)}"
            request.parameters = {**(request.parameters or {}), CANCEL_KEY_PARAMETER: key}
            keys[id(triton_request)] = key
            return request

        server._wrap_request = wrap_with_key
