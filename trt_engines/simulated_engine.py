"""A `TargetEngine` that replays recorded greedy trajectories on an event clock (for `retrospec simulate`).

It answers every verified position with the token the real target produced there (the recorded greedy output), so
the orchestrator's drafting, budgeting and acceptance run for real and acceptance is exact for that trajectory;
time is not spent but counted: each prefill and each verify advances a `SimClock` by the roofline step-time model's
prediction for that step's composition (tokens and context per request) on the chosen model shape and device.

Vocabulary as in `trt_engines/base.py`. For a request whose recorded output is `out`, after `j` committed output
tokens the root is `out[j]`; the target token after the root is `out[j + 1]`, and after a node at depth d whose path
equals `out[j + 1 : j + 1 + d]` it is `out[j + 1 + d]`. Nodes off the trajectory get the EOS id: acceptance never
looks at them (a node is only reached through a parent whose target token it matched).

Example:

    clock = SimClock()
    engine = SimulatedEngine(step_model, clock, trajectories={tuple(prompt): output}, vocab_size=49152)
    root = engine.add_request("r", prompt, SamplingParams())   # == output[0]; clock advanced by the prefill
    engine.verify([VerifyItem("r", DraftTree.chain(output[1:4]))]).results[0].target_tokens  # == output[1:5]
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from trt_engines.base import (
    KVCacheFullError,
    RequestError,
    SamplingParams,
    VerifyItem,
    VerifyOutput,
    VerifyResult,
    check_chunk_tokens,
    check_new_request,
)
from trt_engines.kv_cache import PrefixIndex


class SimClock:
    """Simulated seconds. Nothing sleeps: engines and the simulation loop advance it explicitly."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = float(start)

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"the clock cannot go back ({seconds} s)")
        self.now += seconds


@dataclass
class _Replay:
    output: np.ndarray  # int32: the recorded greedy output; output[0] is the prefill's token
    committed: int  # output tokens before the current root (the root is output[committed])
    ctx_len: int  # tokens with (simulated) cached KV
    pending: int | None = None  # tree size of the last verify, until commit
    prompt: np.ndarray | None = None  # int64, kept for the prefix cache
    cached_prompt: int = 0  # prompt tokens read from the prefix cache
    cache_salt: str | None = None
    prompt_left: int = 0  # prompt tokens still to prefill (chunked prefill)


