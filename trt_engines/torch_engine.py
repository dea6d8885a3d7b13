"""`TorchEngine`: the reference `TargetEngine` in plain PyTorch (CPU, or CUDA when present), paged KV, tree verify.

One `verify` = one forward for the whole batch. Every request contributes the segment [root, nodes...]; the
segments are packed along the token axis for every linear layer (no padding). Attention is the only per-request
part: each request reads its cached context plus its own new tokens, through a mask in which every node sees the
context, the root, its ancestors and itself (`DraftTree.attention_mask`). That part runs as a few padded attention
calls per layer, each over requests of similar shape (`trt_engines.attention_groups`: queries padded to the call's
largest segment, keys to its longest context, gathered block by block), so one deep tree does not make the whole
batch compute its rows.

KV bookkeeping for one request with `ctx_len` cached tokens and a tree of n nodes:

    slots:  [0 .. ctx_len)            context (positions 0..ctx_len-1)
            ctx_len                   root       (position ctx_len)
            ctx_len + 1 + i           node i     (position ctx_len + depth[i])   <- temporary, written by verify
    commit(accepted=[a0, a1]):        slots of root, a0, a1 move to ctx_len, ctx_len+1, ctx_len+2; ctx_len += 3;
                                      blocks past the new context return to the free list.

A request may be verified again before `commit` (the temporary slots are simply overwritten).

Batch invariance (`batch_invariant`, default for bf16 on the CPU): a token's bf16 logits come out bitwise the same
whether it is decoded alone, verified in a tree, or batched next to other requests, so speculative decoding in bf16
emits exactly plain decoding's text, and every policy of a benchmark decodes the same text (without it, the fused
kernels' shape-dependent rounding flips near-tied logits and most long outputs drift from plain decoding's). Three
implementations (`cpu_kernels`), measured side by side by `benchmarks/batch_invariance.py`:

CPU kernels ("numba", `trt_engines.cpu_kernels`; what "auto" picks for bf16 on CPUs without AMX-BF16,
`cpu_kernels.auto_cpu_kernels`): numba kernels for every linear layer and for verify attention, batch-invariant by
construction. "attention" ("auto" on CPUs with AMX-BF16, where PyTorch's linear layers are the faster ones from a
few rows on) runs the numba attention with PyTorch's linear layers, computed in the form whose rows oneDNN keeps
batch-invariant (`llama.Linear.transposed`; only on CPUs with bf16 dot-product instructions). Attention reads each
request's keys in place in the paged pool (no gather, no padding: `attention_layout` "packed"), and every row
attends over exactly the keys it may see, in slot order, so a token gets plain decoding's logits on any branch of a
tree, not only on first-child chains: bf16 speculation is then lossless outright. Slots keep the tree's own order. With either, a verify step runs the
whole forward over bf16 bits (`trt_engines.cpu_forward`: RMSNorm, RoPE and the K/V writes, SwiGLU and the residual
adds as a few numba calls per layer instead of ~60 small PyTorch ops; a plain step of SmolLM2-135M went from 33.9
to 16.5 ms on a 2-core AVX2 CPU with the numba linear layers, `verify_cost.md` at c7fd3fb and 768bb92). Without
bf16 dot-product instructions PyTorch's bf16 linear layers are not batch-invariant even in that form (on an AVX2
EPYC, "attention" and "torch" gave logits 0.125-0.25 apart between plain decoding and tree steps; the engine tests
skip them there): only "numba", what "auto" picks there, is.

PyTorch's kernels in batch-invariant numerics ("torch"): on the CPU with SmolLM2-135M, 82-92% of the speculating
policies' outputs equal plain decoding's (39-60% with the fused kernels). Three parts:
- linear layers in their batch-invariant form (`llama.Linear`);
- attention is two bf16 matmuls around an fp32 softmax (`_batch_invariant_attention`) instead of the fused SDPA
  kernel, whose blocking follows the call's shape;
- tree slots are laid out depth-first (`DraftTree.depth_first_order`), so an accepted path that always takes the
  first (most probable) child has its keys at the positions plain decoding gives them. A path that leaves the
  first-child chain sees its later keys behind masked-out siblings; its sums run in another order and can differ in
  the last bit (the output is still lossless against the tree step's own logits).
Prefills stay on the fused kernel: each runs one request alone, the same way for every policy.

Prefills with the CPU kernels ("numba") run the verify step's batch-invariant forward too: a prompt is then a chain
verified over whatever context is cached, so its K/V and first token do not depend on how it is split. That makes
prefix caching exact (`PagedKVCache`, on by default there): a prompt whose leading blocks an earlier request
computed reads them from the cache and computes only the rest, and decodes bitwise as if computed whole. The
kernels' attention visits only the keys a row can see, so a causal prefill costs about what SDPA's does (one-off
timings, in the note of the change that made it so; `prefix_cache.md` times prefills with the cache on and off).
Released requests publish their output's full blocks as well, so a next chat turn, whose prompt repeats the last
one's, reuses them.
"""

from __future__ import annotations

import contextlib
import math
import os
import secrets
import time
import warnings
from collections.abc import KeysView
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from drafter.tree import DraftTree, InvalidTreeError
from trt_engines.base import (
    InvalidField,
    KVCacheFullError,
    RequestError,
    SamplingParams,
    TokenLogprobs,
    VerifyItem,
    VerifyOutput,
    VerifyResult,
    check_chunk_tokens,
    check_cpu_kernels,
    check_new_request,
)
from trt_engines.attention_groups import call_cost_for, plan_attention_groups
from trt_engines.cpu_forward import FusedCpuDecoder
from trt_engines.cpu_kernels import (
    Bf16Linear, TreeAttentionLayout, auto_cpu_kernels, bf16_bits, cpu_has_native_bf16, tree_attention,
)
from trt_engines.kv_cache import PagedKVCache
from trt_engines.llama import Linear, Transformer
from trt_engines.prepare import resolve_model_dir
from trt_engines.sampling import greedy_tokens, sample_requests, sample_tokens, token_logprobs


