"""Use `retrospec serve --triton` over HTTP: the drafting service with tritonclient.http, a streamed generation
through Triton's HTTP generate_stream endpoint (server-sent events; tritonclient.http has no decoupled streaming
call, the generate extension does), and one answered whole by the generate endpoint (`"stream": false`).

    python examples/triton_http_client.py --url 127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import json
import urllib.request

import numpy as np
import tritonclient.http as httpclient
from tritonclient.utils import np_to_triton_dtype


def tensor(name: str, array: np.ndarray) -> httpclient.InferInput:
    t = httpclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
    t.set_data_from_numpy(array)
    return t


def draft(client: httpclient.InferenceServerClient, request_id: str, new_ids: list[int], *, budget: int = 16,
          end: bool = False) -> dict[str, np.ndarray]:
    """One drafting-service call: the first call for an id sends the context, later calls the accepted tokens."""
    result = client.infer("retrospec_draft", [
        tensor("request_id", np.array([request_id.encode()], dtype=np.object_)),
        tensor("input_ids", np.asarray(new_ids, dtype=np.int32)),
        tensor("budget", np.array([budget], dtype=np.int32)),
        tensor("end", np.array([end], dtype=np.bool_)),
    ])
    return {name: result.as_numpy(name) for name in ("draft_tokens", "draft_parents", "draft_probs", "best_path")}


def generate_stream(url: str, prompt: str, max_tokens: int) -> None:
    body = json.dumps({"text_input": prompt, "max_tokens": max_tokens}).encode()
    request = urllib.request.Request(f"http://{url}/v2/models/retrospec_generate/generate_stream", data=body,
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        for line in response:
            if line.startswith(b"data: "):
                event = json.loads(line[6:])
                print(event.get("text_output", ""), end="", flush=True)
                if event.get("finish_reason"):
                    print(f"\n[{event['finish_reason']}] tokens/step {event.get('tokens_per_step')}")


def generate_whole(url: str, prompt: str, max_tokens: int) -> None:
    """Triton's generate endpoint takes one response: the model sends the whole output as one with stream false."""
    body = json.dumps({"text_input": prompt, "max_tokens": max_tokens, "stream": False}).encode()
    request = urllib.request.Request(f"http://{url}/v2/models/retrospec_generate/generate", data=body,
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        answer = json.loads(response.read())
    if "error" in answer:
        raise RuntimeError(f"generate failed: {answer['error']}")
    print(f"whole output: {answer['text_output']!r} [{answer['finish_reason']}] {len(answer['output_ids'])} tokens")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="127.0.0.1:8000")
    parser.add_argument("--prompt", default="import os\nimport sys\n\n\ndef main(argv):\n")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()

    client = httpclient.InferenceServerClient(args.url)
    try:
        assert client.is_model_ready("retrospec_draft"), "start the server with `retrospec serve --triton`"
        # Token ids come from the model's tokenizer; here a fixed context of small ids keeps the example standalone.
        context = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 198, 1, 4093, 198]
        tree = draft(client, "example-1", context)
        print("draft tree:", {k: v.tolist() for k, v in tree.items()})
        tree = draft(client, "example-1", tree["best_path"][:1].tolist())  # pretend the first token was accepted
        print("after extend, best path:", tree["best_path"].tolist())
        draft(client, "example-1", [], budget=0, end=True)  # release the request's state
    finally:
        client.close()
    generate_stream(args.url, args.prompt, args.max_tokens)
    generate_whole(args.url, args.prompt, args.max_tokens)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
