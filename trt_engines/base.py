"""The `TargetEngine` protocol: what the orchestrator may ask of any target model (PyTorch now, TensorRT-LLM later).

Vocabulary:
    context     the tokens whose keys/values are in the engine's KV cache for a request (`ctx_len` of them).
    root        the last accepted token. It is NOT cached yet: every `verify` feeds [root, tree nodes...] at positions
                `ctx_len + [0, depth...]`, and `commit` caches the root plus the accepted path.
    target token  the target model's choice at a verified position: argmax (greedy) or a sample, drawn with a
                uniform of the request's seed and that position alone (`trt_engines.sampling.position_uniforms`),
                so the same position samples the same token in any tree and any batch, as plain decoding does.
                `target_tokens[0]` follows the root, `target_tokens[1 + i]` follows node i.
    bonus token the target token at the last accepted node (or at the root when nothing is accepted); it becomes the
                next root.

Lifecycle of one request (worked example, greedy, a chain draft of 3 tokens whose first 2 are right):

    root = engine.add_request("r1", prompt_ids, SamplingParams())   # prefill; root = first generated token
    out = engine.verify([VerifyItem("r1", DraftTree.chain([a, b, c]))])
    out.results[0].target_tokens       # e.g. [a, b, x, y]: a matches node 0, b matches node 1, x != c
    engine.commit("r1", [0, 1], next_root=x)   # caches root, a, b; x becomes the root; 3 new tokens a, b, x
    engine.release("r1")

Chunked prefill (engines that have `prefill`): `add_request(..., prefill_tokens=k)` computes at most k prompt tokens
and returns None while some are left; `prefill(request_id, k)` computes the next chunk and returns the first
generated token once the prompt is all in. A request is verified only after that.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol, Sequence, runtime_checkable

import numpy as np

from drafter.tree import DraftTree


class RequestError(ValueError):
    """A request-level problem (bad ids, unknown request, bad tree); nothing in the engine was changed."""

    def __init__(self, request_id, problem: str):
        self.request_id = request_id
        super().__init__(f"request {request_id!r}: {problem}")


class InvalidField(ValueError):
    """A request field with a value no engine can serve; `field` names it (the HTTP API reports it as OpenAI's
    `param`)."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(message)


class KVCacheFullError(RequestError):
    """Not enough free KV blocks for this request right now; retry after other requests are released."""


# Where `TorchEngine` runs bf16 on the CPU through its numba kernels (`trt_engines.cpu_kernels`): linear layers and
# attention, attention only, or neither; "auto" picks by the CPU (`TorchEngine`).
CPU_KERNEL_CHOICES = ("auto", "numba", "attention", "torch")


def check_cpu_kernels(value: str) -> None:
    """A ValueError that lists CPU_KERNEL_CHOICES unless `value` is one of them."""
    if value not in CPU_KERNEL_CHOICES:
        raise ValueError(f"cpu_kernels must be one of {', '.join(CPU_KERNEL_CHOICES)}; got {value!r}")


MAX_LOGPROBS = 20  # most likely tokens a request may ask for per position (OpenAI's chat limit, vLLM's default)


