"""`sample_tokens` with top-p on the default model's own logits: the nucleus searched with `torch.topk`
(`nucleus_threshold`) against sorting the whole vocabulary per row (the sampler before it), side by side.

    python -m benchmarks.sampling [--rounds 40]     # ~1 minute on 2 CPU cores

The logits are the default model's (bf16, fp32 logits): each prompt is decoded greedily for 16 tokens, then its
root and those 16 tokens are verified as one chain, which gives 17 rows of real next-token logits per prompt. Timed:
`sample_tokens` at temperature 0.8 with top_p 0.95 and 0.9 (and with top_p 1, no nucleus, for scale), on one row (a
plain decode step) and on 17 rows (a 16-node tree), medians of interleaved rounds; the full-sort reference runs the
same sampler with the old top-p filter. Also reported, row by row: the nucleus sizes, whether both keep the same
tokens (bf16 logits tie often; where tokens tie with the nucleus's least probable one, the sort kept those it happened
to put first and `nucleus_threshold` keeps them all), and whether they sample the same token where they keep the
same ones.

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
from trt_engines.sampling import nucleus_threshold, position_uniforms, sample_tokens
from trt_engines.torch_engine import TorchEngine

PROMPTS = ("def fibonacci(n):", "The capital of France is", "Write a short poem about the sea.",
           "import numpy as np\n\ndef normalize(x):")
SETTINGS = ((0.8, 0.95), (0.8, 0.9), (0.8, 1.0))  # (temperature, top_p)
BATCHES = (1, 17)


def _full_sort_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """The top-p filter before `nucleus_threshold`: sort each row's vocabulary (the reference)."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    drop = probs.cumsum(dim=-1) - probs >= top_p
    drop[:, 0] = False
    return logits.scatter(-1, order, sorted_logits.masked_fill(drop, -math.inf))


def _reference_sample(logits: torch.Tensor, params: SamplingParams, seed: int, positions: np.ndarray) -> torch.Tensor:
    """`sample_tokens` as it was before `nucleus_threshold` (temperature and top-p; no top-k here)."""
    logits = logits / params.temperature
    if params.top_p < 1.0:
        logits = _full_sort_filter(logits, params.top_p)
    cdf = logits.softmax(dim=-1).double().cumsum(dim=-1)
    uniforms = torch.from_numpy(position_uniforms(seed, positions))
    tokens = torch.searchsorted(cdf, (uniforms * cdf[:, -1]).unsqueeze(-1), right=True)[:, 0]
    return torch.minimum(tokens, (cdf < cdf[:, -1:]).sum(dim=-1))


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
    ways = {"topk": sample_tokens, "full_sort": _reference_sample}
    times = {(w, s, b): [] for w in ways for s in SETTINGS for b in BATCHES}
    for r in range(rounds):
        for (temperature, top_p) in SETTINGS:
            params = SamplingParams(temperature=temperature, top_p=top_p)
            for b in BATCHES:
                for w in (list(ways) if r % 2 == 0 else list(ways)[::-1]):
                    started = time.perf_counter()
                    for batch in batches[b]:
                        ways[w](batch, params, r, np.arange(batch.shape[0]))
                    times[(w, (temperature, top_p), b)].append((time.perf_counter() - started) / len(batches[b]))
    # What each way keeps and samples, row by row. bf16 logits tie often: where tokens tie with the nucleus's least
    # probable one, the full sort kept those its sort happened to put first, topk keeps them all.
    agreement = {}
    for temperature, top_p in SETTINGS[:-1]:
        scaled = logits / temperature
        probs = scaled.softmax(dim=-1)
        threshold = nucleus_threshold(probs, top_p)
        new = probs >= threshold
        old = _full_sort_filter(scaled, top_p) > -math.inf
        extra = new & ~old
        params = SamplingParams(temperature=temperature, top_p=top_p)
        positions = np.arange(17)
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
    for (temperature, top_p) in SETTINGS:
        for b in BATCHES:
            new = statistics.median(times[("topk", (temperature, top_p), b)])
            old = statistics.median(times[("full_sort", (temperature, top_p), b)])
            rows.append({"temperature": temperature, "top_p": top_p, "rows": b, "topk_ms": 1e3 * new,
                         "full_sort_ms": 1e3 * old, "full_sort_over_topk": old / new})
    return {"machine": cpu_description(), "threads": torch.get_num_threads(), "rounds": rounds,
            "logit_rows": int(logits.shape[0]), "agreement": agreement, "rows": rows}


def write_markdown(path, result: dict) -> None:
    lines = [
        "# sampling: top-p by topk against a full sort of the vocabulary",
        "",
        f"Command: `python -m benchmarks.sampling --rounds {result['rounds']}` on {result['machine']} "
        f"({result['threads']} threads). `sample_tokens` on {result['logit_rows']} rows of the default model's own "
        "logits (4 prompts, 17 positions each), medians of interleaved rounds; 'full sort' is the same sampler with "
        "the top-p filter it had before `nucleus_threshold`.",
        "",
        "| temperature | top_p | rows | topk ms | full sort ms | full sort / topk |",
        "|---|---|---|---|---|---|",
    ]
    lines += [f"| {r['temperature']} | {r['top_p']} | {r['rows']} | {r['topk_ms']:.2f} | {r['full_sort_ms']:.2f} | "
              f"{r['full_sort_over_topk']:.2f} |" for r in result["rows"]]
    lines += ["", "What each keeps and samples (temperature 0.8, all rows; 'the rest tie the edge': every token only "
              "topk keeps is exactly as probable as the nucleus's least probable one):", "",
              "| top_p | rows with the same kept set | full sort's set within topk's | the rest tie the edge | "
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
