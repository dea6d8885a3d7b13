"""Sampling on the default model's own logits, four ways side by side: `sample_tokens` as the CPU runs it (numba
kernels find the nucleus and invert the CDF); the CPU's sampler before those kernels (the nucleus by `torch.topk`,
then a masked copy of the logits, a second softmax and a float64 cumsum over the vocabulary); the same sampler as
the kernels' in PyTorch ops (what CUDA runs); and the sampler before `torch.topk` (it sorted the whole vocabulary of
every row for top-p).

    python -m benchmarks.sampling [--rounds 40]     # ~5 minutes on 2 CPU cores

The logits are the default model's (bf16, fp32 logits): each prompt is decoded greedily for 16 tokens, then its
root and those 16 tokens are verified as one chain, which gives 17 rows of real next-token logits per prompt. Timed:
temperature 0.8 with top_p 0.95 and 0.9, with top_p 1 (no nucleus), and with top_k 50 and top_p 0.9, on one row (a
plain decode step) and on 17 rows (a 16-node tree), medians of interleaved rounds; and a verify step's sampling for
16 one-row requests and for 4 requests of 5 rows, one `sample_tokens` call per request against one `sample_requests`
call for all. Checked, row by row over 50
seeds: whether the kernels sample the same tokens as the sampler before them and as the PyTorch ops (and find the
same nucleus floors); and against the full sort, whether both keep the same tokens (bf16 logits tie often; where
tokens tie with the nucleus's least probable one, the sort kept those it happened to put first and the nucleus
floor keeps them all) and whether they sample the same token where they keep the same ones.

Writes benchmarks/results/sampling.json and .md.
"""

from __future__ import annotations

import math
import statistics
import time

import numpy as np
import torch

from benchmarks.results_files import rounds_benchmark_main
from drafter.tree import DraftTree
from trt_engines.base import SamplingParams, VerifyItem
from trt_engines.cpu_kernels import cpu_description
from trt_engines.sampling import (_draw_by_cumsum, _nucleus_by_topk, nucleus_threshold, position_uniforms,
                                  sample_requests, sample_tokens)
from trt_engines.torch_engine import TorchEngine

PROMPTS = ("def fibonacci(n):", "The capital of France is", "Write a short poem about the sea.",
           "import numpy as np\n\ndef normalize(x):")
SETTINGS = ((0.8, 0.95, 0), (0.8, 0.9, 0), (0.8, 1.0, 0), (0.8, 0.9, 50))  # (temperature, top_p, top_k)
BATCHES = (1, 17)
SEEDS = 50
STEPS = ((16, 1), (4, 5))  # (requests, rows each) of a verify step: plain decoding at 16, small trees at 4


def _torch_ops_sample(logits: torch.Tensor, params: SamplingParams, seed: int, positions: np.ndarray) -> torch.Tensor:
    """`sample_tokens` with the PyTorch ops that CUDA runs in place of the CPU kernels."""
    logits = logits / params.temperature
    if params.top_k:
        logits = logits.masked_fill(logits < torch.topk(logits, params.top_k, dim=-1).values[:, -1:], -math.inf)
    probs = logits.softmax(dim=-1)
    floors = _nucleus_by_topk(probs, params.top_p) if params.top_p < 1.0 else None
    return _draw_by_cumsum(probs, floors, position_uniforms(seed, positions))


def _before_kernels_sample(logits: torch.Tensor, params: SamplingParams, seed: int,
                           positions: np.ndarray) -> torch.Tensor:
    """The CPU's `sample_tokens` before its numba kernels: the nucleus by `torch.topk`, then the logits masked to it,
    a second softmax and a float64 cumsum over the vocabulary, searched."""
    logits = logits / params.temperature
    if params.top_k:
        logits = logits.masked_fill(logits < torch.topk(logits, params.top_k, dim=-1).values[:, -1:], -math.inf)
    if params.top_p < 1.0:
        probs = logits.softmax(dim=-1)
        logits = logits.masked_fill(probs < _nucleus_by_topk(probs, params.top_p)[:, None], -math.inf)
    return _searched(logits.softmax(dim=-1).double().cumsum(dim=-1), position_uniforms(seed, positions))