@dataclass
class _Request:
    sampling: SamplingParams
    seed: int | None  # the sampling seed (`sample_tokens`); None for greedy requests
    ctx_len: int  # tokens whose K/V are cached
    root: int  # last accepted token, not cached yet
    pending: DraftTree | None = None  # tree of the last verify, until commit
    slot_of: np.ndarray | None = None  # pending node -> its slot offset when laid out in another order
    cached_prompt: int = 0  # prompt tokens whose K/V came from the prefix cache
    cache_salt: str | None = None
    committed: list[np.ndarray] | None = None  # with prefix caching: the cached tokens, in runs (prompt, commits)
    prompt: np.ndarray | None = None  # while the prompt is prefilled in chunks: all of it (ctx_len tokens are in)
    first_logprobs: TokenLogprobs | None = None  # the first token's, with `sampling.logprobs`, until taken


@dataclass(frozen=True)
class _Segment:
    """One sequence of a packed forward: `tokens` at `positions`, written to slots ctx_len.., seeing the context and
    the new tokens through `local_mask` [T, T]."""

    request_id: object
    ctx_len: int
    tokens: np.ndarray  # int64 [T]
    positions: np.ndarray  # int64 [T]
    local_mask: np.ndarray  # bool [T, T]


class _AttentionCall:
    """One attention call over some requests of a step: their blocks, padded query rows and mask. `whole_blocks`:
    the keys are every slot of the gathered blocks (the last block's unused slots masked), so the matmuls read the
    gathered keys in place instead of a strided slice of them."""

    def __init__(self, cache: PagedKVCache, segments: Sequence[_Segment], members: np.ndarray, offsets: np.ndarray,
                 *, group: int, dtype: torch.dtype, device: torch.device, whole_blocks: bool = False):
        lens = [len(segments[i].tokens) for i in members]
        self.B, self.Tq = len(members), max(lens)
        self.L = max(segments[i].ctx_len + n for i, n in zip(members, lens))
        self.n_blocks = cache.blocks_needed(self.L)
        if whole_blocks:
            self.L = self.n_blocks * cache.block_size
        blocks = np.zeros((self.B, self.n_blocks), np.int64)  # pad with block 0; its keys are masked out below
        mask = np.zeros((self.B, self.Tq, self.L), bool)
        for b, (i, n) in enumerate(zip(members, lens)):
            s = segments[i]
            table = cache.block_table(s.request_id, s.ctx_len + n)
            blocks[b, : len(table)] = table
            mask[b, :n, : s.ctx_len] = True
            mask[b, :n, s.ctx_len : s.ctx_len + n] = s.local_mask
            mask[b, n:, 0] = True  # padded query rows: see one key so softmax stays finite; rows are dropped
        self.blocks = cache.head_block_ids(blocks.reshape(-1))
        # Packed rows of this call's tokens, and (when rows are padded) the packed row each padded row reads:
        # a pad row repeats its request's first row, whose output is dropped.
        rows = np.concatenate([offsets[i] + np.arange(n) for i, n in zip(members, lens)])
        self.identity = len(members) == len(segments) and np.array_equal(members, np.arange(len(segments)))
        self.padded = not all(n == self.Tq for n in lens)
        self.rows = torch.as_tensor(rows, device=device)
        if self.padded:
            src = np.concatenate([offsets[i] + np.minimum(np.arange(self.Tq), n - 1) for i, n in zip(members, lens)])
            keep = np.concatenate([b * self.Tq + np.arange(n) for b, n in enumerate(lens)])
            self.src = torch.as_tensor(src, device=device)
            self.keep = torch.as_tensor(keep, device=device)
        if mask.all():
            self.mask = None  # plain decoding at equal context lengths: everything visible
        else:
            # Additive mask in the compute dtype, made once: a bool mask would be converted inside every layer's SDPA.
            m = torch.zeros(mask.shape, dtype=dtype).masked_fill_(torch.as_tensor(~mask), -math.inf).to(device)
            # GQA: the `group` query heads sharing a KV head are stacked along the query axis; one mask for every
            # KV head (the leading axis, see `_PagedAttention.__call__`).
            self.mask = m[None, :, None].expand(1, self.B, group, self.Tq, self.L).reshape(
                1, self.B, group * self.Tq, self.L)


# SDPA backends the engine lets PyTorch choose from on CUDA: all but cuDNN. Recent PyTorch builds put cuDNN attention
# first on Hopper (`check_prefer_cudnn_attention` in ATen's sdp_utils.cpp), and cuDNN builds an execution graph for
# every new problem shape (batch, query rows, keys) before running it, tens of ms of host time, cached per shape. A
# serving step's keys grow every step and its trees change the query rows, so speculating runs keep meeting new shapes.
# On an H200 with Llama-3.1-8B's shape, 32 requests at cap 16, the first `fixed:4` run in a process took 74-80 ms a
# verify step (its plain steps too) against plain decoding's 26-28, and the same run repeated in the same process
# 25-27 ms (27-32 with a tree in the batch); with cuDNN left out the first run took 39.6 ms against plain decoding's
# 34.7 (one-off runs, their output in `benchmarks/results/gpu_first_runs_h200_oneoff.txt`). The memory-efficient kernel
# takes the same masks with no per-shape setup: on an H100 (`gpu_sdpa_backends.md`, each choice in its own process, two
# passes over the same prompts) PyTorch's order took 114 ms (cap 1) and 66 ms (cap 16) a tree step in its first pass
# and 22 and 29 in its second, while this choice's first pass was no slower than its second, and cuDNN with its shapes
# built was not faster on plain steps beyond the host's noise.
SHAPE_STABLE_SDPA_BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


