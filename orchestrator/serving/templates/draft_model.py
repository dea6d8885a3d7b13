"""retrospec_draft for a stock tritonserver (Python backend). Written by `retrospec export-triton-repo`; the
serving configuration and the import path come from this model's config.pbtxt."""

import json
import sys
from types import SimpleNamespace

import triton_python_backend_utils as pb_utils

INPUTS = ("request_id", "input_ids", "budget", "end")


class TritonPythonModel:
    def initialize(self, args):
        params = {k: v["string_value"] for k, v in json.loads(args["model_config"]).get("parameters", {}).items()}
        for path in reversed(json.loads(params.get("python_path", "[]"))):
            if path not in sys.path:
                sys.path.insert(0, path)
        from orchestrator.serving.draft_service import DraftService
        from orchestrator.serving.stack import ServingConfig, make_drafter
        from orchestrator.serving.triton_server import DraftModel

        config = ServingConfig(**json.loads(params["serving_config"]))
        self.service = DraftService(make_drafter(config), idle_timeout_s=config.draft_idle_timeout_s)
        self.model = DraftModel(self.service)  # the same input handling as `retrospec serve --triton`

    def execute(self, requests):
        responses = []
        for request in requests:
            data = {}
            for name in INPUTS:
                tensor = pb_utils.get_input_tensor_by_name(request, name)
                if tensor is not None:
                    data[name] = tensor.as_numpy()
            try:
                outputs = self.model.respond(SimpleNamespace(data=data))
                responses.append(pb_utils.InferenceResponse(
                    output_tensors=[pb_utils.Tensor(name, array) for name, array in outputs.items()]))
            except ValueError as exc:  # bad input: this request only
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc))))
        return responses

    def finalize(self):
        self.service.close()
