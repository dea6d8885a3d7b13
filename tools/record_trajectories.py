"""Record greedy trajectories of the target model over the prompt sets (`tools/prompt_sets.py`).

    python -m tools.record_trajectories                      # every set, eval + calib splits, default model, bf16
    python -m tools.record_trajectories --sets mtbench --splits eval --max-new-tokens 64

Plain greedy decoding through `TorchEngine` (no speculation), batched; outputs stop at EOS or --max-new-tokens.
Written to benchmarks/data/trajectories/<set>-<split>.jsonl (see tools/trajectories.py).
"""

from __future__ import annotations

import argparse
import datetime
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from drafter.tree import DraftTree
from tools.prompt_sets import PROMPT_SETS, load_prompt_set
from tools.trajectories import TRAJECTORY_DIR, Trajectory, save_trajectories, trajectory_path
from trt_engines.base import SamplingParams, VerifyItem
from trt_engines.prepare import resolve_model_dir
from trt_engines.torch_engine import TorchEngine


def render_prompts(model_dir, prompts) -> list[np.ndarray]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    ids = []
    for prompt in prompts:
        text = tokenizer.apply_chat_template(list(prompt.messages), add_generation_prompt=True, tokenize=False)
        ids.append(np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.int32))
    return ids


def greedy_decode(engine: TorchEngine, prompt_ids: list[np.ndarray], *, max_new_tokens: int, batch_size: int,
                  progress: tqdm | None = None) -> list[tuple[np.ndarray, str]]:
    """Continuous plain greedy decoding: keeps up to `batch_size` requests running, refilling as they finish."""
    greedy = SamplingParams()
    eos = set(engine.eos_token_ids)
    results: list[tuple[np.ndarray, str] | None] = [None] * len(prompt_ids)
    outputs: dict[int, list[int]] = {}
    pending = list(range(len(prompt_ids)))[::-1]
    while pending or outputs:
        while pending and len(outputs) < batch_size and engine.can_admit(len(prompt_ids[pending[-1]]), max_new_tokens):
            index = pending.pop()
            outputs[index] = [engine.add_request(index, prompt_ids[index], greedy)]
        if not outputs:
            raise RuntimeError("the KV cache cannot hold a single request; raise --num-blocks")
        finished = [i for i, out in outputs.items() if out[-1] in eos or len(out) >= max_new_tokens]
        for index in finished:
            out = outputs.pop(index)
            engine.release(index)
            results[index] = (np.asarray(out, np.int32), "eos" if out[-1] in eos else "length")
            if progress is not None:
                progress.update(1)
        if not outputs:
            continue
        step = engine.verify([VerifyItem(index, DraftTree.empty()) for index in outputs])
        for result in step.results:
            token = int(result.target_tokens[0])
            engine.commit(result.request_id, [], next_root=token)
            outputs[result.request_id].append(token)
    return results  # type: ignore[return-value]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--sets", nargs="+", default=list(PROMPT_SETS), choices=PROMPT_SETS)
    parser.add_argument("--splits", nargs="+", default=["eval", "calib"], choices=["eval", "calib"])
    parser.add_argument("--max-new-tokens", type=int, default=320)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--out-dir", default=str(TRAJECTORY_DIR))
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    model_dir = resolve_model_dir(args.model)
    engine = TorchEngine(args.model, dtype=getattr(torch, args.dtype))
    for set_name in args.sets:
        for split in args.splits:
            prompts = load_prompt_set(set_name, split)
            if not prompts:
                continue
            prompt_ids = render_prompts(model_dir, prompts)
            started = time.perf_counter()
            with tqdm(total=len(prompts), desc=f"{set_name}-{split}", unit="prompt") as bar:
                decoded = greedy_decode(engine, prompt_ids, max_new_tokens=args.max_new_tokens,
                                        batch_size=args.batch_size, progress=bar)
            seconds = time.perf_counter() - started
            trajectories = [
                Trajectory(set_name, p.prompt_id, ids, out, finish)
                for p, ids, (out, finish) in zip(prompts, prompt_ids, decoded)
            ]
            n_tokens = sum(t.output_ids.shape[0] for t in trajectories)
            meta = {
                "model": str(args.model),
                "dtype": args.dtype,
                "engine": "TorchEngine",
                "max_new_tokens": args.max_new_tokens,
                "prompts": len(trajectories),
                "output_tokens": n_tokens,
                "seconds": round(seconds, 1),
                "recorded": datetime.date.today().isoformat(),
            }
            save_trajectories(trajectory_path(set_name, split, Path(args.out_dir)), trajectories, meta)
            print(f"{set_name}-{split}: {len(trajectories)} prompts, {n_tokens} output tokens, "
                  f"{n_tokens / seconds:.0f} tok/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
