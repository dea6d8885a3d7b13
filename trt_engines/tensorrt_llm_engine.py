"""`TensorRTLLMEngine`: a compiled TensorRT-LLM engine behind the `TargetEngine` protocol (NVIDIA GPUs only).

Verification here is LINEAR, unlike `TorchEngine`, which verifies whole trees. TensorRT-LLM's executor takes one
list of external draft tokens per request (`ExternalDraftTokensConfig`), so each request's `DraftTree` is reduced to
its most probable root-to-leaf path within the engine's `max_draft_len` (`DraftTree.best_path_nodes`) and only that
path is verified. What the reduction costs in tokens per step is the `fused-path` row of
`benchmarks/results/acceptance.md` (same trees, same budget, reduced to the path).

One verification step of a request is one executor request (the pattern of NVIDIA's Triton BLS for
draft-target speculation, tensorrt_llm_bls `_spec_generate`):

    input_token_ids = context + [root]          (the whole sequence; KV-cache block reuse skips the cached prefix)
    external draft  = tokens of the path        (k <= max_draft_len tokens)
    max_tokens      = k + 1                     (accepted draft tokens + the bonus token)
    output          = o                         (exclude_input_from_output: only the new tokens)

The executor accepts the longest prefix of the draft that equals its own greedy tokens and appends the bonus token,
so `o` is the target's greedy continuation of context + root. Mapping `o` back onto the whole tree
(`targets_from_output`): the target token after the root is o[0], and a node at depth d whose root path equals
o[:d] has target token o[d] (when d < len(o)). Every node the acceptance walk visits is on that path, so the walk
reproduces the executor's verdict on the path. One case needs more: when the target's token at the last known
position matches an off-path node (a sibling of the path the reduction dropped), the walk would continue past what
`o` covers. The engine then asks the executor once more for that node's continuation (draft: the best path below
it), so verification stays exact; `timings["rounds"]` counts these extra calls. Unknown entries of
`target_tokens` are -1 and are never read by `orchestrator.acceptance.accept`.

Greedy only: a request with temperature > 0 is rejected (TensorRT-LLM's external-draft acceptance under sampling
is not what `TorchEngine` implements, and a fresh seed per step request would not reproduce a seeded stream).

Checked against (read, not copied; NVIDIA/TensorRT-LLM on GitHub, release line 1.2; the python module is
`tensorrt_llm.bindings.executor`, bound in cpp/tensorrt_llm/nanobind/executor/):
    - executor.cpp: Executor(model_path, model_type, executor_config), enqueue_requests(requests) -> ids,
      await_responses(ids, timeout: timedelta | None) -> list[list[Response]], shutdown()
    - request.cpp: Request(input_token_ids, max_tokens, *, streaming, sampling_config, output_config, end_id,
      pad_id, ..., external_draft_tokens_config, ...); ExternalDraftTokensConfig(tokens, logits=None,
      acceptance_threshold=None, fast_logits=None); OutputConfig(..., exclude_input_from_output=...);
      SamplingConfig(beam_width=1, *, top_k, top_p, seed, temperature, ...); Response.has_error(),
      Response.error_msg, Response.result; Result.output_token_ids (one list per beam), Result.is_final
    - executorConfig.cpp: ExecutorConfig(max_beam_width=1, scheduler_config, kv_cache_config,
      enable_chunked_context=False, ...), KvCacheConfig(enable_block_reuse=True, max_tokens=None, ...,
      free_gpu_memory_fraction=None, ...)
    - bindings.cpp: ModelType.DECODER_ONLY
    - examples/bindings/executor/example_basic.py (import path and call order)
    - triton_backend/all_models/inflight_batcher_llm/tensorrt_llm_bls/1/lib/triton_decoder.py (request_output_len =
      len(draft) + 1 for a target request carrying draft_input_ids)
Nothing in this module has run against TensorRT-LLM: TensorRT-LLM cannot be installed on this project's CPU
machines. tests/test_trtllm.py runs the pure parts here and the engine itself only where `tensorrt_llm` imports.

Example (GPU machine, engine from `retrospec build-engine`):

    engine = TensorRTLLMEngine("engines/smollm2")
    root = engine.add_request("a", prompt_ids, SamplingParams())
    out = engine.verify([VerifyItem("a", tree)])            # tree reduced to its best path inside
    acc = orchestrator.acceptance.accept(tree, out.results[0].target_tokens)
    engine.commit("a", acc.accepted_nodes, next_root=acc.bonus_token)
"""

