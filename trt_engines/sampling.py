"""How `TorchEngine` picks target tokens from a verify step's fp32 logits: argmax, or a seeded draw.

A sampled request's token at a position is a draw from the target's filtered distribution there (temperature,
top-k, top-p) by inverting its CDF at a uniform that depends on the request's seed and the position alone
(`position_uniforms`). Every row is computed on its own, by the same code whatever else shares its batch, so a draft
tree's node samples what plain decoding samples at that position: speculation returns plain decoding's very tokens.
`benchmarks/results/sampling.md` times it on the default model's logits.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from trt_engines.base import SamplingParams


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


def nucleus_threshold(probs: Tensor, top_p: float, *, first_k: int = 64) -> Tensor:
    """Per row of `probs` [R, V], the smallest probability in its nucleus: the most probable tokens, in descending
    order, while the mass before each is below `top_p` (at least one). Top-p sampling keeps every token at least that
    probable, ties at the edge included, so the kept set does not depend on how a sort orders equal probabilities.

    The nucleus is found among each row's `first_k` most probable tokens (`torch.topk`), and among 16 times as many
    for the rows whose top `first_k` hold less than `top_p` of the mass, and so on. A full sort of the vocabulary
    (49152 tokens) cost 4.8 ms a row on the 2-core AVX2 EPYC, ten times the rest of sampling, and 38.6 ms for a
    16-node tree's 17 rows, against 1.3 and 9.2 ms this way (`benchmarks/results/sampling.md`)."""
    rows, vocab = probs.shape
    threshold = torch.empty(rows, 1, dtype=probs.dtype, device=probs.device)
    left = torch.arange(rows, device=probs.device)
    k = min(first_k, vocab)
    while left.numel():
        top = torch.topk(probs[left], k, dim=-1).values  # descending
        mass = top.cumsum(dim=-1)
        # the prefix sums of a full sort's first k, to the bit: the same values added in the same order
        inside = (mass - top < top_p).sum(dim=-1).clamp(min=1)
        done = (mass[:, -1] >= top_p) | (k == vocab)  # the nucleus ends within these k
        threshold[left[done]] = top[done].gather(-1, (inside[done] - 1).unsqueeze(-1))
        left = left[~done]
        k = min(16 * k, vocab)
    return threshold


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
    random."""
    if params.greedy:
        return torch.from_numpy(greedy_tokens(logits))
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if params.top_p < 1.0:
        probs = logits.softmax(dim=-1)
        logits = logits.masked_fill(probs < nucleus_threshold(probs, params.top_p), -math.inf)
    cdf = logits.softmax(dim=-1).double().cumsum(dim=-1)
    uniforms = torch.from_numpy(position_uniforms(seed, positions)).to(cdf.device)
    # the first token whose cumulative mass passes u times the total: one with mass > 0, as the CDF rises there
    tokens = torch.searchsorted(cdf, (uniforms * cdf[:, -1]).unsqueeze(-1), right=True)[:, 0]
    return torch.minimum(tokens, (cdf < cdf[:, -1:]).sum(dim=-1))  # a rounding at the very top: the last such token