class SimulatedEngine:
    """Replays recorded outputs; costs come from a `StepTimeModel` (anything with `predict(tokens, context)`), and
    prefills from `prefill_model` when given (a fit on measured prefills), else from the same model. With
    `prefix_caching` a prompt's leading full blocks that an earlier request (same salt) prefilled or generated are
    not charged, as `TorchEngine` and TensorRT-LLM's block reuse skip them (capacity is not modelled: nothing is
    evicted)."""

    def __init__(
        self,
        step_model,
        clock: SimClock,
        *,
        trajectories: Mapping[tuple[int, ...], Sequence[int]],
        vocab_size: int,
        eos_token_ids: tuple[int, ...] = (),
        max_context: int = 8192,
        num_blocks: int = 65536,
        block_size: int = 16,
        prefill_model=None,
        device: str = "cpu",
        prefix_caching: bool = False,
    ) -> None:
        if not trajectories:
            raise ValueError("SimulatedEngine needs at least one recorded trajectory (prompt ids -> output ids)")
        self.step_model = step_model
        self.prefill_model = prefill_model or step_model  # prefills may have their own fitted constants
        self.clock = clock
        self.device = device  # the device it stands for (the orchestrator splits batches only off the CPU)
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_context = max_context
        self.block_size = block_size
        self.num_blocks = num_blocks
        self._outputs = {tuple(int(t) for t in p): np.asarray(o, dtype=np.int32) for p, o in trajectories.items()}
        self._filler = self.eos_token_ids[0] if self.eos_token_ids else 0
        self._requests: dict[object, _Replay] = {}
        self._blocks: dict[object, int] = {}
        self._prefixes = PrefixIndex(block_size) if prefix_caching else None
        self._published = 0  # stand-in block ids for the prefix index
        self.simulated_s = 0.0  # engine seconds charged to the clock
        self.wall_s = 0.0  # real seconds spent inside this engine's methods (the simulation loop subtracts them)

    # ---- capacity (same accounting as the paged cache: whole blocks per request) ------------------------------
    def free_blocks(self) -> int:
        return self.num_blocks - sum(self._blocks.values())

    def total_blocks(self) -> int:
        return self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-int(num_tokens) // self.block_size)

    def can_admit(self, prompt_len: int, max_new_tokens: int) -> bool:
        return self.blocks_needed(prompt_len + max_new_tokens) <= self.free_blocks()

    @property
    def requests(self):
        return self._requests.keys()

    # ---- lifecycle ------------------------------------------------------------------------------------------
    def add_request(self, request_id, prompt_ids: Sequence[int], sampling: SamplingParams = SamplingParams(), *,
                    cache_salt: str | None = None, prefill_tokens: int | None = None) -> int | None:
        """`TorchEngine.add_request`'s contract, chunked prefill included: charges the prefill of the prompt's
        uncached tokens (at most `prefill_tokens` of them now; None is returned while some are left)."""
        started = time.perf_counter()
        check_new_request(request_id, sampling, self._requests)
        if not sampling.greedy:
            raise RequestError(request_id, "the simulator replays greedy trajectories: use temperature 0")
        if prefill_tokens is not None:
            check_chunk_tokens(request_id, prefill_tokens, "prefill_tokens")
        key = tuple(int(t) for t in prompt_ids)
        output = self._outputs.get(key)
        if output is None:
            raise RequestError(request_id, f"no recorded trajectory for this prompt ({len(key)} tokens): simulate "
                                           "only prompts of the loaded trajectory files")
        need = self.blocks_needed(len(key))
        if need > self.free_blocks():
            raise KVCacheFullError(request_id, f"prompt needs {need} KV blocks, {self.free_blocks()} free")
        prompt = np.asarray(key, dtype=np.int64)
        cached = 0
        if self._prefixes is not None:
            cached = len(self._prefixes.match(prompt, (len(key) - 1) // self.block_size, cache_salt)) * self.block_size
        req = _Replay(output=output, committed=0, ctx_len=cached, prompt=prompt, cached_prompt=cached,
                      cache_salt=cache_salt, prompt_left=len(key) - cached)
        self._requests[request_id] = req
        self._blocks[request_id] = need
        first = self._prefill_chunk(req, prefill_tokens)
        self.wall_s += time.perf_counter() - started
        return first

    def prefill(self, request_id, max_tokens: int) -> int | None:
        """`TorchEngine.prefill`: charges the next chunk of a prompt started with `prefill_tokens`."""
        started = time.perf_counter()
        req = self._get(request_id)
        if not req.prompt_left:
            raise RequestError(request_id, "its prompt is prefilled already: verify it")
        check_chunk_tokens(request_id, max_tokens, "max_tokens")
        first = self._prefill_chunk(req, max_tokens)
        self.wall_s += time.perf_counter() - started
        return first

    def prompt_tokens_left(self, request_id) -> int:
        return self._get(request_id).prompt_left

    def _prefill_chunk(self, req: _Replay, max_tokens: int | None) -> int | None:
        chunk = req.prompt_left if max_tokens is None else min(req.prompt_left, max_tokens)
        self._charge(self.prefill_model.predict(np.array([chunk]), np.array([req.ctx_len])))
        req.ctx_len += chunk
        req.prompt_left -= chunk
        if self._prefixes is not None:
            self._publish(req.prompt[:req.ctx_len], req.cache_salt)
        return None if req.prompt_left else int(req.output[0])

    def verify(self, items: Sequence[VerifyItem]) -> VerifyOutput:
        started = time.perf_counter()
        if not items:
            raise ValueError("verify needs at least one VerifyItem")
        results, tokens, context = [], [], []
        for item in items:
            req = self._get(item.request_id)
            if req.prompt_left:
                raise RequestError(item.request_id, f"its prompt is still being prefilled ({req.prompt_left} tokens "
                                                    "left): call prefill until it returns the first token")
            tree = item.tree
            n = len(tree)
            if req.ctx_len + n + 1 > self.max_context:
                raise RequestError(item.request_id, f"context {req.ctx_len} + root + {n} nodes exceeds {self.max_context}")
            results.append(VerifyResult(item.request_id, self._targets(req, tree)))
            req.pending = n
            self._blocks[item.request_id] = self.blocks_needed(req.ctx_len + n + 1)
            tokens.append(n + 1)
            context.append(req.ctx_len)
        if self.free_blocks() < 0:
            raise KVCacheFullError(items[0].request_id, "the batch's trees do not fit in the KV blocks")
        seconds = self.step_model.predict(np.asarray(tokens, dtype=np.float64), np.asarray(context, dtype=np.float64))
        self._charge(seconds)
        self.wall_s += time.perf_counter() - started
        ms = seconds * 1e3
        return VerifyOutput(results, {"forward_ms": ms, "total_ms": ms, "num_tokens": float(sum(tokens))})

    def commit(self, request_id, accepted_node_ids: Sequence[int], next_root: int) -> None:
        req = self._get(request_id)
        if req.pending is None:
            raise RequestError(request_id, "commit without a preceding verify")
        n_acc = len(accepted_node_ids)
        committed = req.committed + 1 + n_acc
        if n_acc > req.pending:
            raise RequestError(request_id, f"{n_acc} accepted nodes from a tree of {req.pending}")
        if committed < len(req.output) and int(next_root) != int(req.output[committed]):
            raise RequestError(request_id, f"next root {next_root} is not the recorded token "
                                           f"{int(req.output[committed])}: acceptance left the trajectory")
        req.committed = committed
        req.ctx_len += 1 + n_acc
        req.pending = None
        self._blocks[request_id] = self.blocks_needed(req.ctx_len)

    def release(self, request_id) -> None:
        req = self._get(request_id)
        del self._requests[request_id]
        del self._blocks[request_id]
        if self._prefixes is not None and not req.prompt_left:  # the output's blocks too, as `TorchEngine` does
            self._publish(np.concatenate([req.prompt, req.output[:req.committed]]), req.cache_salt)

    def cached_prompt_tokens(self, request_id) -> int:
        return self._get(request_id).cached_prompt

    def _publish(self, tokens: np.ndarray, salt: str | None) -> None:
        blocks = len(tokens) // self.block_size
        self._prefixes.publish(tokens, range(self._published, self._published + blocks), salt)
        self._published += blocks

    # ---- internals ------------------------------------------------------------------------------------------
    def _get(self, request_id) -> _Replay:
        try:
            return self._requests[request_id]
        except (KeyError, TypeError):
            raise RequestError(request_id, "unknown request (never added, or already released)") from None

    def _charge(self, seconds: float) -> None:
        self.simulated_s += seconds
        self.clock.advance(seconds)

    def _targets(self, req: _Replay, tree) -> np.ndarray:
        """Recorded token after the root and after every node on the trajectory; the filler elsewhere."""
        out, j = req.output, req.committed
        n = len(tree)
        targets = np.full(n + 1, self._filler, dtype=np.int32)
        if j + 1 < len(out):
            targets[0] = out[j + 1]
        if n == 0:
            return targets
        depth = tree.depth.astype(np.int64)
        within = j + depth < len(out)
        on_path = within & (tree.tokens == out[np.minimum(j + depth, len(out) - 1)])
        for d in range(2, int(depth.max()) + 1):  # a node is on the trajectory when it and all its ancestors are
            level = depth == d
            on_path[level] &= on_path[tree.parents[level]]
        nxt = j + 1 + depth
        ok = on_path & (nxt < len(out))
        targets[1:][ok] = out[nxt[ok]]
        return targets
