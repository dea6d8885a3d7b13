"""retrospec_generate for a stock tritonserver (Python backend, decoupled). Written by `retrospec
export-triton-repo`; the serving configuration and the import path come from this model's config.pbtxt."""

import json
import sys
import uuid

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        params = {k: v["string_value"] for k, v in json.loads(args["model_config"]).get("parameters", {}).items()}
        for path in reversed(json.loads(params.get("python_path", "[]"))):
            if path not in sys.path:
                sys.path.insert(0, path)
        from orchestrator.serving.stack import ServingConfig, ServingStack
        from orchestrator.serving.triton_repo import GENERATE_INPUTS, backend_request, error_response
        from orchestrator.request import merged_output
        from orchestrator.serving.triton_server import GenerateModel, generate_outputs, wants_stream

        self._request = lambda request: backend_request(pb_utils, request, GENERATE_INPUTS)
        self._error = lambda exc: error_response(pb_utils, exc)
        self._outputs = generate_outputs
        self._merged = merged_output
        self._wants_stream = wants_stream

        self.stack = ServingStack.build(ServingConfig(**json.loads(params["serving_config"])))
        self.model = GenerateModel(self.stack)

    def execute(self, requests):
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        for request in requests:
            sender = request.get_response_sender()
            try:
                inputs = self._request(request)
                generation = self.model.stack_request(inputs)
                rid = f"triton-{uuid.uuid4().hex}"
                k = generation.sampling.logprobs
                updates = None if self._wants_stream(inputs) else []  # not streamed: sent as one when finished
                self.stack.submit(generation, lambda out, sender=sender, rid=rid, k=k, updates=updates:
                                  self._send(sender, out, rid, k, updates), frontend="triton", request_id=rid)
            except (ValueError, RuntimeError) as exc:  # bad input or shutting down: this request only
                sender.send(self._error(exc), flags=final)
        return None

    def _send(self, sender, out, request_id, logprobs, updates):
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        if sender.is_cancelled():  # the client cancelled its request or closed its stream
            if not out.finished:  # stop generating: the runner cancels it and frees its KV blocks
                self.stack.runner.cancel(request_id)
                return
            if out.finish_reason.value == "cancelled":  # emitted after the engine released the request
                pb_utils.Logger.log_info(f"retrospec_generate: {request_id} cancelled by the client, KV blocks freed")
                sender.send(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError("cancelled by the client", pb_utils.TritonError.CANCELLED)), flags=final)
                return
        if out.error is not None:
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(out.error)), flags=final)
            return
        if updates is not None:
            updates.append(out)
            if not out.finished:
                return
            out = self._merged(updates)
        tensors = [pb_utils.Tensor(name, array) for name, array in self._outputs(out, logprobs=logprobs).items()]
        sender.send(pb_utils.InferenceResponse(output_tensors=tensors), flags=final if out.finished else 0)

    def finalize(self):
        self.stack.shutdown(cancel_inflight=True, timeout=30)