from __future__ import annotations

import datetime
import time
from collections.abc import KeysView, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from drafter.tree import DraftTree, InvalidTreeError
from trt_engines.base import (
    KVCacheFullError,
    RequestError,
    SamplingParams,
    VerifyItem,
    VerifyOutput,
    VerifyResult,
    check_new_request,
)
from trt_engines.trtllm_build import (
    INSTALL_HINT,
    EngineConfig,
    TensorRTLLMUnavailable,
    read_engine_config,
)

_GREEDY = SamplingParams()
UNKNOWN_TOKEN = -1  # target_tokens entry of a node the executor's output does not cover (never read by accept)


def import_executor_bindings():
    """`tensorrt_llm.bindings.executor`, or TensorRTLLMUnavailable naming the fix."""
    try:
        import tensorrt_llm.bindings.executor as trtllm
    except ImportError as exc:
        raise TensorRTLLMUnavailable(f"TensorRTLLMEngine needs TensorRT-LLM ({exc}): {INSTALL_HINT}") from exc
    return trtllm


# ---- one executor request, as plain data ------------------------------------------------------------------------


@dataclass(frozen=True)
class StepRequest:
    """The arguments of one `tensorrt_llm.bindings.executor.Request`, as plain data (testable without a GPU)."""

    input_token_ids: tuple[int, ...]
    max_tokens: int
    draft_tokens: tuple[int, ...] = ()
    end_id: int | None = None
    pad_id: int | None = None

    def executor_kwargs(self) -> dict:
        """Keyword arguments for `Request(**...)`; nested configs as dicts (`to_executor_request` builds them)."""
        kwargs: dict = {
            "input_token_ids": list(self.input_token_ids), "max_tokens": self.max_tokens, "streaming": False,
            "sampling_config": {"beam_width": 1}, "output_config": {"exclude_input_from_output": True},
        }
        if self.end_id is not None:
            kwargs["end_id"] = self.end_id
        if self.pad_id is not None:
            kwargs["pad_id"] = self.pad_id
        if self.draft_tokens:
            kwargs["external_draft_tokens_config"] = {"tokens": list(self.draft_tokens)}
        return kwargs


def prefill_request(prompt: Sequence[int], *, end_id: int | None = None, pad_id: int | None = None) -> StepRequest:
    """The first step of a request: the prompt, one output token (the first root)."""
    return StepRequest(tuple(int(t) for t in prompt), 1, (), end_id, pad_id)


def verify_request(context: Sequence[int], root: int, draft: Sequence[int], *, end_id: int | None = None,
                   pad_id: int | None = None) -> StepRequest:
    """One verification step: input = context + [root], the draft as external draft tokens, len(draft) + 1 outputs."""
    draft = tuple(int(t) for t in draft)
    return StepRequest(tuple(int(t) for t in context) + (int(root),), len(draft) + 1, draft, end_id, pad_id)


def to_executor_request(step: StepRequest, trtllm):
    """The real `Request` (needs the TensorRT-LLM bindings module `trtllm`)."""
    kwargs = step.executor_kwargs()
    kwargs["sampling_config"] = trtllm.SamplingConfig(**kwargs["sampling_config"])
    kwargs["output_config"] = trtllm.OutputConfig(**kwargs["output_config"])
    if "external_draft_tokens_config" in kwargs:
        kwargs["external_draft_tokens_config"] = trtllm.ExternalDraftTokensConfig(**kwargs["external_draft_tokens_config"])
    return trtllm.Request(**kwargs)


