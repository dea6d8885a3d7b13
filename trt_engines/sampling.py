"""How `TorchEngine` picks target tokens from a verify step's fp32 logits: argmax, or a seeded draw.

A sampled request's token at a position is a draw from the target's filtered distribution there (temperature,
top-k, top-p) by inverting its CDF at a uniform that depends on the request's seed and the position alone
(`position_uniforms`). Every row is computed on its own, by the same code whatever else shares its batch, so a draft
tree's node samples what plain decoding samples at that position: speculation returns plain decoding's very tokens.
On the CPU two numba kernels find the nucleus and invert the CDF; elsewhere PyTorch ops do the same, with the same
results to rounding. `benchmarks/results/sampling.md` times both ways on the default model's logits.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from numba import njit, prange
from torch import Tensor

from trt_engines.base import SamplingParams, TokenLogprobs


def greedy_tokens(logits: Tensor) -> np.ndarray:
    """The argmax of each row of `logits` [R, V] as int32: the first maximum, a NaN counting as the maximum (as
    torch's argmax). On the CPU through numpy's argmax, which took a tenth of the time of torch's over SmolLM2's
    49152-token vocabulary (one-off, 2-core AVX2 EPYC, torch 2.13: 7 vs 62 us for one row, 28 vs 342 us for five)."""
    if logits.device.type == "cpu":
        return np.argmax(logits.numpy(), axis=-1).astype(np.int32)
    return logits.argmax(dim=-1).to(torch.int32).cpu().numpy()


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mixed(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser over uint64s (wrapping arithmetic): every output bit depends on every input bit."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def position_uniforms(seed: int, positions: np.ndarray) -> np.ndarray:
    """The uniform in [0, 1) that a request with sampling seed `seed` samples the token at each of `positions` with:
    a hash of (seed, position), 53 bits (float64). A function of the two alone, so the token sampled at a position
    depends on the target's distribution there and on nothing else: not on how many other rows a step verifies, nor
    on which draft tree, nor on how many draws earlier steps took (`sample_tokens`)."""
    key = _mixed(np.array([seed], np.uint64) + _GOLDEN)
    mixed = _mixed(key + (np.asarray(positions, np.uint64) + np.uint64(1)) * _GOLDEN)
    return (mixed >> np.uint64(11)).astype(np.float64) * 2.0 ** -53


def nucleus_threshold(probs: Tensor, top_p: float | np.ndarray) -> Tensor:
    """Per row of `probs` [R, V] (fp32), the smallest probability in its nucleus: the most probable tokens, in
    descending order, while the mass before each is below `top_p` (at least one; the prefix sums of PyTorch's
    cumsum over a full sort). Top-p sampling keeps every token at least that probable, ties at the edge included, so
    the kept set does not depend on how a sort orders equal probabilities. `top_p`: one for every row, or one per
    row (a row of top_p 1 gets 0: every token). Returns [R].

    Neither way sorts the vocabulary: the sampler that sorted it (49152 tokens) took 4.7 ms for a row on the 2-core
    AVX2 EPYC, and 38.3 ms for a 16-node tree's 17 rows (`benchmarks/results/sampling.md`). On the CPU a numba kernel sorts only the
    tokens within a factor 16, 256, ... of the row's most probable one, until they hold `top_p` (`_nucleus_floors`);
    elsewhere `torch.topk` widens the same way (`_nucleus_by_topk`)."""
    top_p = np.broadcast_to(np.asarray(top_p, np.float32), probs.shape[:1])
    if probs.device.type == "cpu":
        floors = np.empty(probs.shape[0], np.float32)
        _nucleus_floors(probs.contiguous().numpy(), np.ascontiguousarray(top_p), floors)
        return torch.from_numpy(floors)
    return _nucleus_by_topk(probs, top_p)


def _nucleus_by_topk(probs: Tensor, top_p: float | np.ndarray, *, first_k: int = 64) -> Tensor:
    """`nucleus_threshold` in PyTorch ops: among each row's `first_k` most probable tokens (`torch.topk`), and among
    16 times as many for the rows whose top `first_k` hold less than `top_p` of the mass, and so on."""
    rows, vocab = probs.shape
    top_p = torch.from_numpy(np.array(np.broadcast_to(np.asarray(top_p, np.float32), (rows,)))).to(probs.device)
    threshold = torch.zeros(rows, dtype=probs.dtype, device=probs.device)
    left = torch.nonzero(top_p < 1.0)[:, 0]
    k = min(first_k, vocab)
    while left.numel():
        top = torch.topk(probs[left], k, dim=-1).values  # descending
        mass = top.cumsum(dim=-1)
        # the prefix sums of a full sort's first k, to the bit: the same values added in the same order
        inside = (mass - top < top_p[left, None]).sum(dim=-1).clamp(min=1)
        done = (mass[:, -1] >= top_p[left]) | (k == vocab)  # the nucleus ends within these k
        threshold[left[done]] = top[done].gather(-1, (inside[done] - 1).unsqueeze(-1))[:, 0]
        left = left[~done]
        k = min(16 * k, vocab)
    return threshold


@njit(parallel=True, boundscheck=False, cache=True)
def _nucleus_floors(probs, top_ps, out):
    """`nucleus_threshold` on the CPU into `out`, row r with top_p `top_ps[r]` (1: every token, a floor of 0). Per
    row: its maximum, then the tokens at least a 16th as probable and the mass they hold, in one pass; where that
    reaches `top_p`, only they are sorted and their prefix sums taken as PyTorch's cumsum of a full sort would take
    them, to the bit, else the cutoff drops 16-fold. Those prefix sums decide: where they fall short of `top_p` by
    rounding, the cutoff drops too (down to every token).
    A row without a positive maximum (NaN logits) gets a floor of 0; NaNs beside it are never candidates."""
    rows, vocab = probs.shape
    for r in prange(rows):
        row, top_p = probs[r], top_ps[r]
        if top_p >= 1.0:  # no nucleus: every token
            out[r] = 0.0
            continue
        top = row[0]
        for v in range(1, vocab):
            top = max(top, row[v])
        if not top > 0.0:
            out[r] = 0.0
            continue
        cutoff = top / np.float32(16.0)
        while True:
            count, mass = 0, 0.0
            for v in range(vocab):
                if row[v] >= cutoff:
                    count += 1
                    mass += row[v]
            final = count == vocab or cutoff == 0.0  # every token with a probability in it
            if mass >= top_p or final:
                candidates = np.empty(count, np.float32)
                i = 0
                for v in range(vocab):
                    if row[v] >= cutoff:
                        candidates[i] = row[v]
                        i += 1
                candidates.sort()
                running = 0.0  # PyTorch's CPU cumsum of fp32: a float64 running sum, each prefix rounded to fp32
                inside = 0
                for j in range(count - 1, -1, -1):  # descending
                    running += candidates[j]
                    if np.float32(np.float32(running) - candidates[j]) < top_p:  # `_nucleus_by_topk`'s mass before
                        inside += 1
                if np.float32(running) >= top_p or final:
                    out[r] = candidates[count - max(inside, 1)]
                    break
            cutoff = cutoff / np.float32(16.0)


def sample_tokens(logits: Tensor, params: SamplingParams, seed: int | None, positions: np.ndarray) -> Tensor:
    """One target token per row of `logits` [R, V] (fp32): argmax, or a draw from the filtered softmax, row r
    sampling the token at `positions[r]` by inverting its distribution's CDF at `position_uniforms(seed, ...)`.

    The draw at a position is thus fixed by the request's seed and the distribution there. In a draft tree every
    node at one depth samples the same position with the same uniform, and the accepted path's prefix is what plain
    decoding would have sampled, so speculation returns plain decoding's very tokens, not only their distribution;
    and a seeded request is reproducible whatever drafts its steps verified (a stream of draws shared by all of a
    request's rows was consumed faster or slower with the tree sizes, so a second request with the same seed, whose
    drafter had learnt from the first, sampled other tokens). Each token is still an exact draw from the target's
    distribution: the uniforms of one request's positions are independent, and unseeded requests draw their seed at
    random. One request's rows of `sample_requests`."""
    return torch.from_numpy(sample_requests(logits, [(params, seed, np.asarray(positions))]))


def sample_requests(logits: Tensor, requests: Sequence[tuple[SamplingParams, int | None, np.ndarray]]) -> np.ndarray:
    """`sample_tokens` for a verify step's requests at once: `requests[i]` = (sampling, seed, positions) owns the
    next len(positions) rows of `logits` [R, V]. Returns int64 [R]. Each row's token depends on its own row, params,
    seed and position alone, whatever else the call holds: the filters, the softmax and the kernels all work row by
    row. One call rather than one per request: 3.3 against 8.0 ms for 16 one-row requests, 3.4 against 4.3 for 4
    requests of 5 rows (`benchmarks/results/sampling.md`)."""
    sizes = [len(positions) for _, _, positions in requests]
    if sum(sizes) != logits.shape[0]:
        raise ValueError(f"the requests own {sum(sizes)} rows; logits has {logits.shape[0]}")
    if all(params.greedy for params, _, _ in requests):
        return greedy_tokens(logits).astype(np.int64)
    tokens = np.empty(logits.shape[0], np.int64)
    drawn = [request for request in requests if not request[0].greedy]
    if len(drawn) < len(requests):  # greedy requests beside sampled ones: their argmax, the rest gathered
        starts = np.cumsum([0, *sizes])
        keep = np.zeros(len(tokens), bool)
        for (params, _, _), start, stop in zip(requests, starts[:-1], starts[1:]):
            if params.greedy:
                tokens[start:stop] = greedy_tokens(logits[start:stop])
            else:
                keep[start:stop] = True
        rows = logits[torch.from_numpy(keep).to(logits.device)]
    else:
        keep, rows = slice(None), logits
    drawn_sizes = [len(positions) for _, _, positions in drawn]

    def per_row(values: list, dtype) -> np.ndarray:  # a value per sampled request -> one per row it owns
        return np.repeat(np.array(values, dtype), drawn_sizes)

    temperature = torch.from_numpy(per_row([params.temperature for params, _, _ in drawn], np.float32))
    scaled = rows.float() / temperature.to(rows.device)[:, None]  # the kernels take fp32 (the engine's logits are)
    if any(0 < params.top_k < scaled.shape[-1] for params, _, _ in drawn):
        # each row's k-th largest logit (-inf: no top-k cut), then one `torch.where` over every row, rather than each
        # top_k's masked rows written back through an index: 0.75x the time for 17 rows at top_k 50 (one-off
        # interleaved A/B, the same tokens, 2-core AVX2 EPYC; an in-place `masked_fill_` took twice `torch.where`'s
        # time there). `sampling.md` has the time.
        top_k = per_row([params.top_k for params, _, _ in drawn], np.int64)
        kth = torch.full((scaled.shape[0], 1), -math.inf, device=scaled.device)
        for k in set(top_k[(top_k > 0) & (top_k < scaled.shape[-1])].tolist()):  # rows of one top_k: one call
            at = torch.from_numpy(np.flatnonzero(top_k == k)).to(scaled.device)
            part = scaled if at.numel() == scaled.shape[0] else scaled[at]
            kth[at] = torch.topk(part, k, dim=-1).values[:, -1:]
        scaled = torch.where(scaled < kth, -math.inf, scaled)
    probs = scaled.softmax(dim=-1)
    # top-p keeps the tokens at least as probable as the nucleus's least probable one; the draw renormalizes them
    floors = (nucleus_threshold(probs, per_row([params.top_p for params, _, _ in drawn], np.float32))
              if any(params.top_p < 1.0 for params, _, _ in drawn) else None)
    uniforms = np.concatenate([position_uniforms(seed, positions) for _, seed, positions in drawn])
    tokens[keep] = draw_tokens(probs, floors, uniforms).cpu().numpy()
    return tokens


def token_logprobs(logits: Tensor, tokens: np.ndarray, k: int) -> TokenLogprobs:
    """Per row of `logits` [R, V]: the log probability of `tokens[r]` and the k most likely tokens' (most likely
    first), under log_softmax of the logits themselves (the model's distribution, before any sampling filter).
    PyTorch's log_softmax works row by row (a row's bits do not depend on the rows beside it), so a position's log
    probabilities are the same verified in any tree or batch as decoded plainly, where its logits are."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    index = torch.as_tensor(np.asarray(tokens, np.int64), device=logprobs.device)[:, None]
    chosen = logprobs.gather(1, index)[:, 0]
    top_logprobs, top_ids = torch.topk(logprobs, k, dim=-1)
    return TokenLogprobs(chosen.cpu().numpy(), top_ids.cpu().numpy(), top_logprobs.cpu().numpy())


def compile_cpu_kernels() -> None:
    """Compile the CPU sampler's kernels (8 s on the 2-core AVX2 EPYC without numba's cache, one-off) or load them
    from the cache, so a server pays that at start-up rather than at its first sampled request, stalling its batch."""
    sample_tokens(torch.zeros(1, 8), SamplingParams(temperature=1.0, top_p=0.5), 0, np.zeros(1, np.int64))


def draw_tokens(probs: Tensor, floors: Tensor | None, uniforms: np.ndarray) -> Tensor:
    """Per row r of `probs` [R, V] (fp32), the token whose cumulative kept mass first passes `uniforms[r]` times the
    row's kept mass, in vocabulary order (float64 sums); kept: probability > 0 and >= `floors[r]` (None: every
    token). Renormalizing by that mass samples the filtered distribution without a second softmax. On the CPU a
    numba kernel (`_invert_cdfs`), elsewhere PyTorch's cumsum; each row's draw depends on that row alone either way."""
    if probs.device.type == "cpu":
        tokens = np.empty(probs.shape[0], np.int64)
        floors = np.zeros(probs.shape[0], np.float32) if floors is None else floors.contiguous().numpy()
        _invert_cdfs(probs.contiguous().numpy(), floors, np.ascontiguousarray(uniforms, np.float64), tokens)
        return torch.from_numpy(tokens)
    return _draw_by_cumsum(probs, floors, uniforms)


def _draw_by_cumsum(probs: Tensor, floors: Tensor | None, uniforms: np.ndarray) -> Tensor:
    """`draw_tokens` in PyTorch ops (CUDA): a float64 CDF over the whole vocabulary, searched."""
    kept = probs if floors is None else torch.where(probs >= floors[:, None], probs, 0.0)
    cdf = kept.double().cumsum(dim=-1)
    target = torch.from_numpy(np.asarray(uniforms, np.float64)).to(cdf.device) * cdf[:, -1]
    # the first token whose cumulative mass passes u times the total: one with mass > 0, as the CDF rises there
    tokens = torch.searchsorted(cdf, target.unsqueeze(-1), right=True)[:, 0]
    return torch.minimum(tokens, (cdf < cdf[:, -1:]).sum(dim=-1))  # a rounding at the very top: the last such token


_CDF_BLOCK = 256  # tokens per partial sum of `_invert_cdfs`: 192 blocks over SmolLM2's vocabulary


@njit(inline="always")
def _kept_mass(p, floor):
    return p if p >= floor and p > 0.0 else 0.0


@njit(inline="always")
def _block_mass(row, floor, start, stop):
    """The kept mass of row[start:stop] in float64, over four running sums (a chain of dependent adds per token
    was most of the kernel's time)."""
    a0 = a1 = a2 = a3 = 0.0
    v = start
    while v + 4 <= stop:
        a0 += _kept_mass(row[v], floor)
        a1 += _kept_mass(row[v + 1], floor)
        a2 += _kept_mass(row[v + 2], floor)
        a3 += _kept_mass(row[v + 3], floor)
        v += 4
    while v < stop:
        a0 += _kept_mass(row[v], floor)
        v += 1
    return (a0 + a1) + (a2 + a3)


@njit(parallel=True, boundscheck=False, cache=True)
def _invert_cdfs(probs, floors, uniforms, out):
    """`draw_tokens` on the CPU into `out`: one fused pass of float64 block sums over each row, then a scan of the
    one block the draw falls in, where PyTorch took a masked copy, a second softmax, a float64 copy, a cumsum over
    the whole vocabulary and a search (with `_nucleus_floors`: 3.1 against 8.9 ms for 17 rows at top_p 0.95, 1.6
    against 2.9 at top_p 1; `benchmarks/results/sampling.md`).
    Each row is computed alone, in the same order whatever else the batch holds. Where rounding leaves the draw
    past the block sums' or the block's last sum, it is the last kept token before that point; a row with no kept
    mass (NaN logits) draws token 0."""
    rows, vocab = probs.shape
    blocks = (vocab + _CDF_BLOCK - 1) // _CDF_BLOCK
    for r in prange(rows):
        row, floor = probs[r], floors[r]
        sums = np.empty(blocks)
        total = 0.0
        for b in range(blocks):
            sums[b] = _block_mass(row, floor, b * _CDF_BLOCK, min(vocab, (b + 1) * _CDF_BLOCK))
            total += sums[b]
        target = uniforms[r] * total
        chosen, block, before, passed = 0, -1, 0.0, 0.0
        for b in range(blocks):
            if sums[b] > 0.0:
                block, before = b, passed
                if passed + sums[b] > target:
                    break
                passed += sums[b]
        if block >= 0:
            for v in range(block * _CDF_BLOCK, min(vocab, (block + 1) * _CDF_BLOCK)):
                p = _kept_mass(row[v], floor)
                if p > 0.0:
                    chosen = v
                    before += p
                    if before > target:
                        break
        out[r] = chosen
