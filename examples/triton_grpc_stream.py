"""Stream a generation from `retrospec serve --triton` over gRPC (tritonclient), printing text as it arrives.

    python examples/triton_grpc_stream.py --url 127.0.0.1:8001 --prompt "def fibonacci(n):" --max-tokens 64
"""

from __future__ import annotations

import argparse
import queue

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import np_to_triton_dtype


def tensor(name: str, array: np.ndarray) -> grpcclient.InferInput:
    t = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
    t.set_data_from_numpy(array)
    return t


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="127.0.0.1:8001")
    parser.add_argument("--prompt", default="def fibonacci(n):")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--tpot-ms", type=float, default=0.0, help="time-per-output-token objective (0 = none)")
    args = parser.parse_args()

    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(args.url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        client.async_stream_infer("retrospec_generate", [
            tensor("text_input", np.array([args.prompt.encode()], dtype=np.object_)),
            tensor("max_tokens", np.array([args.max_tokens], dtype=np.int32)),
            tensor("temperature", np.array([args.temperature], dtype=np.float32)),
            tensor("tpot_ms", np.array([args.tpot_ms], dtype=np.float32)),
        ])
        print(args.prompt, end="", flush=True)
        while True:
            result, error = responses.get(timeout=300)
            if error is not None:
                raise SystemExit(f"\nerror: {error}")
            print(result.as_numpy("text_output")[0].decode(), end="", flush=True)
            finish = result.as_numpy("finish_reason")[0].decode()
            if finish:  # the last response carries the finish reason and the request's statistics
                steps, accepted = int(result.as_numpy("steps")[0]), int(result.as_numpy("accepted_tokens")[0])
                print(f"\n[{finish}] {steps} steps, {accepted} draft tokens accepted, "
                      f"{float(result.as_numpy('tokens_per_step')[0]):.2f} tokens/step")
                return 0
    finally:
        client.stop_stream()
        client.close()


if __name__ == "__main__":
    raise SystemExit(main())