def sdpa_backends_for(device: torch.device) -> contextlib.AbstractContextManager:
    """The context a forward on `device` runs its SDPA calls in: on CUDA, every backend but cuDNN
    (`SHAPE_STABLE_SDPA_BACKENDS`); elsewhere PyTorch's own choice. PyTorch's switches are process-wide; the engine's
    forwards never overlap (a pipelined verify ends before the orchestrator's next step), so each forward keeps them
    from start to end, and they are as they were after it."""
    if device.type == "cuda":
        return sdpa_kernel(list(SHAPE_STABLE_SDPA_BACKENDS))
    return contextlib.nullcontext()


def _batch_invariant_attention(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None) -> Tensor:
    """SDPA's result ([..., rows, D]) computed so that a query row's output never depends on the other rows of the
    call, on the other requests in it, or on how many masked keys follow its own.

    The fused SDPA kernel splits queries and keys into blocks whose sizes follow the call's shape, so the same token
    gets last-bit-different attention in a plain step and in a step that verifies a tree, or next to a request with
    a longer context; in bf16 that is enough to flip near-tied logits and let speculative and plain decoding emit
    different text. Here the two products are separate bf16 matmuls (fp32 accumulation inside) around an fp32
    softmax. Measured with oneDNN's bf16 kernels and PyTorch's vectorised softmax: a row's result does not change with
    the number of rows (from 2 on; single-row calls are computed as two), the batch, or masked keys after its own
    (weight exactly 0), so a plain step and a tree step that puts the row's keys at the same positions agree bitwise.
    The scaled queries and the scores are rounded to the compute dtype, as in Hugging Face's eager attention."""
    if q.shape[-2] == 1:
        mask = None if attn_mask is None else attn_mask.expand(*attn_mask.shape[:-2], 2, attn_mask.shape[-1])
        return _batch_invariant_attention(q.expand(*q.shape[:-2], 2, q.shape[-1]), k, v, mask)[..., :1, :]
    scores = torch.matmul(q * q.shape[-1] ** -0.5, k.transpose(-1, -2))
    if attn_mask is not None:
        scores += attn_mask  # 0 or -inf: exact in any dtype
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


class _PagedAttention:
    """Attention fn for one packed forward over `segments` (see `trt_engines.llama.AttentionFn`).

    Built once per forward (index tensors, masks, gather buffer), then called once per layer: write the new K/V
    into their slots; then per attention call (`plan_attention_groups`: requests of similar tree size and context
    share one) gather its requests' blocks [context + new] into a padded batch and run one attention with its mask
    (fused SDPA, or `_batch_invariant_attention`). The gather copies whole blocks of each KV head
    (`PagedKVCache.gather_blocks`) into one buffer reused by every call and layer.
    """

    def __init__(self, cache: PagedKVCache, segments: Sequence[_Segment], *, group: int, dtype: torch.dtype,
                 device: torch.device, call_cost: float, batch_invariant: bool = False):
        self.cache, self.group = cache, group
        self.attend = _batch_invariant_attention if batch_invariant else F.scaled_dot_product_attention
        lens = np.array([len(s.tokens) for s in segments], np.int64)
        keys = np.array([s.ctx_len for s in segments], np.int64) + lens
        offsets = np.concatenate([[0], np.cumsum(lens)[:-1]])
        write = [cache.flat_slots(s.request_id, s.ctx_len, s.ctx_len + len(s.tokens)) for s in segments]
        self.write = torch.as_tensor(np.concatenate(write), device=device)
        self.calls = [_AttentionCall(cache, segments, members, offsets, group=group, dtype=dtype, device=device,
                                     whole_blocks=batch_invariant)
                      for members in plan_attention_groups(lens, keys, call_cost=call_cost)]
        self.buffer = cache.block_buffer(max(c.B * c.n_blocks for c in self.calls))

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        g = self.group
        T, H, D = q.shape
        KV = k.shape[1]
        kf, vf = self.cache.flat(layer, 0), self.cache.flat(layer, 1)  # [KV, slots, D]
        kf.index_copy_(1, self.write, k.transpose(0, 1).to(kf.dtype))
        vf.index_copy_(1, self.write, v.transpose(0, 1).to(vf.dtype))
        out = None
        for call in self.calls:
            B, Tq, L = call.B, call.Tq, call.L
            kv = self.cache.gather_blocks(layer, call.blocks, self.buffer)  # [2, KV, B * blocks * block_size, D]
            kv = kv.view(2, KV, B, -1, D)[:, :, :, :L]  # [2, KV, B, L, D]: KV heads outermost, read in place
            if call.padded:
                qc = q.index_select(0, call.src)
            elif call.identity:
                qc = q
            else:
                qc = q.index_select(0, call.rows)
            # [B, Tq, KV, g, D] -> [KV, B, g * Tq, D]: no K/V repeat needed for GQA.
            qc = qc.view(B, Tq, KV, g, D).permute(2, 0, 3, 1, 4).reshape(KV, B, g * Tq, D)
            o = self.attend(qc, kv[0], kv[1], attn_mask=call.mask)
            o = o.view(KV, B, g, Tq, D).permute(1, 3, 0, 2, 4).reshape(B * Tq, H * D)
            if call.padded:
                o = o.index_select(0, call.keep)
            if call.identity:
                return o
            if out is None:
                out = o.new_empty(T, H * D)
            out.index_copy_(0, call.rows, o)
        return out