def _searched(cdf: torch.Tensor, uniforms: np.ndarray) -> torch.Tensor:
    tokens = torch.searchsorted(cdf, (torch.from_numpy(uniforms) * cdf[:, -1]).unsqueeze(-1), right=True)[:, 0]
    return torch.minimum(tokens, (cdf < cdf[:, -1:]).sum(dim=-1))


def _full_sort_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """The top-p filter before `nucleus_threshold`: sort each row's vocabulary (the reference)."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    drop = probs.cumsum(dim=-1) - probs >= top_p
    drop[:, 0] = False
    return logits.scatter(-1, order, sorted_logits.masked_fill(drop, -math.inf))


def _reference_sample(logits: torch.Tensor, params: SamplingParams, seed: int, positions: np.ndarray) -> torch.Tensor:
    """`sample_tokens` as it was before `nucleus_threshold`: top-k, then top-p by a full sort, then a second softmax
    and a float64 cumsum."""
    logits = logits / params.temperature
    if params.top_k:
        logits = logits.masked_fill(logits < torch.topk(logits, params.top_k, dim=-1).values[:, -1:], -math.inf)
    if params.top_p < 1.0:
        logits = _full_sort_filter(logits, params.top_p)
    return _searched(logits.softmax(dim=-1).double().cumsum(dim=-1), position_uniforms(seed, positions))


def model_logits() -> torch.Tensor:
    from tokenizers import Tokenizer

    from trt_engines.prepare import resolve_model_dir

    engine = TorchEngine("default")
    tokenizer = Tokenizer.from_file(str(resolve_model_dir("default") / "tokenizer.json"))
    rows = []
    for i, text in enumerate(PROMPTS):
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        root = engine.add_request(f"plain-{i}", ids, SamplingParams())
        greedy = [root]
        for _ in range(16):
            out = engine.verify([VerifyItem(f"plain-{i}", DraftTree.empty())]).results[0].target_tokens
            engine.commit(f"plain-{i}", [], int(out[0]))
            greedy.append(int(out[0]))
        engine.release(f"plain-{i}")
        engine.add_request(f"chain-{i}", ids, SamplingParams())
        result = engine.verify([VerifyItem(f"chain-{i}", DraftTree.chain(greedy[1:]))], return_logits=True)
        rows.append(result.results[0].logits.float())
        engine.release(f"chain-{i}")
    return torch.cat(rows)


def measure(rounds: int) -> dict:
    logits = model_logits()
    batches = {b: [logits[i:i + b] for i in range(0, logits.shape[0] - b + 1, 17)] for b in BATCHES}
    ways = {"kernels": sample_tokens, "before": _before_kernels_sample, "torch_ops": _torch_ops_sample,
            "full_sort": _reference_sample}
    times = {(w, s, b): [] for w in ways for s in SETTINGS for b in BATCHES}
    for r in range(rounds):
        for setting in SETTINGS:
            temperature, top_p, top_k = setting
            params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
            for b in BATCHES:
                order = list(ways)
                for w in order[r % len(order):] + order[:r % len(order)]:
                    started = time.perf_counter()
                    for batch in batches[b]:
                        ways[w](batch, params, r, np.arange(batch.shape[0]))
                    times[(w, setting, b)].append((time.perf_counter() - started) / len(batches[b]))
    step_times = _step_times(logits, rounds)
    positions = np.arange(17)
    same_tokens = {}  # the kernels' tokens against the sampler before them and against the PyTorch ops, row by row
    for temperature, top_p, top_k in SETTINGS:
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
        drawn = [(sample_tokens(b, params, seed, positions), _before_kernels_sample(b, params, seed, positions),
                  _torch_ops_sample(b, params, seed, positions)) for seed in range(SEEDS) for b in batches[17]]
        probs = (logits / temperature).softmax(dim=-1)
        floors_same = (top_p == 1.0 or top_k != 0
                       or bool(torch.equal(nucleus_threshold(probs, top_p), _nucleus_by_topk(probs, top_p))))
        same_tokens[f"{temperature}/{top_p}/{top_k}"] = {
            "rows": len(drawn) * 17, "as_before": sum(int((k == b).sum()) for k, b, _ in drawn),
            "as_torch_ops": sum(int((k == t).sum()) for k, _, t in drawn), "same_floors_as_torch_ops": floors_same}
    # What the nucleus floor keeps against the full sort, row by row. bf16 logits tie often: where tokens tie with the
    # nucleus's least probable one, the full sort kept those its sort happened to put first, the floor keeps them all.
    agreement = {}
    for temperature, top_p, _ in SETTINGS[:2]:
        scaled = logits / temperature
        probs = scaled.softmax(dim=-1)
        threshold = nucleus_threshold(probs, top_p)[:, None]
        new = probs >= threshold
        old = _full_sort_filter(scaled, top_p) > -math.inf
        extra = new & ~old
        params = SamplingParams(temperature=temperature, top_p=top_p)
        same_sets = (new == old).all(dim=-1)
        tokens_new = torch.cat([sample_tokens(b, params, 7, positions) for b in batches[17]])
        tokens_old = torch.cat([_reference_sample(b, params, 7, positions) for b in batches[17]])
        kept = new.sum(dim=-1).numpy()
        agreement[str(top_p)] = {
            "rows_with_the_same_kept_set": int(same_sets.sum()),
            "extra_tokens_all_tie_the_edge": bool(((probs == threshold) | ~extra).all()),
            "full_sort_kept_a_subset": bool((old & ~new).sum() == 0),
            "same_token_where_the_sets_agree": bool((tokens_new == tokens_old)[same_sets].all()),
            "nucleus_tokens_median": float(np.median(kept)), "nucleus_tokens_p90": float(np.percentile(kept, 90)),
            "nucleus_tokens_max": int(kept.max())}
    rows = []
    for setting in SETTINGS:
        temperature, top_p, top_k = setting
        for b in BATCHES:
            ms = {w: 1e3 * statistics.median(times[(w, setting, b)]) for w in ways}
            rows.append({"temperature": temperature, "top_p": top_p, "top_k": top_k, "rows": b,
                         **{f"{w}_ms": v for w, v in ms.items()},
                         "before_over_kernels": ms["before"] / ms["kernels"],
                         "full_sort_over_kernels": ms["full_sort"] / ms["kernels"]})
    return {"machine": cpu_description(), "threads": torch.get_num_threads(), "rounds": rounds,
            "logit_rows": int(logits.shape[0]), "seeds": SEEDS, "same_tokens": same_tokens, "steps": step_times,
            "agreement": agreement, "rows": rows}


def _per_request(batch: torch.Tensor, requests: list) -> np.ndarray:
    parts = batch.split([len(positions) for _, _, positions in requests])
    return np.concatenate([sample_tokens(part, params, seed, positions).numpy()
                           for part, (params, seed, positions) in zip(parts, requests)])


def _step_times(logits: torch.Tensor, rounds: int) -> list[dict]:
    """A verify step's sampling with several sampled requests: one `sample_tokens` call per request (how the engine
    sampled before `sample_requests`) against one `sample_requests` call for all, interleaved; and whether every
    request's tokens agree."""
    params = SamplingParams(temperature=0.8, top_p=0.95)
    out = []
    for n_requests, rows in STEPS:
        batch = logits[: n_requests * rows]
        requests = [(params, 100 + i, np.arange(rows) + 7 * i) for i in range(n_requests)]
        ways = {"per_request": lambda: _per_request(batch, requests),
                "batched": lambda: sample_requests(batch, requests)}
        times = {w: [] for w in ways}
        for r in range(rounds * 4):
            for w in (list(ways) if r % 2 == 0 else list(ways)[::-1]):
                started = time.perf_counter()
                ways[w]()
                times[w].append(time.perf_counter() - started)
        ms = {w: 1e3 * statistics.median(v) for w, v in times.items()}
        out.append({"requests": n_requests, "rows_each": rows, "per_request_ms": ms["per_request"],
                    "batched_ms": ms["batched"], "per_request_over_batched": ms["per_request"] / ms["batched"],
                    "same_tokens": bool((ways["per_request"]() == ways["batched"]()).all())})
    return out


