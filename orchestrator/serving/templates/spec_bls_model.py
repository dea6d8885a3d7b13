"""retrospec_spec_bls: speculative generation with TensorRT-LLM's Triton backend as the target (Python backend, BLS).
Written by `retrospec export-triton-repo --tensorrtllm`; model names, draft budget and token ids come from this
model's config.pbtxt.

Per request, until max_tokens tokens (or the end id):
    1. retrospec_draft(request_id, new tokens, budget) -> a draft tree; reduced to its best path of at most
       min(max_draft_len, room) tokens (`DraftTree.best_path_nodes`)
    2. tensorrt_llm(input_ids = all tokens so far, draft_input_ids = that path, request_output_len = len(path) + 1)
       -> the accepted draft prefix + the bonus token (the target's greedy continuation)
    3. append them; they are the next call's new tokens for the drafter
and finally retrospec_draft(..., end=true) to release the drafter's state. Greedy only (no sampling inputs).
"""

import json
import sys
import uuid

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        params = {k: v["string_value"] for k, v in json.loads(args["model_config"]).get("parameters", {}).items()}
        for path in reversed(json.loads(params.get("python_path", "[]"))):
            if path not in sys.path:
                sys.path.insert(0, path)
        from drafter.tree import DraftTree

        self.DraftTree = DraftTree
        self.target = params["tensorrt_llm_model_name"]
        self.draft_model = params["draft_model_name"]
        self.max_draft_len = int(params["max_draft_len"])
        self.draft_budget = int(params["draft_budget"])
        self.max_seq_len = int(params["max_seq_len"])
        self.end_id = int(params["end_id"])
        self.pad_id = int(params["pad_id"])

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                responses.append(self._generate(request))
            except (ValueError, pb_utils.TritonModelException) as exc:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc))))
        return responses

    def _generate(self, request):
        ids = pb_utils.get_input_tensor_by_name(request, "input_ids")
        prompt = [] if ids is None else [int(t) for t in ids.as_numpy().reshape(-1)]
        if not prompt:
            raise ValueError("input_ids is empty: send the prompt's token ids")
        max_tokens = pb_utils.get_input_tensor_by_name(request, "max_tokens")
        max_new = 16 if max_tokens is None else int(max_tokens.as_numpy().reshape(-1)[0])
        if max_new < 1 or len(prompt) + max_new > self.max_seq_len:
            raise ValueError(f"need 1 <= max_tokens and prompt + max_tokens <= {self.max_seq_len} (the engine's "
                             f"max_seq_len); got {len(prompt)} + {max_new}")
        rid = f"bls-{uuid.uuid4().hex}"
        tokens, generated, new = list(prompt), [], list(prompt)
        steps = accepted = drafted = 0
        try:
            while len(generated) < max_new:
                room = min(self.max_draft_len, self.max_seq_len - len(tokens) - 1, max_new - len(generated) - 1)
                tree = self._draft(rid, new, self.draft_budget if room > 0 else 0)
                draft = [int(t) for t in tree.tokens[tree.best_path_nodes(max_len=room)]] if room > 0 else []
                out = self._verify(tokens, draft)[: max_new - len(generated)]
                if self.end_id in out:
                    out = out[: out.index(self.end_id) + 1]
                a = 0
                while a < min(len(draft), len(out) - 1) and draft[a] == out[a]:
                    a += 1
                steps, accepted, drafted = steps + 1, accepted + a, drafted + len(draft)
                tokens += out
                generated += out
                new = out
                if out and out[-1] == self.end_id:
                    break
        finally:
            self._draft(rid, [], 0, end=True)
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("output_ids", np.asarray(generated, dtype=np.int32)),
            pb_utils.Tensor("steps", np.array([steps], dtype=np.int32)),
            pb_utils.Tensor("accepted_tokens", np.array([accepted], dtype=np.int32)),
            pb_utils.Tensor("draft_tokens", np.array([drafted], dtype=np.int32)),
        ])

    def _draft(self, rid, new_ids, budget, end=False):
        inputs = [pb_utils.Tensor("request_id", np.array([rid.encode()], dtype=np.object_)),
                  pb_utils.Tensor("input_ids", np.asarray(new_ids, dtype=np.int32)),
                  pb_utils.Tensor("budget", np.array([budget], dtype=np.int32)),
                  pb_utils.Tensor("end", np.array([end], dtype=bool))]
        response = pb_utils.InferenceRequest(
            model_name=self.draft_model, requested_output_names=["draft_tokens", "draft_parents", "draft_probs"],
            inputs=inputs).exec()
        if response.has_error():
            raise pb_utils.TritonModelException(response.error().message())
        tokens, parents, probs = (pb_utils.get_output_tensor_by_name(response, name).as_numpy()
                                  for name in ("draft_tokens", "draft_parents", "draft_probs"))
        return self.DraftTree.from_arrays(tokens=tokens, parents=parents, probs=probs)

    def _verify(self, tokens, draft):
        def scalar(name, value, dtype):
            return pb_utils.Tensor(name, np.array([[value]], dtype=dtype))

        inputs = [pb_utils.Tensor("input_ids", np.asarray([tokens], dtype=np.int32)),
                  scalar("input_lengths", len(tokens), np.int32),
                  scalar("request_output_len", len(draft) + 1, np.int32),
                  scalar("end_id", self.end_id, np.int32), scalar("pad_id", self.pad_id, np.int32),
                  scalar("exclude_input_in_output", True, bool), scalar("streaming", False, bool)]
        if draft:
            inputs.append(pb_utils.Tensor("draft_input_ids", np.asarray([draft], dtype=np.int32)))
        response = pb_utils.InferenceRequest(model_name=self.target, requested_output_names=["output_ids",
                                             "sequence_length"], inputs=inputs).exec()
        if response.has_error():
            raise pb_utils.TritonModelException(response.error().message())
        output_ids = pb_utils.get_output_tensor_by_name(response, "output_ids").as_numpy()  # [1, beam, T]
        length = int(pb_utils.get_output_tensor_by_name(response, "sequence_length").as_numpy().reshape(-1)[0])
        out = [int(t) for t in output_ids.reshape(-1)[: min(length, output_ids.shape[-1])]]
        if not out:
            raise pb_utils.TritonModelException("tensorrt_llm returned no token")
        return out