@dataclass(frozen=True)
class SamplingParams:
    """How a request picks target tokens. temperature 0 = greedy (argmax); otherwise softmax(logits / temperature)
    restricted to the `top_k` most likely tokens (0 = all) and then to the smallest top set whose mass reaches
    `top_p` (with every token as likely as its least likely one: ties at the edge are kept, whatever a sort's
    order). `seed` (None = a random one) fixes the draw at every position of the output: a seeded request samples
    the same tokens again, with speculation or without. `logprobs` (None = none) asks for each output token's log
    probability and the `logprobs` most likely tokens' (at most MAX_LOGPROBS), under the model's own distribution:
    log_softmax of its logits, before temperature, top-k and top-p (what vLLM returns by default); it changes no
    token."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature) and self.temperature >= 0):
            raise InvalidField("temperature",
                               f"temperature must be a finite number >= 0 (0 = greedy); got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise InvalidField("top_p", f"top_p must lie in (0, 1] (1 = no nucleus cut); got {self.top_p!r}")
        if not (isinstance(self.top_k, int) and not isinstance(self.top_k, bool) and self.top_k >= 0):
            raise InvalidField("top_k", f"top_k must be an int >= 0 (0 = no top-k cut); got {self.top_k!r}")
        if self.seed is not None and not (isinstance(self.seed, int) and 0 <= self.seed < 2**63):
            raise InvalidField("seed", f"seed must be None or an int in [0, 2**63); got {self.seed!r}")
        if self.logprobs is not None and not (isinstance(self.logprobs, int) and not isinstance(self.logprobs, bool)
                                              and 0 <= self.logprobs <= MAX_LOGPROBS):
            raise InvalidField("logprobs", f"logprobs must be None or an int in [0, {MAX_LOGPROBS}] (how many of the "
                                           f"most likely tokens to return beside the chosen one); got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def check_new_request(request_id, sampling, active, *, returns_logprobs: bool = False) -> None:
    """What every engine checks before admitting a request: `sampling` is a SamplingParams (asking for logprobs only
    of an engine that `returns_logprobs`), the id is hashable and not already active. Raises RequestError (nothing
    changed)."""
    if not isinstance(sampling, SamplingParams):
        raise RequestError(request_id, f"sampling must be a SamplingParams, got {type(sampling).__name__}")
    if sampling.logprobs is not None and not returns_logprobs:
        raise RequestError(request_id, "this engine does not return log probabilities: send logprobs=None")
    try:
        hash(request_id)
    except TypeError:
        raise RequestError(request_id, "request ids must be hashable (str or int)") from None
    if request_id in active:
        raise RequestError(request_id, "already active; release it first or use a new id")


def check_chunk_tokens(request_id, tokens, what: str) -> None:
    """A chunk size for `add_request(prefill_tokens=)` or `prefill`: an int >= 1. Raises RequestError (nothing
    changed)."""
    if isinstance(tokens, bool) or not isinstance(tokens, (int, np.integer)) or tokens < 1:
        raise RequestError(request_id, f"{what} must be an int >= 1 (prompt tokens to compute now); got {tokens!r}")


@dataclass(frozen=True)
class VerifyItem:
    """One request of a verify batch: its draft tree (empty tree = plain decoding step)."""

    request_id: object
    tree: DraftTree


@dataclass(frozen=True)
class TokenLogprobs:
    """Log probabilities at R positions, one row per token a step yields: of the target token chosen there
    (`chosen`), and the k most likely tokens there, most likely first (`top_ids`, `top_logprobs`; k =
    `SamplingParams.logprobs`)."""

    chosen: np.ndarray  # float32 [R]
    top_ids: np.ndarray  # int64 [R, k]
    top_logprobs: np.ndarray  # float32 [R, k]


@dataclass(frozen=True)
class VerifyResult:
    request_id: object
    target_tokens: np.ndarray  # int32 [n + 1]: target token after the root, then after each node
    logits: "object | None" = None  # fp32 [n + 1, vocab] in the same order, when the engine was asked for them
    # For a request whose sampling asks for them: rows of the tokens the step yields only, in their order (the
    # root's target, then each node of `tree.accepted_path(target_tokens)`'s): the other rows are never output.
    logprobs: TokenLogprobs | None = None


@dataclass(frozen=True)
class VerifyOutput:
    results: list[VerifyResult]
    timings: dict[str, float] = field(default_factory=dict)  # at least forward_ms and total_ms


@runtime_checkable
class TargetEngine(Protocol):
    vocab_size: int
    max_context: int
    eos_token_ids: tuple[int, ...]

    def add_request(self, request_id, prompt_ids: Sequence[int], sampling: SamplingParams) -> int:
        """Prefill the prompt; return the first generated token (the root of the first verify). Engines with
        `returns_logprobs` True also serve `sampling.logprobs`: `first_token_logprobs(request_id)` gives that
        token's (one row of `TokenLogprobs`), and each `VerifyResult.logprobs` those of its step's tokens; others
        refuse it."""

    def verify(self, items: Sequence[VerifyItem]) -> VerifyOutput:
        """One forward over every item's [root, nodes...]; target tokens per position."""

    def commit(self, request_id, accepted_node_ids: Sequence[int], next_root: int) -> None:
        """Cache the root and the accepted path (root-to-node order) of the last verify; `next_root` is the new root."""

    def release(self, request_id) -> None: ...

    def free_blocks(self) -> int: ...

    def total_blocks(self) -> int:
        """KV blocks the engine has in all (free + in use): the admission ledger's capacity."""

    def blocks_needed(self, num_tokens: int) -> int: ...

    def can_admit(self, prompt_len: int, max_new_tokens: int) -> bool: ...
