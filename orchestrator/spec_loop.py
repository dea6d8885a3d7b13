"""A minimal speculative generation loop over a fixed list of requests (no scheduler): tests and benchmarks use it.

Each step: ask `draft_fn(request_id, tokens_so_far)` for a tree per live request (None = plain decoding, one token
per step), verify all trees in one engine call, accept, commit, and append the new tokens. A request stops after
`max_new_tokens` tokens or at an EOS token (which is kept in its output).

Example:

    outputs, stats = generate(engine, [[1, 2, 3], [4, 5]], max_new_tokens=16, sampling=SamplingParams())
    outputs[0]        # 16 generated token ids (fewer if EOS came first)
    stats[0].steps    # verify calls this request took part in; stats[0].accepted = draft tokens accepted
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from drafter.tree import DraftTree
from orchestrator.acceptance import accept
from trt_engines.base import SamplingParams, TargetEngine, VerifyItem

DraftFn = Callable[[object, list[int]], DraftTree]


@dataclass
class RequestStats:
    steps: int = 0  # verify calls
    accepted: int = 0  # draft tokens accepted (bonus tokens not counted)
    drafted: int = 0  # draft nodes sent


def generate(
    engine: TargetEngine,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    sampling: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
    draft_fn: DraftFn | None = None,
    stop_at_eos: bool = True,
    id_prefix: str = "gen",
) -> tuple[list[list[int]], list[RequestStats]]:
    """Generate for every prompt at once; returns (generated token lists, per-request stats)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1; got {max_new_tokens}")
    params = [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else list(sampling)
    if len(params) != len(prompts):
        raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
    eos = set(engine.eos_token_ids) if stop_at_eos else set()
    ids = [f"{id_prefix}-{i}" for i in range(len(prompts))]
    outputs: list[list[int]] = [[] for _ in prompts]
    stats = [RequestStats() for _ in prompts]
    live: list[int] = []
    try:
        for i, (rid, prompt) in enumerate(zip(ids, prompts)):
            first = engine.add_request(rid, prompt, params[i])
            outputs[i].append(first)
            live.append(i)
        live = [i for i in live if not _done(outputs[i], max_new_tokens, eos)]
        while live:
            trees = {}
            for i in live:
                tree = draft_fn(ids[i], list(prompts[i]) + outputs[i]) if draft_fn else DraftTree.empty()
                trees[i] = tree
            out = engine.verify([VerifyItem(ids[i], trees[i]) for i in live])
            for i, result in zip(live, out.results):
                acc = accept(trees[i], result.target_tokens)
                engine.commit(ids[i], acc.accepted_nodes, next_root=acc.bonus_token)
                stats[i].steps += 1
                stats[i].drafted += len(trees[i])
                for tok in acc.new_tokens.tolist():
                    if _done(outputs[i], max_new_tokens, eos):
                        break
                    outputs[i].append(tok)
                    if tok in eos:
                        break
                stats[i].accepted += acc.num_accepted
            live = [i for i in live if not _done(outputs[i], max_new_tokens, eos)]
    finally:
        for rid in ids:
            try:
                engine.release(rid)
            except ValueError:  # never added (its add_request failed) or already gone
                pass
    return outputs, stats


def _done(out: list[int], max_new_tokens: int, eos: set[int]) -> bool:
    return len(out) >= max_new_tokens or (bool(out) and out[-1] in eos)
