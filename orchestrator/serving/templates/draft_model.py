"""retrospec_draft for a stock tritonserver (Python backend). Written by `retrospec export-triton-repo`; the
serving configuration and the import path come from this model's config.pbtxt."""

import json
import sys

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        params = {k: v["string_value"] for k, v in json.loads(args["model_config"]).get("parameters", {}).items()}
        for path in reversed(json.loads(params.get("python_path", "[]"))):
            if path not in sys.path:
                sys.path.insert(0, path)
        from orchestrator.serving.draft_service import DraftService
        from orchestrator.serving.stack import ServingConfig, make_drafter
        from orchestrator.serving.triton_repo import DRAFT_INPUTS, backend_request, error_response
        from orchestrator.serving.triton_server import DraftModel

        self._request = lambda request: backend_request(pb_utils, request, DRAFT_INPUTS)
        self._error = lambda exc: error_response(pb_utils, exc)

        config = ServingConfig(**json.loads(params["serving_config"]))
        self.service = DraftService(make_drafter(config), idle_timeout_s=config.draft_idle_timeout_s)
        self.model = DraftModel(self.service)  # the same input handling as `retrospec serve --triton`

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                outputs = self.model.respond(self._request(request))
                responses.append(pb_utils.InferenceResponse(
                    output_tensors=[pb_utils.Tensor(name, array) for name, array in outputs.items()]))
            except ValueError as exc:  # bad input: this request only
                responses.append(self._error(exc))
        return responses

    def finalize(self):
        self.service.close()