# ---- mapping the executor's output back onto the tree -----------------------------------------------------------


def targets_from_output(tree: DraftTree, output: Sequence[int]) -> tuple[np.ndarray, int | None]:
    """Target tokens for [root, nodes...] known from the target's greedy continuation `output`, and the node whose
    target the acceptance walk would still need (None when the walk ends on known entries).

    targets[0] = output[0]; node i at depth d gets output[d] when its root path equals output[:d] and d < len(output);
    every other entry is UNKNOWN_TOKEN.

    Example: tree tokens [a, b, x], parents [-1, 0, 0]; output [a, x]: node 0 (a) is on the output, its target is x;
    the walk follows a, then x (node 2, off the path [a, b]) whose target is not in the output -> need = 2.
    """
    out = np.asarray(output, dtype=np.int64).reshape(-1)
    if out.size == 0:
        raise ValueError("the executor returned no token")
    n = len(tree)
    targets = np.full(n + 1, UNKNOWN_TOKEN, np.int32)
    targets[0] = out[0]
    on = np.zeros(n, bool)  # root path equals out[:depth]
    for i in range(n):  # parents-first
        d, p = int(tree.depth[i]), int(tree.parents[i])
        on[i] = d <= out.size and int(tree.tokens[i]) == out[d - 1] and (p < 0 or on[p])
        if on[i] and d < out.size:
            targets[1 + i] = out[d]
    current = -1
    while True:  # the acceptance walk (first matching child, as orchestrator.acceptance.accept)
        want = targets[current + 1]
        if want == UNKNOWN_TOKEN:
            return targets, current
        children = np.nonzero((tree.parents == current) & (tree.tokens == want))[0]
        if children.size == 0:
            return targets, None
        current = int(children[0])


# ---- the executor seam ------------------------------------------------------------------------------------------


class StepBackend(Protocol):
    """Runs a batch of step requests to completion; returns each one's output tokens (input excluded)."""

    def run(self, steps: Sequence[StepRequest]) -> list[list[int]]: ...

    def shutdown(self) -> None: ...


class ExecutorBackend:
    """`StepBackend` over a real `tensorrt_llm.bindings.executor.Executor` (in-flight batching, paged KV with block
    reuse). All steps of one `run` are enqueued together, so they share the executor's iterations.

    Chunked context is on by default: `build-engine` allows inputs up to max_seq_len - 1 tokens and takes any
    `--max-num-tokens` that holds one step's drafts, so a prompt (or the uncached part of a re-submitted sequence)
    may be longer than the engine's max_num_tokens per iteration. With chunking the executor computes it over several
    iterations, beside the other requests' steps; without it such a request fails. The engine's paged context FMHA
    (a `build-engine` flag) is what chunking needs."""

    def __init__(self, engine_dir: str | Path, *, kv_cache_free_gpu_memory_fraction: float = 0.9,
                 kv_cache_max_tokens: int | None = None, enable_chunked_context: bool = True,
                 timeout_s: float = 120.0, trtllm=None) -> None:
        self.trtllm = trtllm or import_executor_bindings()
        t = self.trtllm
        kv = t.KvCacheConfig(enable_block_reuse=True, max_tokens=kv_cache_max_tokens,
                             free_gpu_memory_fraction=kv_cache_free_gpu_memory_fraction)
        self.executor = t.Executor(Path(engine_dir), t.ModelType.DECODER_ONLY,
                                   t.ExecutorConfig(max_beam_width=1, kv_cache_config=kv,
                                                    enable_chunked_context=enable_chunked_context))
        self.timeout = datetime.timedelta(seconds=timeout_s)

    def run(self, steps: Sequence[StepRequest]) -> list[list[int]]:
        ids = list(self.executor.enqueue_requests([to_executor_request(s, self.trtllm) for s in steps]))
        outputs: dict[int, list[int]] = {}
        pending = set(ids)
        deadline = time.monotonic() + self.timeout.total_seconds()
        while pending:
            if time.monotonic() > deadline:
                raise TimeoutError(f"TensorRT-LLM did not finish {len(pending)} request(s) in {self.timeout}")
            for per_id in self.executor.await_responses(sorted(pending), self.timeout):
                for response in per_id:
                    if response.has_error():
                        raise RuntimeError(f"TensorRT-LLM request {response.request_id} failed: {response.error_msg}")
                    result = response.result
                    outputs[response.request_id] = [int(t) for t in result.output_token_ids[0]]  # beam 0
                    if result.is_final:
                        pending.discard(response.request_id)
        return [outputs[i] for i in ids]

    def shutdown(self) -> None:
        self.executor.shutdown()


