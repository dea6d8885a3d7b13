"""retrospec_draft for a stock tritonserver (Python backend). Written by `retrospec export-triton-repo`; the
serving configuration and the import path come from this model's config.pbtxt."""

import json
import sys

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        params = {k: v["string_value"] for k, v in json.loads(args["model_config"]).get("parameters", {}).items()}
        for path in reversed(json.loads(params.get("python_path", "[]"))):
            if path not in sys.path:
                sys.path.insert(0, path)
        from orchestrator.serving.draft_service import DraftService
        from orchestrator.serving.stack import ServingConfig, make_drafter

        config = ServingConfig(**json.loads(params["serving_config"]))
        self.service = DraftService(make_drafter(config), idle_timeout_s=config.draft_idle_timeout_s)

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                rid = pb_utils.get_input_tensor_by_name(request, "request_id").as_numpy().reshape(-1)[0]
                ids = pb_utils.get_input_tensor_by_name(request, "input_ids")
                budget = pb_utils.get_input_tensor_by_name(request, "budget")
                end = pb_utils.get_input_tensor_by_name(request, "end")
                tree = self.service.draft(
                    rid.decode("utf-8", "replace") if isinstance(rid, bytes) else str(rid),
                    np.zeros(0, np.int32) if ids is None else ids.as_numpy().reshape(-1),
                    budget=16 if budget is None else int(budget.as_numpy().reshape(-1)[0]),
                    end=False if end is None else bool(end.as_numpy().reshape(-1)[0]))
                responses.append(pb_utils.InferenceResponse(output_tensors=[
                    pb_utils.Tensor("draft_tokens", tree.tokens.astype(np.int32)),
                    pb_utils.Tensor("draft_parents", tree.parents.astype(np.int32)),
                    pb_utils.Tensor("draft_probs", tree.probs.astype(np.float32)),
                    pb_utils.Tensor("best_path", tree.best_path().tokens.astype(np.int32)),
                ]))
            except ValueError as exc:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc))))
        return responses

    def finalize(self):
        self.service.close()