def write_markdown(path, result: dict) -> None:
    lines = [
        "# sampling: the CPU's kernels against the samplers before them",
        "",
        f"Command: `python -m benchmarks.sampling --rounds {result['rounds']}` on {result['machine']} "
        f"({result['threads']} threads). `sample_tokens` on {result['logit_rows']} rows of the default model's own "
        "logits (4 prompts, 17 positions each), medians of interleaved rounds. 'kernels': as the CPU runs it (numba "
        "finds the nucleus and inverts the CDF); 'before': the CPU's sampler before those kernels (the nucleus by "
        "`torch.topk`, a masked copy, a second softmax and a float64 cumsum over the vocabulary); 'torch ops': the "
        "kernels' sampler in PyTorch ops, as CUDA runs it; 'full sort': the sampler before `torch.topk`, which sorted "
        "every row's vocabulary for top-p.",
        "",
        "| temperature | top_p | top_k | rows | kernels ms | before ms | torch ops ms | full sort ms | "
        "before / kernels | full sort / kernels |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [f"| {r['temperature']} | {r['top_p']} | {r['top_k'] or '-'} | {r['rows']} | {r['kernels_ms']:.2f} | "
              f"{r['before_ms']:.2f} | {r['torch_ops_ms']:.2f} | {r['full_sort_ms']:.2f} | "
              f"{r['before_over_kernels']:.2f} | {r['full_sort_over_kernels']:.2f} |" for r in result["rows"]]
    lines += ["", f"The kernels' tokens against the others', every row under {result['seeds']} seeds:", "",
              "| temperature/top_p/top_k | rows | same token as before | same token as torch ops | "
              "same nucleus floors as torch ops |", "|---|---|---|---|---|"]
    for name, a in result["same_tokens"].items():
        lines.append(f"| {name} | {a['rows']} | {a['as_before']} | {a['as_torch_ops']} | "
                     f"{'yes' if a['same_floors_as_torch_ops'] else 'NO'} |")
    lines += ["", "A verify step's sampling with several requests (temperature 0.8, top_p 0.95, each its own seed): "
              "one call per request, as the engine sampled before `sample_requests`, against one call for all:", "",
              "| requests x rows | per request ms | batched ms | per request / batched | same tokens |",
              "|---|---|---|---|---|"]
    lines += [f"| {s['requests']} x {s['rows_each']} | {s['per_request_ms']:.2f} | {s['batched_ms']:.2f} | "
              f"{s['per_request_over_batched']:.2f} | {'yes' if s['same_tokens'] else 'NO'} |"
              for s in result.get("steps", [])]
    lines += ["", "What the nucleus floor and the full sort keep and sample (temperature 0.8, all rows; 'the rest tie "
              "the edge': every token only the floor keeps is exactly as probable as the nucleus's least probable "
              "one):", "",
              "| top_p | rows with the same kept set | full sort's set within the floor's | the rest tie the edge | "
              "same token where the sets agree | nucleus tokens: median, p90, max |", "|---|---|---|---|---|---|"]
    for p, a in result["agreement"].items():
        lines.append(f"| {p} | {a['rows_with_the_same_kept_set']} of {result['logit_rows']} | "
                     f"{'yes' if a['full_sort_kept_a_subset'] else 'NO'} | "
                     f"{'yes' if a['extra_tokens_all_tie_the_edge'] else 'NO'} | "
                     f"{'yes' if a['same_token_where_the_sets_agree'] else 'NO'} | "
                     f"{a['nucleus_tokens_median']:.0f}, {a['nucleus_tokens_p90']:.0f}, {a['nucleus_tokens_max']} |")
    lines.append("")
    path.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    return rounds_benchmark_main("sampling", __doc__, measure, write_markdown, argv)


if __name__ == "__main__":
    raise SystemExit(main())