class _KernelAttention:
    """Attention fn for one packed forward over `segments` with the CPU kernel (`cpu_kernels.tree_attention`):
    write the new K/V into their slots, then every request attends over its own visible keys in the paged pool
    (no gather, no padding: the step-time model prices it as "packed"). Verify steps hand its `layout` and
    `write_slots` to `FusedCpuDecoder`; called as an attention fn it runs the same step through
    `Transformer.forward`, the reference `tests/test_cpu_forward.py` compares the fused forward with."""

    def __init__(self, cache: PagedKVCache, segments: Sequence[_Segment], pool_bits: list[tuple[np.ndarray, np.ndarray]],
                 *, device: torch.device):
        self.cache, self.pool_bits = cache, pool_bits
        lens = [len(s.tokens) for s in segments]
        offsets = np.concatenate([[0], np.cumsum(lens)[:-1]])
        keys = [cache.flat_slots(s.request_id, 0, s.ctx_len + n) for s, n in zip(segments, lens)]
        self.write_slots = np.concatenate([k[s.ctx_len:] for s, k in zip(segments, keys)])
        self.write = torch.as_tensor(self.write_slots, device=device)
        self.layout = TreeAttentionLayout([(int(o), s.ctx_len, k, s.local_mask)
                                           for o, s, k in zip(offsets, segments, keys)])

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        kf, vf = self.cache.flat(layer, 0), self.cache.flat(layer, 1)  # [KV, slots, D]
        kf.index_copy_(1, self.write, k.transpose(0, 1).to(kf.dtype))
        vf.index_copy_(1, self.write, v.transpose(0, 1).to(vf.dtype))
        k_bits, v_bits = self.pool_bits[layer]
        return tree_attention(q, k_bits, v_bits, self.layout)


def host_torch_threads(device: torch.device, requested: int | None, environ=os.environ) -> int | None:
    """The CPU thread count torch should run with in a process whose engine verifies on `device`; None: leave it.

    `requested` wins. On a GPU the default is one thread, unless the environment's OMP_NUM_THREADS names a count (as
    vLLM's GPU workers do): the host only packs inputs and launches kernels there, and torch's CPU pool (a thread
    per core by default) made each of the forward's few small CPU ops wake every core, beside the drafter's numba
    threads. On an H100 host with 16 cores, four orchestrators taking turns (one request each, Llama-3.1-8B's
    shape): with 16 threads their verify steps took 36-38 ms (median), and `none`'s 101 ms; with one thread all four
    took 25.4-25.7 ms (a one-off diagnostic: b233603's commit message). On the CPU the forward itself runs on
    those threads, and they are left as the process has them."""
    if requested is not None:
        if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
            raise ValueError(f"torch_threads must be an int >= 1 (or None: the device's default); got {requested!r}")
        return requested
    if device.type == "cpu" or environ.get("OMP_NUM_THREADS"):
        return None
    return 1


