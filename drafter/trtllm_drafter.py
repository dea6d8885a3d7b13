"""Our drafter inside TensorRT-LLM's own scheduler: the LLM API's custom-drafter hook (PyTorch backend).

TensorRT-LLM's `LLM(..., speculative_config=UserProvidedDecodingConfig(max_draft_len=N, drafter=D,
resource_manager=R))` calls `D.prepare_draft_tokens(scheduled_requests, resource_manager)` every iteration of its
in-flight batching loop, before the target forward; the drafter writes each generation request's draft into
`request.py_draft_tokens` (a list of at most N tokens); TensorRT-LLM verifies it (greedy: the longest prefix equal to
the target's tokens, plus one token) and `R.free_resources(request)` is called when a request ends.

Pieces:
    LinearDraftPlanner   plain Python, testable anywhere: our `Drafter` + a budget -> one linear draft per request.
                         Keeps our per-request drafter state in step with TensorRT-LLM's requests (start on first
                         sight, extend with the tokens generated since, stop on free_resources or after
                         `max_idle_steps` plans without the request), asks the budget how many tree nodes each
                         request gets, and reduces each tree to its best path (`DraftTree.best_path_nodes`).
                         A request the budget gives 0 nodes gets an empty draft: no speculation for it this step.
    trtllm_drafter_classes()   defines `RetrospecDrafter(tensorrt_llm...Drafter)` and
                         `RetrospecDraftResources(BaseResourceManager)` only when tensorrt_llm imports.
    user_provided_config(planner)   the `UserProvidedDecodingConfig` to pass to `LLM`.

The budget is a callable `(trees, context_lens) -> trees`, so the orchestrator's controller plugs in from the
caller's side, e.g. `budget=lambda trees, ctx: controller.allocate(trees, ctx)[0]` with
`draft_cap=controller.draft_cap` (orchestrator.budget.BudgetController). Not wired: the controller's closed loop
(`observe`), because TensorRT-LLM, not our orchestrator, sees each step's acceptance.

Where this lives and why: drafter/ owns turning our draft trees into what a verifier asks for. This module imports
nothing from trt_engines/ (our engines) or orchestrator/ (scheduling); TensorRT-LLM is a third-party host imported
lazily inside `trtllm_drafter_classes`. So the package rule (drafter and trt_engines never import each other;
orchestrator -> drafter) holds, and the budget arrives as data from whoever assembles the LLM.

Limits of TensorRT-LLM 1.2 on this path (from its source; not observed on hardware):
    - the executor pads every generation request's draft to max_draft_len after `prepare_draft_tokens`
      (`Drafter.pad_draft_tokens_for_cuda_graph`, py_executor.py), so a shorter or empty draft saves no target
      compute there: it only changes what is proposed. An empty draft still cannot be accepted wrongly: padding
      tokens are verified like any draft token, so output stays the target's greedy output.
    - the user-provided path supports linear drafts only (`max_total_draft_tokens = max_draft_len`).
    - drafts produced outside the model come with "KV cache reuse must be disabled" and "overlap scheduling must be
      disabled" in TensorRT-LLM's developer guide (docs/source/torch/speculative_decoding.md), and greedy acceptance
      only; the GPU test runs that way (`disable_overlap_scheduler=True`, `enable_block_reuse=False`).

Checked against (read, not copied; NVIDIA/TensorRT-LLM 1.x on GitHub): tensorrt_llm/_torch/speculative/drafter.py
(`Drafter.__init__(max_draft_len, max_total_draft_tokens, max_concurrency, draft_len_schedule)` in 1.2, just
`(max_concurrency)` earlier; abstract `prepare_draft_tokens(scheduled_requests, resource_manager=None)`),
tensorrt_llm/_torch/speculative/ngram.py (`scheduled_requests.generation_requests`, `request.get_tokens(0)`,
`request.request_id`, `request.py_orig_prompt_len`, `request.py_draft_tokens = ...`),
tensorrt_llm/_torch/pyexecutor/resource_manager.py (`BaseResourceManager`: get_max_resource_count,
get_needed_resource_to_completion, free_resources), tensorrt_llm/llmapi/llm_args.py (`UserProvidedDecodingConfig(
max_draft_len=..., drafter=..., resource_manager=None)`), tensorrt_llm/_torch/speculative/utils.py
(`get_spec_drafter` returns `spec_config.drafter` for USER_PROVIDED), docs/source/features/speculative-decoding.md.

Example (GPU machine with TensorRT-LLM 1.2):

    planner = LinearDraftPlanner(Drafter(DrafterConfig(), datastores=[ds]), max_draft_len=8, draft_cap=16)
    llm = LLM(model_dir, speculative_config=user_provided_config(planner), disable_overlap_scheduler=True,
              kv_cache_config=KvCacheConfig(enable_block_reuse=False))
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from drafter.tree import DraftTree

Budget = Callable[[list[DraftTree], np.ndarray], Sequence[DraftTree]]


@dataclass(frozen=True)
class RequestView:
    """What the planner needs of one TensorRT-LLM generation request."""

    request_id: Hashable
    tokens: Sequence[int]  # prompt + generated so far (the last one is the root of this step's draft)
    prompt_len: int


class LinearDraftPlanner:
    """One linear draft per request per step from a tree drafter (`start_request / extend / stop_request / draft`).

    Example:

        planner = LinearDraftPlanner(drafter, max_draft_len=4, draft_cap=8)
        planner.plan([RequestView(7, prompt + [first], len(prompt))])   # -> [[t1, t2, ...]] (<= 4 tokens)
        planner.release(7)
    """

    def __init__(self, drafter, *, max_draft_len: int, draft_cap: int | Callable[[int], int] = 16,
                 budget: Budget | None = None, max_idle_steps: int = 256, max_sessions: int = 4096) -> None:
        if max_draft_len < 1:
            raise ValueError(f"max_draft_len must be >= 1; got {max_draft_len}")
        self.drafter = drafter
        self.max_draft_len = int(max_draft_len)
        self.draft_cap = draft_cap
        self.budget = budget
        self.max_idle_steps = max_idle_steps
        self.max_sessions = max_sessions
        self.steps = 0
        self.fallbacks = 0  # steps whose drafting failed (those requests decode plainly)
        self._seen: dict[Hashable, int] = {}  # request id -> tokens the drafter has
        self._last_step: dict[Hashable, int] = {}

    @property
    def active(self) -> list[Hashable]:
        return list(self._seen)

    def plan(self, views: Sequence[RequestView]) -> list[list[int]]:
        """Draft tokens for each request (an empty list = no speculation for it this step)."""
        self.steps += 1
        for view in views:
            self._sync(view)
        self._expire()
        cap = self.draft_cap(len(views)) if callable(self.draft_cap) else int(self.draft_cap)
        if cap <= 0 or not views:
            return [[] for _ in views]
        try:
            trees = list(self.drafter.draft([(v.request_id, cap) for v in views]))
            if self.budget is not None:
                context = np.array([len(v.tokens) for v in views], dtype=np.float64)
                trees = list(self.budget(trees, context))
        except Exception:  # noqa: BLE001 - a drafter failure must never fail a request: decode plainly
            self.fallbacks += 1
            return [[] for _ in views]
        return [[int(t) for t in tree.tokens[tree.best_path_nodes(max_len=self.max_draft_len)]] for tree in trees]

    def release(self, request_id: Hashable) -> None:
        """Free our state of a request (TensorRT-LLM's free_resources); unknown ids are ignored."""
        if self._seen.pop(request_id, None) is not None:
            self._last_step.pop(request_id, None)
            self.drafter.stop_request(request_id)

    def close(self) -> None:
        for rid in list(self._seen):
            self.release(rid)

    def _sync(self, view: RequestView) -> None:
        tokens = np.asarray(view.tokens, dtype=np.int32).reshape(-1)
        have = self._seen.get(view.request_id)
        if have is not None and have > tokens.size:  # the request went back (should not happen): start over
            self.release(view.request_id)
            have = None
        if have is None:
            if len(self._seen) >= self.max_sessions:
                oldest = min(self._last_step, key=self._last_step.get)
                self.release(oldest)
            prompt_len = min(max(int(view.prompt_len), 1), tokens.size)
            self.drafter.start_request(view.request_id, tokens[:prompt_len])
            have = prompt_len
        if tokens.size > have:
            self.drafter.extend(view.request_id, tokens[have:])
        self._seen[view.request_id] = int(tokens.size)
        self._last_step[view.request_id] = self.steps

    def _expire(self) -> None:
        stale = [rid for rid, step in self._last_step.items() if self.steps - step > self.max_idle_steps]
        for rid in stale:
            self.release(rid)


def trtllm_drafter_classes():
    """(RetrospecDrafter, RetrospecDraftResources): TensorRT-LLM `Drafter` / `BaseResourceManager` subclasses over
    a `LinearDraftPlanner`. Raises ImportError (naming the fix) where tensorrt_llm does not import."""
    try:
        from tensorrt_llm._torch.pyexecutor.resource_manager import BaseResourceManager
        from tensorrt_llm._torch.speculative.drafter import Drafter as TrtllmDrafter
    except ImportError as exc:
        raise ImportError(f"the TensorRT-LLM drafter hook needs TensorRT-LLM 1.2.x ({exc}); install it on a Linux "
                          "host with an NVIDIA GPU, see docs/tensorrt_llm.md") from exc

    base_params = inspect.signature(TrtllmDrafter.__init__).parameters

    class RetrospecDrafter(TrtllmDrafter):
        """Fills `py_draft_tokens` of every scheduled generation request from a `LinearDraftPlanner`."""

        def __init__(self, planner: LinearDraftPlanner) -> None:
            wanted = {"max_draft_len": planner.max_draft_len, "max_total_draft_tokens": planner.max_draft_len}
            super().__init__(**{k: v for k, v in wanted.items() if k in base_params})
            self.planner = planner
            self.max_draft_len = planner.max_draft_len

        def prepare_draft_tokens(self, scheduled_requests, resource_manager=None) -> None:
            requests = list(scheduled_requests.generation_requests)
            views = [RequestView(r.request_id, list(r.get_tokens(0)), int(r.py_orig_prompt_len)) for r in requests]
            for request, draft in zip(requests, self.planner.plan(views)):
                request.py_draft_tokens = draft  # TensorRT-LLM's contract: drafts are handed over on the request

    class RetrospecDraftResources(BaseResourceManager):
        """Ties our per-request drafter state to TensorRT-LLM's request lifecycle (free on completion)."""

        def __init__(self, planner: LinearDraftPlanner) -> None:
            self.planner = planner

        def get_max_resource_count(self) -> int:
            return self.planner.max_sessions

        def get_needed_resource_to_completion(self, request) -> int:
            return 0  # drafter state is host memory bounded by max_sessions, not a scheduled resource

        def free_resources(self, request) -> None:
            self.planner.release(request.request_id)

        def shutdown(self) -> None:
            self.planner.close()

    return RetrospecDrafter, RetrospecDraftResources


def user_provided_config(planner: LinearDraftPlanner):
    """`tensorrt_llm.llmapi.UserProvidedDecodingConfig` running `planner` inside TensorRT-LLM's scheduler."""
    from tensorrt_llm.llmapi import UserProvidedDecodingConfig

    drafter_cls, resources_cls = trtllm_drafter_classes()
    return UserProvidedDecodingConfig(max_draft_len=planner.max_draft_len, drafter=drafter_cls(planner),
                                      resource_manager=resources_cls(planner))
