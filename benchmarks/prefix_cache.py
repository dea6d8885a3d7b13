"""What prefix caching saves the default model's prefills (bf16, `TorchEngine` with its CPU kernels): two engines side
by side, prefix caching on and off, prefill the same prompts in the same order, each prompt on both before the
next (which goes first alternates), so background load hits them alike.

- Single turns: every eval prompt of each set, the cache emptied at each set's start. What they share is the chat
  template's head (its system prompt), so this is what a server gains on one-turn traffic.
- Second turns (MT-Bench): each question's first turn is prefilled and its recorded answer verified as one draft
  chain (what the engine's greedy decoding accepts of it is committed, as decoding would), then the request ends
  and the second turn arrives as a client sends it: the chat template rendered over the whole conversation, as text,
  and tokenized again. Its prompt repeats the first turn and the answer, up to where the re-tokenized answer differs
  from the ids the model generated.

Both engines must give every prompt the same first token (the cached prefix is bitwise what a whole prefill
computes): the run fails otherwise.

    .venv/bin/python -m benchmarks.prefix_cache [--sets mtbench humaneval chitchat grounded] [--prompts 80]

Writes benchmarks/results/prefix_cache.{json,md}.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from benchmarks.results_files import save_results
from drafter.tree import DraftTree
from orchestrator.acceptance import accept
from tools.prompt_sets import PROMPT_SETS, mtbench_turns
from tools.trajectories import load_trajectories, trajectory_path
from trt_engines.base import VerifyItem
from trt_engines.cpu_kernels import cpu_description
from trt_engines.prepare import resolve_model_dir
from trt_engines.torch_engine import TorchEngine


def _engines() -> dict[bool, TorchEngine]:
    return {on: TorchEngine("default", dtype=torch.bfloat16, num_blocks=4096, prefix_caching=on)
            for on in (True, False)}


def _prefill(engine: TorchEngine, rid: str, prompt: np.ndarray) -> tuple[int, float, int]:
    """First token, seconds, prompt tokens read from the cache; the request stays."""
    started = time.perf_counter()
    first = engine.add_request(rid, prompt.tolist())
    return first, time.perf_counter() - started, engine.cached_prompt_tokens(rid)


def _pair(engines: dict[bool, TorchEngine], rid: str, prompt: np.ndarray, order: int) -> dict:
    """Prefill `prompt` on both engines (`order` decides which first); the requests stay."""
    done = {on: _prefill(engines[on], rid, prompt) for on in ((True, False) if order % 2 == 0 else (False, True))}
    if done[True][0] != done[False][0]:
        raise AssertionError(f"{rid}: first token {done[True][0]} with a cached prefix, {done[False][0]} without")
    return {"tokens": len(prompt), "cached": done[True][2], "on_s": done[True][1], "off_s": done[False][1]}


def _summary(rows: list[dict]) -> dict:
    on, off = sum(r["on_s"] for r in rows), sum(r["off_s"] for r in rows)
    tokens, cached = sum(r["tokens"] for r in rows), sum(r["cached"] for r in rows)
    return {"prompts": len(rows), "prompt_tokens": tokens, "cached_tokens": cached, "cached_fraction": cached / tokens,
            "prefill_s_on": on, "prefill_s_off": off, "time_ratio": on / off,
            "median_prompt_ratio": float(np.median([r["on_s"] / r["off_s"] for r in rows]))}


def single_turns(engines: dict[bool, TorchEngine], set_name: str, prompts: int) -> dict:
    for engine in engines.values():
        engine.reset_prefix_cache()
    rows = []
    trajectories = load_trajectories(trajectory_path(set_name, "eval"))[:prompts]
    for i, tr in enumerate(tqdm(trajectories, desc=f"{set_name} single turns", leave=False)):
        rows.append(_pair(engines, f"{set_name}-{i}", np.asarray(tr.prompt_ids), i))
        for engine in engines.values():
            engine.release(f"{set_name}-{i}")
    return {"set": set_name, **_summary(rows)}


def second_turns(engines: dict[bool, TorchEngine], prompts: int) -> dict:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_dir("default")))
    turns = mtbench_turns()
    for engine in engines.values():
        engine.reset_prefix_cache()
    rows = []
    trajectories = load_trajectories(trajectory_path("mtbench", "eval"))[:prompts]
    for i, tr in enumerate(tqdm(trajectories, desc="mtbench second turns", leave=False)):
        first_q, second_q = turns[tr.prompt_id][:2]
        answers = {}
        for on, engine in engines.items():  # turn 1, and the recorded answer as far as greedy decoding agrees
            rid = f"t1-{i}"
            root = engine.add_request(rid, np.asarray(tr.prompt_ids).tolist())
            chain = [int(t) for t in tr.output_ids[1:]]
            if root == int(tr.output_ids[0]) and chain:
                tree = DraftTree.chain(chain)
                verdict = accept(tree, engine.verify([VerifyItem(rid, tree)]).results[0].target_tokens)
                engine.commit(rid, verdict.accepted_nodes, verdict.bonus_token)
                answers[on] = [root, *verdict.new_tokens.tolist()]
            else:
                answers[on] = [root]
            engine.release(rid)
        if answers[True] != answers[False]:
            raise AssertionError(f"mtbench {tr.prompt_id}: turn-1 answers differ with and without prefix caching")
        answer = tokenizer.decode(answers[True], skip_special_tokens=True)
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": first_q}, {"role": "assistant", "content": answer},
             {"role": "user", "content": second_q}], add_generation_prompt=True, tokenize=False)
        prompt = np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.int64)
        row = _pair(engines, f"t2-{i}", prompt, i)
        row["conversation_tokens"] = len(tr.prompt_ids) + len(answers[True])
        rows.append(row)
        for engine in engines.values():
            engine.release(f"t2-{i}")
    summary = _summary(rows)
    summary["turn1_tokens"] = sum(r["conversation_tokens"] for r in rows)
    return {"set": "mtbench second turns", **summary}


def measure(sets: list[str], prompts: int) -> dict:
    torch.set_num_threads(2)
    engines = _engines()
    warm = np.arange(1, 65)
    for on, engine in engines.items():  # compile the kernels' shapes before timing
        engine.add_request("warm", warm.tolist())
        engine.release("warm")
    rows = [single_turns(engines, s, prompts) for s in sets]
    if "mtbench" in sets:
        rows.append(second_turns(engines, prompts))
    return {"machine": cpu_description(), "cpu_kernels": engines[True].cpu_kernels,
            "threads": torch.get_num_threads(), "sets": sets, "prompts_per_set": prompts,
            "block_size": engines[True].kv.block_size, "rows": rows}


def write_markdown(path: Path, result: dict) -> None:
    sets = " ".join(result["sets"])
    lines = [
        "# prefix_cache: what prefix caching saves prefills",
        "",
        f"Command: `python -m benchmarks.prefix_cache --sets {sets} --prompts {result['prompts_per_set']}` on "
        f"{result['machine']} ({result['cpu_kernels']} kernels, {result['threads']} threads). Two bf16 engines, "
        "prefix caching on and off, prefill the same prompts in the same order, alternating which goes first; "
        f"{result['block_size']}-token blocks. Every prompt got the same first token on both (the run checks it).",
        "",
        "| prompts | n | prompt tokens | read from cache | prefill s, on | prefill s, off | on / off | "
        "median per prompt |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [f"| {r['set']} | {r['prompts']} | {r['prompt_tokens']} | {r['cached_tokens']} "
              f"({100 * r['cached_fraction']:.0f}%) | {r['prefill_s_on']:.2f} | {r['prefill_s_off']:.2f} | "
              f"{r['time_ratio']:.2f} | {r['median_prompt_ratio']:.2f} |" for r in result["rows"]]
    lines += ["", "Single turns share only the chat template's head (the system prompt) with the prompts before "
              "them. A second turn repeats its conversation so far: the first turn's prompt and answer "
              f"({next((r['turn1_tokens'] for r in result['rows'] if 'turn1_tokens' in r), 0)} tokens over all "
              "questions), rendered again as text, so the cache serves it up to the first block where the "
              "re-tokenized answer differs from the ids the model generated.", ""]
    path.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", nargs="+", default=["mtbench", "humaneval", "chitchat", "grounded"],
                        choices=PROMPT_SETS)
    parser.add_argument("--prompts", type=int, default=80, help="eval prompts per set (at most 80)")
    args = parser.parse_args(argv)
    if not 1 <= args.prompts <= 80:
        parser.error("--prompts must lie in [1, 80]")
    result = measure(args.sets, args.prompts)
    print(save_results("prefix_cache", result, write_markdown).read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