class TorchEngine:
    """The reference target engine (see the module docstring for the KV layout).

    Example:

        engine = TorchEngine("default", dtype=torch.float32)
        root = engine.add_request("a", [1, 9690, 28], SamplingParams())
        out = engine.verify([VerifyItem("a", DraftTree.chain([root_guess]))])
        acc = orchestrator.acceptance.accept(tree, out.results[0].target_tokens)
        engine.commit("a", acc.accepted_nodes, next_root=acc.bonus_token)
    """

    # How verify lays out attention, for the step-time model (`StepTimeModel.attention_layout`): "grouped", a few
    # batched SDPA calls per layer, each over requests of similar tree size and context, padded within the call
    # (`_PagedAttention`, `plan_attention_groups`); "packed" with the CPU kernels (each request over its own keys).
    attention_layout = "grouped"
    returns_logprobs = True  # `SamplingParams.logprobs` is served (`first_token_logprobs`, `VerifyResult.logprobs`)

    def __init__(
        self,
        model: "str | Transformer" = "default",
        *,
        dtype: torch.dtype = torch.bfloat16,
        device: str | torch.device | None = None,
        num_blocks: int | None = None,
        block_size: int = 16,
        max_context: int | None = None,
        batch_invariant: bool | None = None,
        cpu_kernels: str = "auto",
        prefix_caching: bool | None = None,
        torch_threads: int | None = None,
    ):
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        threads = host_torch_threads(self.device, torch_threads)  # checked now, set once the engine is built
        self.dtype = dtype
        # The grouping planner's price of one more attention call (`attention_groups.call_cost_for`): host-bound
        # launches make a call far dearer next to the work it saves on a GPU than on a CPU. The step-time model
        # plans with the same price (`StepTimeModel.attention_call_cost`).
        self.attention_call_cost: float = call_cost_for(self.device.type)
        # Where bf16 verify steps run numba kernels (`trt_engines.cpu_kernels`, batch-invariant by construction):
        # "numba", linear layers and verify attention; "attention", verify attention only, linear layers on
        # PyTorch's kernels; "torch", neither. "auto" picks "numba" or "attention" by the CPU
        # (`cpu_kernels.auto_cpu_kernels`), unless batch_invariant=False asks for the fused kernels.
        check_cpu_kernels(cpu_kernels)
        kernels_apply = self.device.type == "cpu" and dtype == torch.bfloat16
        if cpu_kernels in ("numba", "attention") and not kernels_apply:
            raise ValueError(f"cpu_kernels={cpu_kernels!r} runs bf16 models on the CPU; this engine is {dtype} on "
                             f"{self.device}")
        if cpu_kernels == "auto":
            cpu_kernels = ("torch" if not kernels_apply or batch_invariant is False else
                           auto_cpu_kernels())
        self.cpu_kernels: str = cpu_kernels  # "numba", "attention" or "torch", as resolved
        # Verify steps in batch-invariant numerics (module docstring): the default for bf16 on the CPU, where it was
        # measured to hold. fp32 matmuls (MKL) round rows differently by row count, so there it would only cost, and
        # fp32 rarely needs it (near-ties close enough to flip are rare); CUDA keeps the fused SDPA kernels.
        if batch_invariant is None:
            batch_invariant = self.device.type == "cpu" and dtype == torch.bfloat16
        if self.kernel_attention and not batch_invariant:
            raise ValueError("the CPU kernels are batch-invariant by construction: pass cpu_kernels='torch' with "
                             "batch_invariant=False")
        self.batch_invariant = bool(batch_invariant)
        if self.batch_invariant and kernels_apply and cpu_kernels != "numba" and not cpu_has_native_bf16():
            warnings.warn(f"cpu_kernels={cpu_kernels!r}: without bf16 dot-product instructions PyTorch's bf16 linear "
                          "layers are not batch-invariant (module docstring), so bf16 speculation may part from plain "
                          "decoding at near-ties; cpu_kernels='numba' (the default on this CPU) is", stacklevel=2)
        if isinstance(model, Transformer):  # an already built model (e.g. `Transformer.random` for timing studies)
            self.model = model
        else:
            self.model = Transformer.from_folder(resolve_model_dir(model), dtype=dtype, device=self.device)
        args = self.model.args
        self.args = args
        self.vocab_size: int = args.vocab_size
        self.eos_token_ids: tuple[int, ...] = args.eos_token_ids
        limit = args.max_position_embeddings
        if max_context is not None and not (2 <= max_context <= limit):
            raise InvalidField("max_context", f"max_context must lie in [2, {limit}] (the model's "
                                              f"max_position_embeddings); got {max_context}")
        self.max_context: int = max_context or limit
        if num_blocks is None:
            num_blocks = -(-8 * self.max_context // block_size)  # room for 8 full-length requests
        # Prefix caching (`PagedKVCache`): on by default where prefills run the numba kernels, whose bits do not
        # depend on how a prompt is split, so a prompt read partly from the cache decodes exactly as computed whole;
        # there they cost no more than the fused kernels. With linear layers on PyTorch ("attention") the invariant
        # prefill is slower (`llama.Linear`), so it is asked for; elsewhere ("torch", fp32, CUDA) a cached prefix
        # gives the model's outputs but not bitwise those of an uncached prefill.
        if prefix_caching is None:
            prefix_caching = self.cpu_kernels == "numba"
        self.prefix_caching = bool(prefix_caching)
        self._invariant_prefill = self.kernel_attention and (self.cpu_kernels == "numba" or self.prefix_caching)
        self.kv = PagedKVCache(
            n_layers=args.n_layers, n_kv_heads=args.n_kv_heads, head_dim=args.head_dim, num_blocks=num_blocks,
            block_size=block_size, dtype=dtype, device=self.device, prefix_caching=self.prefix_caching,
        )
        self._requests: dict[object, _Request] = {}
        self._pool_bits: list[tuple[np.ndarray, np.ndarray]] = []
        if self.kernel_linears:
            for module in self.model.modules():
                if isinstance(module, Linear):
                    module.kernel = Bf16Linear(module.weight, module.bias)
        elif self.batch_invariant and self.device.type == "cpu":
            for module in self.model.modules():
                if isinstance(module, Linear):
                    module.transposed = True  # the form whose rows oneDNN keeps batch-invariant (`Linear`)
        if self.kernel_attention:
            self.attention_layout = "packed"
            self._pool_bits = [(bf16_bits(self.kv.flat(layer, 0)), bf16_bits(self.kv.flat(layer, 1)))
                               for layer in range(args.n_layers)]
        # verify steps on the numba attention run the whole forward over bf16 bits (`cpu_forward`)
        self._fused = FusedCpuDecoder(self.model) if self.kernel_attention else None
        if threads is not None and threads != torch.get_num_threads():
            torch.set_num_threads(threads)  # process-wide, as torch has it (`host_torch_threads`)

    @property
    def kernel_linears(self) -> bool:
        """Linear layers run the numba kernel (`cpu_kernels` "numba")."""
        return self.cpu_kernels == "numba"

    @property
    def kernel_attention(self) -> bool:
        """Verify attention runs the numba kernel (`cpu_kernels` "numba" or "attention")."""
        return self.cpu_kernels in ("numba", "attention")

    # ---- capacity -------------------------------------------------------------------------------------------

    @property
    def requests(self) -> KeysView:
        """Ids of the active requests (a live view)."""
        return self._requests.keys()

    def free_blocks(self) -> int:
        return self.kv.free_blocks()

    def total_blocks(self) -> int:
        return self.kv.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return self.kv.blocks_needed(num_tokens)

    def can_admit(self, prompt_len: int, max_new_tokens: int, *, tree_nodes: int = 0) -> bool:
        """Whether a request of this size fits in the free blocks now (with room for `tree_nodes` temporary slots)."""
        return self.blocks_needed(prompt_len + max_new_tokens + tree_nodes) <= self.free_blocks()

    def context_length(self, request_id) -> int:
        return self._get(request_id).ctx_len

    # ---- lifecycle ------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def add_request(self, request_id, prompt_ids: Sequence[int], sampling: SamplingParams = SamplingParams(), *,
                    cache_salt: str | None = None, prefill_tokens: int | None = None) -> int | None:
        """Prefill `prompt_ids` and return the first generated token (the root of the first verify). With prefix
        caching the prompt's leading full blocks come from the cache where an earlier request with the same
        `cache_salt` computed them (at least its last token is always computed: it yields the first token).

        `prefill_tokens` (chunked prefill): compute at most that many of the prompt's uncached tokens now and return
        None while some are left; `prefill` computes the next chunk. The prompt's KV blocks are all taken now. Where
        the prefill is batch-invariant (the numba kernels, or the numba attention with prefix caching) the chunks
        give bitwise a whole prefill's K/V and first token."""
        check_new_request(request_id, sampling, self._requests, returns_logprobs=True)
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise RequestError(request_id, f"cache_salt must be a string or None; got {type(cache_salt).__name__}")
        if prefill_tokens is not None:
            check_chunk_tokens(request_id, prefill_tokens, "prefill_tokens")
        prompt = self._check_ids(request_id, prompt_ids, "prompt")
        if len(prompt) == 0:
            raise RequestError(request_id, "empty prompt; pass at least one token (e.g. the BOS token)")
        if len(prompt) >= self.max_context:
            raise RequestError(
                request_id, f"prompt has {len(prompt)} tokens; the context limit is {self.max_context} and one more "
                "position is needed to generate: truncate the prompt"
            )
        cached = self.kv.match(prompt, (len(prompt) - 1) // self.kv.block_size, salt=cache_salt)
        need = self.kv.blocks_needed(len(prompt)) - len(cached)
        if need > self.kv.free_after_attach(cached):
            raise KVCacheFullError(
                request_id, f"prompt needs {need} KV blocks, {self.kv.free_after_attach(cached)} free: retry after "
                "other requests finish"
            )
        seed = None
        if not sampling.greedy:
            seed = sampling.seed if sampling.seed is not None else secrets.randbits(63)
        start = len(cached) * self.kv.block_size
        req = _Request(sampling=sampling, seed=seed, ctx_len=start, root=-1, cached_prompt=start,
                       cache_salt=cache_salt, committed=[prompt] if self.prefix_caching else None, prompt=prompt)
        self._requests[request_id] = req
        try:
            self.kv.attach(request_id, cached)
            self.kv.ensure(request_id, len(prompt))
            return self._prefill_chunk(request_id, req, prefill_tokens)
        except BaseException:
            self._requests.pop(request_id, None)
            self.kv.release(request_id)
            raise

    @property
    def exact_chunked_prefill(self) -> bool:
        """Whether a prompt prefilled in chunks (`prefill`) gets bitwise the K/V and first token of one prefilled whole:
        where its prefill runs the batch-invariant numba attention."""
        return self._invariant_prefill

    @torch.inference_mode()
    def prefill(self, request_id, max_tokens: int) -> int | None:
        """Compute the next at most `max_tokens` tokens of a prompt that `add_request(prefill_tokens=...)` started;
        returns the first generated token once the whole prompt is in, else None. A call that fails changes nothing
        (the chunk can be computed again)."""
        req = self._get(request_id)
        if req.prompt is None:
            raise RequestError(request_id, "its prompt is prefilled already: verify it")
        check_chunk_tokens(request_id, max_tokens, "max_tokens")
        return self._prefill_chunk(request_id, req, max_tokens)

    def prompt_tokens_left(self, request_id) -> int:
        """How many of the request's prompt tokens are still to be prefilled (0 once it can be verified)."""
        req = self._get(request_id)
        return 0 if req.prompt is None else len(req.prompt) - req.ctx_len

    def _prefill_chunk(self, request_id, req: _Request, max_tokens: int | None) -> int | None:
        """Prefill the prompt from `req.ctx_len` on, at most `max_tokens` tokens (None: the rest); the first token
        once the prompt is all in. Each full block a chunk completes is published for other prompts to reuse."""
        prompt, start = req.prompt, req.ctx_len
        end = len(prompt) if max_tokens is None else min(len(prompt), start + max_tokens)
        n = end - start
        seg = _Segment(request_id, start, prompt[start:end], start + np.arange(n), np.tril(np.ones((n, n), bool)))
        hidden = self._forward([seg], batch_invariant=self._invariant_prefill)
        if end < len(prompt):
            req.ctx_len = end
            self.kv.publish(request_id, prompt, end, salt=req.cache_salt)
            return None
        logits = self.model.logits(hidden[-1:])
        req.root = int(sample_tokens(logits, req.sampling, req.seed, np.array([end]))[0])
        if req.sampling.logprobs is not None:
            req.first_logprobs = token_logprobs(logits, np.array([req.root]), req.sampling.logprobs)
        req.ctx_len, req.prompt = end, None
        self.kv.publish(request_id, prompt, end, salt=req.cache_salt)
        return req.root

    def first_token_logprobs(self, request_id) -> TokenLogprobs | None:
        """The log probabilities of the first generated token (one row), for a request whose sampling asks for them;
        None otherwise. Given once: the orchestrator takes them with that token."""
        req = self._get(request_id)
        taken, req.first_logprobs = req.first_logprobs, None
        return taken

    def cached_prompt_tokens(self, request_id) -> int:
        """How many of the request's prompt tokens were read from the prefix cache rather than computed."""
        return self._get(request_id).cached_prompt

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (e.g. between benchmark runs that serve the same prompts again); returns how
        many blocks were forgotten. Running requests keep their blocks."""
        return self.kv.reset_prefix_cache()

    @torch.inference_mode()
    def verify(self, items: Sequence[VerifyItem], *, return_logits: bool = False) -> VerifyOutput:
        """Target tokens at the root and every node of every item's tree, in one forward over the whole batch;
        `return_logits` also returns each item's fp32 logits (`VerifyResult.logits`)."""
        t0 = time.perf_counter()
        items = list(items)
        if not items:
            raise ValueError("verify needs at least one VerifyItem")
        seen: set = set()
        extra = 0
        for item in items:  # validate everything before touching any state
            if not isinstance(item, VerifyItem) or not isinstance(item.tree, DraftTree):
                raise ValueError(f"verify takes VerifyItem(request_id, DraftTree) objects; got {item!r}")
            rid = item.request_id
            req = self._get(rid)
            if rid in seen:
                raise RequestError(rid, "appears twice in one verify batch")
            if req.prompt is not None:
                raise RequestError(rid, f"its prompt is still being prefilled ({len(req.prompt) - req.ctx_len} tokens "
                                        "left): call prefill until it returns the first token")
            seen.add(rid)
            try:
                item.tree.validate(self.vocab_size)
            except InvalidTreeError as e:
                raise RequestError(rid, f"invalid draft tree: {e}") from None
            n = len(item.tree)
            if req.ctx_len + n + 1 > self.max_context:
                raise RequestError(
                    rid, f"context {req.ctx_len} + root + {n} tree nodes exceeds the context limit "
                    f"{self.max_context}: send a smaller tree or finish the request"
                )
            extra += self.kv.extra_blocks(rid, req.ctx_len + n + 1)
            if extra > self.kv.free_blocks():
                raise KVCacheFullError(
                    rid, f"the batch needs {extra} more KV blocks than the {self.kv.free_blocks()} free: "
                    "verify fewer nodes or requests, or release a request"
                )
        segments, layouts = [], []
        for item in items:
            req, tree = self._requests[item.request_id], item.tree
            self.kv.ensure(item.request_id, req.ctx_len + len(tree) + 1)
            # Slots in depth-first order (`DraftTree.depth_first_order`): an accepted path that follows first children
            # has its keys at the positions plain decoding gives them, so batch-invariant numerics hold for it.
            order = tree.depth_first_order() if self.batch_invariant and not self.kernel_attention else None
            if order is not None and np.array_equal(order, np.arange(len(tree))):
                order = None  # chains and most small trees are laid out that way already
            if order is not None:
                tree = tree.subtree(order)
            layouts.append(order)
            tokens = np.concatenate([[req.root], tree.tokens]).astype(np.int64)
            positions = req.ctx_len + tree.position_offsets().astype(np.int64)
            segments.append(_Segment(item.request_id, req.ctx_len, tokens, positions, tree.attention_mask()))
        t1 = time.perf_counter()
        hidden = self._forward(segments, batch_invariant=self.batch_invariant)
        logits = self.model.logits(hidden)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t2 = time.perf_counter()
        targets = self._sample(segments, logits)
        per_item = logits.split([len(s.tokens) for s in segments])
        results = []
        for item, order, tok, rows in zip(items, layouts, targets, per_item):
            req = self._requests[item.request_id]
            req.pending, req.slot_of = item.tree, None
            in_order = None
            if order is not None:  # back to the caller's node order; commit maps nodes to slots
                req.slot_of = np.empty(len(order), np.int64)
                req.slot_of[order] = np.arange(len(order))
                in_order = np.concatenate([[0], req.slot_of + 1])
                tok = tok[in_order]
            lp = None
            if req.sampling.logprobs is not None:  # the rows of the tokens this step yields alone
                yielded = np.concatenate([[0], item.tree.accepted_path(tok) + 1])
                slots = yielded if in_order is None else in_order[yielded]
                lp = token_logprobs(rows[torch.as_tensor(slots, device=rows.device)], tok[yielded],
                                    req.sampling.logprobs)
            if return_logits:
                rows = rows.clone() if in_order is None else rows[torch.as_tensor(in_order, device=rows.device)]
            results.append(VerifyResult(item.request_id, tok, rows if return_logits else None, lp))
        t3 = time.perf_counter()
        timings = {
            "prepare_ms": (t1 - t0) * 1e3, "forward_ms": (t2 - t1) * 1e3, "sample_ms": (t3 - t2) * 1e3,
            "total_ms": (t3 - t0) * 1e3, "num_tokens": float(sum(len(s.tokens) for s in segments)),
        }
        return VerifyOutput(results, timings)

    def commit(self, request_id, accepted_node_ids: Sequence[int], next_root: int) -> None:
        """Cache the root and the accepted path of the last verified tree; `next_root` (the bonus token) becomes the root.

        `accepted_node_ids` lists tree nodes from the root's child downwards (each the parent of the next).
        """
        req = self._get(request_id)
        tree = req.pending
        if tree is None:
            raise RequestError(request_id, "commit without a preceding verify")
        acc = np.asarray(accepted_node_ids, dtype=np.int64).reshape(-1) if len(accepted_node_ids) else np.zeros(0, np.int64)
        if acc.size and (acc.min() < 0 or acc.max() >= len(tree)):
            raise RequestError(request_id, f"accepted node ids {acc.tolist()} outside the tree's 0..{len(tree) - 1}")
        expected_parent = -1
        for node in acc.tolist():
            if int(tree.parents[node]) != expected_parent:
                raise RequestError(
                    request_id, f"accepted nodes {acc.tolist()} are not a root path: node {node}'s parent is "
                    f"{int(tree.parents[node])}, expected {expected_parent}"
                )
            expected_parent = node
        self._check_id(request_id, next_root, "next_root")
        ctx = req.ctx_len
        if acc.size:  # the root's K/V is at slot ctx already: only accepted nodes may have to move
            slots = acc if req.slot_of is None else req.slot_of[acc]
            src = self.kv.flat_slots(request_id, ctx, ctx + len(tree) + 1)[np.concatenate([[0], slots + 1])]
            dst = self.kv.flat_slots(request_id, ctx, ctx + 1 + acc.size)
            moved = src != dst  # an accepted chain prefix is already in place
            self.kv.move(src[moved], dst[moved])
        req.ctx_len = ctx + 1 + int(acc.size)
        if req.committed is not None:
            req.committed.append(np.array([req.root, *tree.tokens[acc].tolist()], np.int64))
        self.kv.shrink(request_id, req.ctx_len)
        req.root = int(next_root)
        req.pending, req.slot_of = None, None

    def release(self, request_id) -> None:
        req = self._get(request_id)
        del self._requests[request_id]
        if req.committed is not None:  # its output's full blocks too: a next turn's prompt repeats them
            self.kv.publish(request_id, np.concatenate(req.committed), req.ctx_len, salt=req.cache_salt)
        self.kv.release(request_id)

    # ---- debugging / tests / benchmarks ---------------------------------------------------------------------

    def kv_snapshot(self, request_id) -> Tensor:
        """Debug: [n_layers, 2, ctx_len, n_kv_heads, head_dim] copy of the request's cached K/V."""
        return self.kv.gather(request_id, self._get(request_id).ctx_len)

    @torch.inference_mode()
    def debug_logits(self, prompts: Sequence[Sequence[int]]) -> list[Tensor]:
        """Debug: fp32 logits [len, vocab] of every position of each prompt, all prompts packed in one paged forward.

        Uses temporary requests (freed before returning); raises KVCacheFullError if they do not fit.
        """
        ids = [object() for _ in prompts]
        arrays = [self._check_ids("debug", p, "prompt") for p in prompts]
        need = sum(self.kv.blocks_needed(len(a)) for a in arrays)
        if need > self.kv.free_blocks():
            raise KVCacheFullError("debug", f"needs {need} KV blocks, {self.kv.free_blocks()} free")
        try:
            segments = []
            for rid, a in zip(ids, arrays):
                self.kv.ensure(rid, len(a))
                segments.append(_Segment(rid, 0, a, np.arange(len(a)), np.tril(np.ones((len(a), len(a)), bool))))
            logits = self.model.logits(self._forward(segments, batch_invariant=self._invariant_prefill))
        finally:
            for rid in ids:
                self.kv.release(rid)
        return list(logits.split([len(a) for a in arrays]))

    def add_synthetic_request(self, request_id, ctx_len: int, *, root: int = 0, sampling: SamplingParams = SamplingParams()) -> None:
        """Benchmarks only: a request whose `ctx_len` cached K/V are random values (step time does not depend on them)."""
        if request_id in self._requests:
            raise RequestError(request_id, "already active")
        if not 0 <= ctx_len < self.max_context:
            raise RequestError(request_id, f"ctx_len must lie in [0, {self.max_context})")
        if self.kv.blocks_needed(ctx_len) > self.kv.free_blocks():
            raise KVCacheFullError(request_id, f"needs {self.kv.blocks_needed(ctx_len)} blocks, {self.free_blocks()} free")
        self.kv.ensure(request_id, ctx_len)
        idx = torch.as_tensor(self.kv.flat_slots(request_id, 0, ctx_len), device=self.device)
        for layer in range(self.args.n_layers):
            for kind in (0, 1):
                flat = self.kv.flat(layer, kind)
                flat[:, idx] = torch.randn(flat.shape[0], ctx_len, flat.shape[2], device=self.device).to(flat.dtype)
        seed = None if sampling.greedy else sampling.seed or 0
        self._requests[request_id] = _Request(sampling=sampling, seed=seed, ctx_len=ctx_len, root=int(root))

    # ---- internals ------------------------------------------------------------------------------------------

    def _get(self, request_id) -> _Request:
        try:
            return self._requests[request_id]
        except (KeyError, TypeError):
            raise RequestError(request_id, "unknown request (never added, or already released)") from None

    def _check_id(self, request_id, token, what: str) -> None:
        """`_check_ids` for one token id: a plain int check, as every commit makes one for every request."""
        if isinstance(token, bool) or not isinstance(token, (int, np.integer)) or not 0 <= token < self.vocab_size:
            self._check_ids(request_id, [token], what)  # raises, naming the problem

    def _check_ids(self, request_id, ids, what: str) -> np.ndarray:
        try:
            arr = np.asarray(ids)
        except Exception:
            raise RequestError(request_id, f"{what} must be a sequence of int token ids") from None
        if arr.size == 0:
            return np.zeros(0, np.int64)
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            raise RequestError(request_id, f"{what} must be a 1-D sequence of int token ids; got dtype {arr.dtype}, shape {arr.shape}")
        if arr.min() < 0 or arr.max() >= self.vocab_size:
            bad = int(arr[(arr < 0) | (arr >= self.vocab_size)][0])
            raise RequestError(request_id, f"{what} token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        return arr.astype(np.int64)

    def _forward(self, segments: Sequence[_Segment], *, batch_invariant: bool = False) -> Tensor:
        """Hidden states of the packed `segments`. Prefills without the CPU kernels keep the fused SDPA and oneDNN's
        x W^T linear layers (they run one request alone, so every policy computes them identically, and a long
        prompt's scores would not fit in memory as one matrix)."""
        tokens = torch.as_tensor(np.concatenate([s.tokens for s in segments]), device=self.device)
        positions = torch.as_tensor(np.concatenate([s.positions for s in segments]), device=self.device)
        if batch_invariant and self.kernel_attention:
            attention = _KernelAttention(self.kv, segments, self._pool_bits, device=self.device)
            if self._fused is not None:
                return self._fused(tokens, positions, attention.layout, self._pool_bits, attention.write_slots)
        else:
            attention = _PagedAttention(self.kv, segments, group=self.args.group_size, dtype=self.dtype,
                                        device=self.device, call_cost=self.attention_call_cost,
                                        batch_invariant=batch_invariant)
        with sdpa_backends_for(self.device):
            return self.model(tokens, positions, attention, invariant_rows=batch_invariant)

    def _sample(self, segments: Sequence[_Segment], logits: Tensor) -> list[np.ndarray]:
        """Target tokens per segment from fp32 `logits` [tokens, vocab]: one argmax over all rows when every request
        is greedy (the common case, no copy of the logits), else one `sample_requests` call for every row."""
        sizes = [len(s.tokens) for s in segments]
        requests = [self._requests[s.request_id] for s in segments]
        if all(r.sampling.greedy for r in requests):
            return np.split(greedy_tokens(logits), np.cumsum(sizes)[:-1])
        # row r of a segment predicts the token after position r: it samples position r + 1
        tokens = sample_requests(logits, [(req.sampling, req.seed, segment.positions + 1)
                                          for req, segment in zip(requests, segments)])
        return np.split(tokens.astype(np.int32), np.cumsum(sizes)[:-1])