# ---- the engine -------------------------------------------------------------------------------------------------


@dataclass
class _Request:
    context: list[int]  # tokens before the root (what a step request re-submits; the executor caches their KV)
    root: int
    pending: tuple[DraftTree, list[int]] | None = None  # last verified tree and the target's continuation


class TensorRTLLMEngine:
    """`TargetEngine` over a TensorRT-LLM engine folder (see the module docstring for the step mapping)."""

    attention_layout = "packed"  # paged attention over each request's own tokens and context
    device = "cuda"  # verifies on the GPU: the orchestrator may draft one micro-batch while another is verified

    def __init__(self, engine_dir: str | Path, *, backend: StepBackend | None = None,
                 eos_token_ids: Sequence[int] | None = None, kv_cache_free_gpu_memory_fraction: float = 0.9,
                 kv_cache_max_tokens: int | None = None, enable_chunked_context: bool = True,
                 block_size: int | None = None, timeout_s: float = 120.0) -> None:
        self.config: EngineConfig = read_engine_config(engine_dir)
        c = self.config
        self.vocab_size: int = c.vocab_size
        # TorchEngine's contract is context + root + nodes <= max_context; TensorRT-LLM must also fit the bonus token
        # of the step in max_seq_len (input + outputs), hence one less.
        self.max_context: int = c.max_seq_len - 1
        self._max_seq_len = c.max_seq_len
        self.max_draft_len: int = c.max_draft_len
        self.eos_token_ids: tuple[int, ...] = tuple(eos_token_ids) if eos_token_ids is not None else c.eos_token_ids
        self.end_id = self.eos_token_ids[0] if self.eos_token_ids else None
        self.pad_id = c.pad_token_id if c.pad_token_id is not None else self.end_id
        # Admission ledger in blocks (TensorRT-LLM's own KV manager is the authority; this keeps the orchestrator's
        # admission honest): capacity = kv_cache_max_tokens, or every slot of the engine at full length.
        self.block_size = block_size or c.tokens_per_block or 32
        kv_tokens = kv_cache_max_tokens or c.max_batch_size * c.max_seq_len
        self._total_blocks = max(1, kv_tokens // self.block_size)
        self.backend: StepBackend = backend or ExecutorBackend(
            engine_dir, kv_cache_free_gpu_memory_fraction=kv_cache_free_gpu_memory_fraction,
            kv_cache_max_tokens=kv_cache_max_tokens, enable_chunked_context=enable_chunked_context,
            timeout_s=timeout_s)
        self._requests: dict[object, _Request] = {}

    # ---- capacity ---------------------------------------------------------------------------------------------

    @property
    def requests(self) -> KeysView:
        return self._requests.keys()

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-int(num_tokens) // self.block_size)

    def total_blocks(self) -> int:
        return self._total_blocks

    def free_blocks(self) -> int:
        used = sum(self.blocks_needed(len(r.context) + 1) for r in self._requests.values())
        return self._total_blocks - used

    def can_admit(self, prompt_len: int, max_new_tokens: int) -> bool:
        return (prompt_len + max_new_tokens <= self.max_context
                and self.blocks_needed(prompt_len + max_new_tokens) <= self.free_blocks())

    def context_length(self, request_id) -> int:
        return len(self._get(request_id).context)

    # ---- lifecycle --------------------------------------------------------------------------------------------

    def add_request(self, request_id, prompt_ids: Sequence[int], sampling: SamplingParams = _GREEDY, *,
                    cache_salt: str | None = None) -> int:
        check_new_request(request_id, sampling, self._requests)
        if cache_salt is not None:
            raise RequestError(request_id, "TensorRTLLMEngine's executor reuses KV blocks across all requests "
                               "(enable_block_reuse) and takes no cache salt: drop cache_salt")
        if not sampling.greedy:
            raise RequestError(request_id, "TensorRTLLMEngine verifies greedy requests only (temperature 0); use "
                               "TorchEngine for sampled speculation")
        prompt = self._check_ids(request_id, prompt_ids, "prompt")
        if not prompt:
            raise RequestError(request_id, "empty prompt; pass at least one token (e.g. the BOS token)")
        if len(prompt) >= self.max_context or len(prompt) > self.config.max_input_len:
            raise RequestError(request_id, f"prompt has {len(prompt)} tokens; the engine takes at most "
                               f"{min(self.max_context - 1, self.config.max_input_len)} (max_input_len "
                               f"{self.config.max_input_len}, max_seq_len {self._max_seq_len}): truncate it")
        if self.blocks_needed(len(prompt) + 1) > self.free_blocks():
            raise KVCacheFullError(request_id, f"needs {self.blocks_needed(len(prompt) + 1)} KV blocks, "
                                   f"{self.free_blocks()} free: retry after other requests finish")
        (out,) = self.backend.run([prefill_request(prompt, end_id=self.end_id, pad_id=self.pad_id)])
        if not out:
            raise RequestError(request_id, "TensorRT-LLM returned no token for the prompt")
        self._requests[request_id] = _Request(context=prompt, root=int(out[0]))
        return int(out[0])

    def verify(self, items: Sequence[VerifyItem]) -> VerifyOutput:
        t0 = time.perf_counter()
        items = list(items)
        if not items:
            raise ValueError("verify needs at least one VerifyItem")
        seen: set = set()
        paths = []
        for item in items:  # validate everything before running anything
            if not isinstance(item, VerifyItem) or not isinstance(item.tree, DraftTree):
                raise ValueError(f"verify takes VerifyItem(request_id, DraftTree) objects; got {item!r}")  # noqa: TRY004
            req = self._get(item.request_id)
            if item.request_id in seen:
                raise RequestError(item.request_id, "appears twice in one verify batch")
            seen.add(item.request_id)
            try:
                item.tree.validate(self.vocab_size)
            except InvalidTreeError as e:
                raise RequestError(item.request_id, f"invalid draft tree: {e}") from None
            depth = int(item.tree.depth.max()) if len(item.tree) else 0
            if len(req.context) + 1 + depth + 1 > self._max_seq_len:  # as TorchEngine: the tree must fit
                raise RequestError(item.request_id, f"context {len(req.context)} + root + a tree {depth} deep + the "
                                   f"bonus token exceed max_seq_len {self._max_seq_len}: send a smaller tree or "
                                   "finish the request")
            room = self._room(item.request_id, len(req.context) + 1)
            paths.append(item.tree.best_path_nodes(max_len=min(self.max_draft_len, room)))
        steps = [verify_request(self._requests[i.request_id].context, self._requests[i.request_id].root,
                                i.tree.tokens[p], end_id=self.end_id, pad_id=self.pad_id) for i, p in zip(items, paths)]
        t1 = time.perf_counter()
        outputs = self.backend.run(steps)
        rounds = 1
        while True:  # extra rounds only where the walk reaches an off-path node the output does not cover
            need = {}
            for k, item in enumerate(items):
                _, node = targets_from_output(item.tree, outputs[k])
                if node is not None:
                    need[k] = node
            if not need:
                break
            follow = []
            for k, node in need.items():
                req = self._requests[items[k].request_id]
                seq = len(req.context) + 1 + len(outputs[k])
                room = self._room(items[k].request_id, seq)
                below = items[k].tree.best_path_nodes(max_len=min(self.max_draft_len, room), below=node)
                follow.append(verify_request(req.context + [req.root] + outputs[k][:-1], outputs[k][-1],
                                             items[k].tree.tokens[below], end_id=self.end_id, pad_id=self.pad_id))
            for k, extra in zip(need, self.backend.run(follow)):
                if not extra:  # every round must extend the continuation, or this loop would not end
                    raise RuntimeError(f"TensorRT-LLM returned no token for request {items[k].request_id!r}")
                outputs[k] = outputs[k] + extra
            rounds += 1
        t2 = time.perf_counter()
        results = []
        for k, item in enumerate(items):
            targets, _ = targets_from_output(item.tree, outputs[k])
            self._requests[item.request_id].pending = (item.tree, outputs[k])
            results.append(VerifyResult(item.request_id, targets))
        t3 = time.perf_counter()
        return VerifyOutput(results, {
            "prepare_ms": (t1 - t0) * 1e3, "forward_ms": (t2 - t1) * 1e3, "sample_ms": (t3 - t2) * 1e3,
            "total_ms": (t3 - t0) * 1e3, "rounds": float(rounds),
            "num_tokens": float(sum(len(s.draft_tokens) + 1 for s in steps)),
        })

    def commit(self, request_id, accepted_node_ids: Sequence[int], next_root: int) -> None:
        req = self._get(request_id)
        if req.pending is None:
            raise RequestError(request_id, "commit without a preceding verify")
        tree, output = req.pending
        acc = [int(i) for i in np.asarray(accepted_node_ids, dtype=np.int64).reshape(-1)]
        expected_parent = -1
        for node in acc:
            if not 0 <= node < len(tree) or int(tree.parents[node]) != expected_parent:
                raise RequestError(request_id, f"accepted nodes {acc} are not a root path of the verified tree")
            expected_parent = node
        new = [int(tree.tokens[i]) for i in acc] + [int(next_root)]
        if new != output[:len(new)]:
            raise RequestError(request_id, f"tokens {new} disagree with the target's greedy continuation "
                               f"{output[:len(new)]}: commit what acceptance returned for the last verify")
        req.context = req.context + [req.root] + new[:-1]
        req.root = int(next_root)
        req.pending = None

    def release(self, request_id) -> None:
        self._get(request_id)
        del self._requests[request_id]

    def shutdown(self) -> None:
        self.backend.shutdown()

    def __enter__(self) -> TensorRTLLMEngine:  # noqa: PYI034
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- internals --------------------------------------------------------------------------------------------

    def _room(self, request_id, sequence_len: int) -> int:
        """Draft tokens a step may carry when the step's input is `sequence_len` tokens long: input + draft +
        bonus must fit max_seq_len, and the input must fit max_input_len."""
        if sequence_len > self.config.max_input_len:
            raise RequestError(request_id, f"the sequence has {sequence_len} tokens; the engine's max_input_len is "
                               f"{self.config.max_input_len} and every step re-submits the whole sequence: rebuild "
                               "with --max-input-len = --max-seq-len - 1")
        room = self._max_seq_len - sequence_len - 1
        if room < 0:
            raise RequestError(request_id, f"the sequence has {sequence_len} tokens; no room for another token "
                               f"within max_seq_len {self._max_seq_len}: finish the request")
        return room

    def _get(self, request_id) -> _Request:
        try:
            return self._requests[request_id]
        except (KeyError, TypeError):
            raise RequestError(request_id, "unknown request (never added, or already released)") from None

    def _check_ids(self, request_id, ids, what: str) -> list[int]:
        arr = np.asarray(ids)
        if arr.size == 0:
            return []
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            raise RequestError(request_id, f"{what} must be a 1-D sequence of int token ids")
        if arr.min() < 0 or arr.max() >= self.vocab_size:
            raise RequestError(request_id, f"{what} token ids must lie in [0, {self.vocab_size})")
        return [int(t) for t in arr]
