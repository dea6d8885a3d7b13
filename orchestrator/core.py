"""The serving core: continuous batching with a speculation budget.

One `step()`:

    admit    waiting requests, FIFO, while the engine has KV blocks for prompt + max_tokens (prefill). With
             `prefill_chunk` a step computes at most that many prompt tokens (vLLM's chunked prefill): a long prompt
             is prefilled over several steps, the oldest first, while the running requests keep decoding, so one
             arrival never stalls every stream for its whole prefill
    draft    one `Drafter.draft` call for every running request at the policy's cap (a failure, or a call slower
             than `draft_timeout_s`, makes this step plain decoding; counted in `drafter_fallbacks`)
    budget   the controller prunes the trees (goodput / roofline / fixed / none)
    verify   one engine forward for the whole batch
    accept   longest matching path + bonus token per request; commit its KV. The drafter is given a request's new
             tokens when it next drafts for it (and the whole output when it finishes, for the output history): a
             batch that decodes plainly, under load or with policy `none`, does no drafter work at all
    stream   new tokens (and text) per request; retire finished ones (EOS, stop token/string, max_tokens, cancel)
    learn    measured step time refits the step-time model; realized acceptance is logged per step

Micro-batches (SPIN §V): where the engine verifies on another device than the drafter drafts on (a GPU), the running
batch may be split into micro-batches that take turns. A step then verifies one micro-batch on a worker thread while
this thread drafts the next one, so drafting hides behind verification instead of adding to every step. A request's
state only changes when its own micro-batch is verified, so a tree drafted ahead is exactly the tree it would get
now: outputs are unchanged. The engine is never touched by both threads at once (admission, commits and releases
run while no verify is in flight). `micro_batches=None` decides each step: two micro-batches where the step-time
model says a round of two half-batch steps with drafting hidden costs less than one whole-batch step plus its
drafting (`pipelining_pays`), one on a CPU-only machine, where drafting and verification share the cores.

Streaming to clients goes through `on_output` callbacks (and the async runner in `orchestrator/runner.py`).

One request's trouble never stops the others: a request the engine refuses (`RequestError`, whose contract is that
nothing in the engine changed) finishes with `FinishReason.ERROR` and the engine's message, and a callback that raises
cancels its own request (logged, counted in `callback_errors`). Either way the loop that serves everyone goes on.
"""

from __future__ import annotations

import itertools
import logging
import statistics
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

import numba
import numpy as np

from drafter.tree import DraftTree
from orchestrator.acceptance import accept
from orchestrator.budget import BudgetController, prune_tree
from orchestrator.request import (
    FinishReason,
    GenerationRequest,
    IncrementalDetokenizer,
    RequestOutput,
    RequestStats,
    TokenLogprob,
    token_logprob_list,
)
from trt_engines.base import InvalidField, KVCacheFullError, RequestError, TargetEngine, VerifyItem

_LOG = logging.getLogger(__name__)

OutputCallback = Callable[[RequestOutput], None]


@dataclass
class StepRecord:
    """What one step decided and what happened (for metrics and plots). `batch` 0: a step with no verify, which only
    prefilled (chunks of prompts while no request was running yet) or whose verify the engine refused for one request
    (which failed; the others verify next step)."""

    batch: int
    prefills: int
    nodes: list[int]  # per running request
    predicted_tokens: float  # sum over requests of 1 + sum(probs)
    realized_tokens: int  # sum over requests of accepted + 1
    predicted_s: float
    measured_s: float  # verify forward time
    draft_s: float  # drafting the step waited for (with micro-batches: what outlasted the verify beside it)
    step_s: float  # wall time of the whole step
    fallbacks: int
    # per prefill call this step (an admission, or the next chunk of a prompt with `prefill_chunk`): prompt tokens
    # it computed, its seconds by the orchestrator's clock (simulated ones in the simulator), the prompt tokens it
    # read from the prefix cache (admissions only) and the tokens already cached that its tokens attended to (the
    # cached prefix, or that and the earlier chunks)
    prefill_tokens: list[int] = field(default_factory=list)
    prefill_s: list[float] = field(default_factory=list)
    prefill_cached: list[int] = field(default_factory=list)
    prefill_context: list[int] = field(default_factory=list)
    context: list[int] = field(default_factory=list)  # cached tokens of each running request before the step
    budget_s: float = 0.0  # the budget controller's allocation
    micro_batches: int = 1  # micro-batches the running requests took turns in (`batch` is this step's one)
    overlapped_draft_s: float = 0.0  # drafting of the next micro-batch that ran while this one was verified
    drafted_now: int = 0  # requests drafted while the step waited (the rest of `batch` were drafted ahead)

    @property
    def drafted_ahead(self) -> int:
        """Requests verified on a tree drafted during an earlier step's verify (micro-batches): drafting hidden."""
        return self.batch - self.drafted_now


@dataclass
class _Running:
    request_id: str
    request: GenerationRequest
    on_output: OutputCallback | None
    context_len: int  # tokens with cached KV
    output: list[int] = field(default_factory=list)
    stats: RequestStats = field(default_factory=RequestStats)
    detok: IncrementalDetokenizer | None = None
    started_s: float = 0.0
    first_token_s: float | None = None
    indexed: int = 0  # output tokens the drafter has been given (`_index_outputs`)


class Orchestrator:
    def __init__(
        self,
        engine: TargetEngine,
        drafter,
        budget: BudgetController,
        *,
        tokenizer=None,
        max_running: int = 32,
        keep_step_records: int = 100_000,
        clock: Callable[[], float] = time.perf_counter,
        draft_timeout_s: float | None = None,
        offline_batch: bool = False,
        micro_batches: int | None = None,
        prefill_chunk: int | None = None,
    ) -> None:
        self.engine = engine
        self.drafter = drafter
        self.budget = budget
        self.tokenizer = tokenizer  # needed only for text output and stop strings
        # A drafted token the target cannot have makes the engine refuse the whole step: refuse the pairing up front.
        drafted_vocab = getattr(drafter, "vocab_size", None)
        if drafted_vocab is not None and drafted_vocab > engine.vocab_size:
            raise ValueError(
                f"the drafter's datastores hold token ids up to {drafted_vocab - 1}, beyond the target model's "
                f"vocabulary ({engine.vocab_size} ids): they were built with another tokenizer; rebuild them with the "
                "model's (`build-datastore --tokenizer <model folder or tokenizer.json>`)")
        if isinstance(max_running, bool) or not isinstance(max_running, int) or max_running < 1:
            raise ValueError(f"max_running must be an int >= 1 (requests running at once); got {max_running!r}")
        self.max_running = max_running
        self.clock = clock  # request timestamps (TTFT, latency); the simulator passes its event clock
        self.waiting: deque[tuple[str, GenerationRequest, OutputCallback | None]] = deque()
        self.prefilling: dict[str, _Running] = {}  # admitted, prompt partly computed (`prefill_chunk`), oldest first
        self.running: dict[str, _Running] = {}
        self.records: deque[StepRecord] = deque(maxlen=keep_step_records)
        self.drafter_fallbacks = 0  # request-steps decoded plainly because drafting failed or timed out
        self.drafter_timeouts = 0  # of which timed out
        self.engine_refusals = 0  # requests failed because the engine refused them mid-generation (RequestError)
        self.callback_errors = 0  # output callbacks that raised (their requests were cancelled)
        if draft_timeout_s is not None and not draft_timeout_s > 0:
            raise ValueError(f"draft_timeout_s must be > 0 (or None for no timeout); got {draft_timeout_s}")
        self.draft_timeout_s = draft_timeout_s
        # An offline batch (vLLM's `LLM.generate`): every request is submitted up front and the job is done when the
        # last one is. Once none wait, the batch only drains, and the budget values each request's tokens by the
        # drain time they save (`BudgetController.allocate`'s `remaining_steps` and `tokens_per_step`, from
        # `_drain`). A server leaves it off: more requests may arrive at any time, and each one's latency counts.
        self.offline_batch = offline_batch
        # Micro-batches (module docstring): None decides each step, an int fixes it (1: every step verifies the whole
        # batch; more: pipelined even on the CPU, which is for tests, since there both threads share the cores).
        self.micro_batches = check_micro_batches(micro_batches)
        self._overlappable = engine_device(engine) != "cpu"
        self._verify_pool: ThreadPoolExecutor | None = None  # the verify worker, started by the first pipelined step
        self._drafted_ahead: dict[str, tuple[DraftTree, int]] = {}  # request id -> (tree, cap) drafted during a verify
        self._draft_s_per_request: deque[float] = deque(maxlen=16)  # whole drafting calls, hidden or not
        # With a timeout, drafting runs on one worker thread so the step can go on without it. A late draft call
        # keeps running there (its trees are dropped), and the drafter's state must not change under it: every
        # drafter update waits for it first (`_drafter_idle`), which overlaps the wait with the verify forward.
        # Its kernels run on one thread there: a second thread with a live pool of OpenMP workers makes the engine's
        # parallel kernels slower (`orchestrator.runner`; a plain decode step took 50.2 ms beside one, 15.7 ms beside
        # one whose kernel ran on 1 thread: `benchmarks/results/thread_pools.md`).
        self._draft_pool = (ThreadPoolExecutor(1, thread_name_prefix="drafter", initializer=numba.set_num_threads,
                                               initargs=(1,)) if draft_timeout_s else None)
        self._late_draft: Future | None = None
        self._ids = itertools.count()
        # KV admission ledger: blocks reserved for each running request's whole life (prompt + max_tokens + the
        # temporary slots of the largest tree), so lazily-allocating engines can never run out mid-generation.
        self._reserved: dict[str, int] = {}
        # Chunked prefill: prompt tokens a step may compute (None: whole prompts at admission). Only engines that can
        # continue a prompt (`prefill`) take it; TensorRT-LLM's executor would chunk prompts itself.
        self.prefill_chunk = check_prefill_chunk(prefill_chunk)
        if prefill_chunk is not None and not hasattr(engine, "prefill"):
            raise ValueError(f"{type(engine).__name__} cannot prefill in chunks (prefill_chunk={prefill_chunk}): use "
                             "prefill_chunk=None, or an engine with `prefill` (TorchEngine, SimulatedEngine)")
        self._prefills: list[tuple[int, float, int, int]] = []  # (computed, seconds, cached, context) per prefill call

    # -- client side ----------------------------------------------------------------------------------------------
    def submit(self, request: GenerationRequest, on_output: OutputCallback | None = None, *,
               request_id: str | None = None) -> str:
        if request.stop_strings and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer: construct the Orchestrator with tokenizer=...")
        if request.sampling.logprobs is not None and not getattr(self.engine, "returns_logprobs", False):
            raise InvalidField("logprobs", f"{type(self.engine).__name__} does not return log probabilities: leave "
                                           "logprobs out (TorchEngine returns them)")
        vocab = self.engine.vocab_size
        ids = np.asarray(request.prompt_ids, dtype=np.int64)
        if ids.min() < 0 or ids.max() >= vocab:
            raise ValueError(f"prompt token ids must lie in [0, {vocab}); got {ids.min()}..{ids.max()}")
        if len(ids) + request.max_tokens > self.engine.max_context:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_tokens ({request.max_tokens}) exceeds the model context "
                f"({self.engine.max_context}); shorten the prompt or lower max_tokens"
            )
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.request_ids():
            raise ValueError(f"request id {request_id!r} is already in use")
        self.waiting.append((request_id, request, on_output))
        return request_id

    def cancel(self, request_id: str) -> bool:
        """Stop a request now and free its KV blocks; False if it is unknown or already finished."""
        for i, (rid, _, callback) in enumerate(self.waiting):
            if rid == request_id:
                del self.waiting[i]
                self._call_back(request_id, callback,
                                RequestOutput(request_id, [], finish_reason=FinishReason.CANCELLED, stats=RequestStats()))
                return True
        state = self.running.get(request_id) or self.prefilling.get(request_id)
        if state is None:
            return False
        self._drafter_idle()
        self._finish(state, FinishReason.CANCELLED)
        return True

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.prefilling and not self.running

    def request_ids(self) -> list[str]:
        """Every request not finished yet: waiting, being prefilled, running."""
        return [w[0] for w in self.waiting] + list(self.prefilling) + list(self.running)

    def close(self) -> None:
        """Stop the worker threads (drafting, with a draft timeout; verifying, once a step was pipelined) once any late
        draft call ends. Steps after this draft on the calling thread without a timeout, and start a new verify worker
        if they pipeline."""
        if self._draft_pool is not None:
            self._draft_pool.shutdown(wait=True, cancel_futures=True)
            self._draft_pool = None
            self._late_draft = None
        if self._verify_pool is not None:
            self._verify_pool.shutdown(wait=True)
            self._verify_pool = None

    # -- one scheduler iteration ---------------------------------------------------------------------------------
    def step(self) -> StepRecord | None:
        started = time.perf_counter()
        self._prefills = []
        self._drafter_idle()
        prefills = self._admit()
        if not self.running:
            return self._record_without_verify(prefills, started) if self._prefills else None
        micro_batches = self._micro_batches_now()
        states = list(self.running.values())
        if micro_batches > 1:  # the requests drafted ahead, else the front of the rotation
            ahead = [s for s in states if s.request_id in self._drafted_ahead]
            states = ahead or states[: -(-len(states) // micro_batches)]

        draft_started = time.perf_counter()
        trees, cap, fallbacks, drafted_now = self._trees(states)
        draft_s = time.perf_counter() - draft_started
        context = np.array([s.context_len for s in states], dtype=np.float64)
        trees = self._usable_trees(states, trees, context)
        # This step's prefills (admissions, a chunk of a long prompt) already delayed every running request's next
        # token: the verify may take only what is left of each TPOT objective (none: a plain step).
        spent_s = sum(p[1] for p in self._prefills)
        tpot = np.array([s.request.tpot_s - spent_s if s.request.tpot_s else np.nan for s in states])
        budget_started = time.perf_counter()
        trees, decision = self.budget.allocate(trees, context, tpot_s=tpot if np.isfinite(tpot).any() else None,
                                               request_ids=[s.request_id for s in states],
                                               **self._drain(states))
        budget_s = time.perf_counter() - budget_started

        items = [VerifyItem(s.request_id, t) for s, t in zip(states, trees)]
        try:
            verify, overlapped_s, ahead_fallbacks = self._verify(items, states, micro_batches)
        except RequestError as exc:
            if exc.request_id not in {s.request_id for s in states}:  # not about a request of this batch: a bug
                raise
            refused = self.running[exc.request_id]
            # Nothing in the engine changed (RequestError's contract): fail that request alone; the others are
            # drafted and verified again next step.
            self._drafter_idle()
            self._refuse(refused, exc)
            return self._record_without_verify(prefills, started)
        fallbacks += ahead_fallbacks
        # The whole verify call (input packing and sampling included) is what a step costs the batch.
        measured_s = verify.timings.get("total_ms", verify.timings.get("forward_ms", 0.0)) / 1e3
        # Drafting ahead started with the verify; only what outlasted it delays the step (by the engine's own clock,
        # which is the event clock's for a simulated engine).
        draft_s += max(0.0, overlapped_s - measured_s)
        self.budget.step_model.observe(1.0 + decision.nodes, context, measured_s)
        self._drafter_idle()  # a finishing request reaches the drafter below

        realized = 0
        accepted = []  # per request: 1 for each sent node on the accepted path
        for state, tree, result in zip(states, trees, verify.results):
            verdict = accept(tree, result.target_tokens)
            realized += verdict.num_accepted + 1
            on_path = np.zeros(len(tree))
            on_path[verdict.accepted_nodes] = 1.0
            accepted.append(on_path)
            state.stats.steps += 1
            state.stats.drafted += len(tree)
            state.stats.accepted += verdict.num_accepted
            # the engine's logprobs rows are those of the new tokens (the target's at the root and each accepted node)
            logprobs = None if result.logprobs is None else token_logprob_list(verdict.new_tokens, result.logprobs)
            self._advance(state, verdict.accepted_nodes, verdict.new_tokens, logprobs)

        self.budget.observe(decision, accepted=np.concatenate(accepted), draft_s=draft_s, cap=cap,
                            measured_s=measured_s)
        record = StepRecord(
            batch=len(states), prefills=prefills, nodes=decision.nodes.tolist(),
            predicted_tokens=float(decision.predicted_tokens.sum()), realized_tokens=realized,
            predicted_s=decision.predicted_step_s, measured_s=measured_s, draft_s=draft_s, budget_s=budget_s,
            step_s=time.perf_counter() - started, fallbacks=fallbacks,
            **self._prefill_fields(),
            context=context.astype(int).tolist(), micro_batches=micro_batches, overlapped_draft_s=overlapped_s,
            drafted_now=drafted_now,
        )
        self.records.append(record)
        if micro_batches > 1:  # this micro-batch goes to the back of the rotation
            for state in states:
                if state.request_id in self.running:
                    self.running[state.request_id] = self.running.pop(state.request_id)
        return record

    def _verify(self, items: list[VerifyItem], states: list[_Running], micro_batches: int):
        """The engine's verify of `items`; with micro-batches on the verify worker while this thread drafts the next
        micro-batch. Returns the verify result, the seconds spent drafting ahead, and that drafting's fallbacks."""
        if micro_batches == 1:
            return self.engine.verify(items), 0.0, 0
        if self._verify_pool is None:
            self._verify_pool = ThreadPoolExecutor(1, thread_name_prefix="verify")
        pending = self._verify_pool.submit(self.engine.verify, items)
        verifying = {s.request_id for s in states}
        upcoming = [s for s in self.running.values() if s.request_id not in verifying]
        ahead_started = time.perf_counter()
        try:
            fallbacks = self._draft_ahead(upcoming[: -(-len(self.running) // micro_batches)])
        finally:  # never leave a verify in flight: the engine is this thread's again once the step ends
            overlapped_s = time.perf_counter() - ahead_started
            verify = pending.result()
        return verify, overlapped_s, fallbacks

    def _prefill_fields(self) -> dict[str, list]:
        """This step's prefill calls as `StepRecord`'s per-call fields."""
        names = ("prefill_tokens", "prefill_s", "prefill_cached", "prefill_context")  # `_prefills`' tuple order
        return {name: [call[i] for call in self._prefills] for i, name in enumerate(names)}

    def _record_without_verify(self, prefills: int, started: float) -> StepRecord:
        """A step without a verify (only prefills, or a refused verify): batch 0. Recorded, so that
        the step records account for every prompt token's prefill and its seconds, as with whole prefills (where a
        request's prefill shares the step of its first verify)."""
        record = StepRecord(
            batch=0, prefills=prefills, nodes=[], predicted_tokens=0.0, realized_tokens=0, predicted_s=0.0,
            measured_s=0.0, draft_s=0.0, step_s=time.perf_counter() - started, fallbacks=0,
            **self._prefill_fields(),
            drafted_now=0,
        )
        self.records.append(record)
        return record

    def _micro_batches_now(self) -> int:
        """How many micro-batches the running requests take turns in this step (module docstring)."""
        b = len(self.running)
        if self.micro_batches is not None:
            return max(1, min(self.micro_batches, b))
        if not self._overlappable or b < 2 or not self._draft_s_per_request:
            return 1
        states = list(self.running.values())
        # each request's tokens per verify as it has been speculating: splitting a compute-bound batch costs far less
        # than a second pass over the weights
        tokens = np.array([1.0 + s.stats.drafted / max(s.stats.steps, 1) for s in states])
        context = np.array([s.context_len for s in states], dtype=np.float64)
        draft_s = statistics.median(self._draft_s_per_request)
        return 2 if pipelining_pays(self.budget.step_model, tokens, context, draft_s) else 1

    def _trees(self, states: list[_Running]) -> tuple[list[DraftTree], int, int, int]:
        """Draft trees for `states` (those drafted ahead, the rest now), the largest cap they were drafted at, how
        many fell back to plain decoding now, and how many were drafted now."""
        missing = [s for s in states if s.request_id not in self._drafted_ahead]
        cap, fallbacks, drafted = 0, 0, {}
        if missing:
            cap = self.budget.draft_cap(len(states))
            trees, fallbacks = self._timed_draft(missing, cap)
            drafted = {s.request_id: (t, cap) for s, t in zip(missing, trees)}
        chosen = [drafted.get(s.request_id) or self._drafted_ahead.pop(s.request_id) for s in states]
        return [t for t, _ in chosen], max(c for _, c in chosen), fallbacks, len(missing)

    def _usable_trees(self, states: list[_Running], trees: list[DraftTree], context: np.ndarray) -> list[DraftTree]:
        """Each tree cut to what its request can use. The engine verifies at most context + root + nodes =
        `max_context` positions (it refuses a larger step, and before this cut a request that filled the context
        stopped the serving loop), and a step yields at most the tokens the request has left, the bonus token last,
        so nodes deeper than that less one would be verified for nothing."""
        sizes = np.array([len(t) for t in trees])
        if not sizes.any():
            return trees
        room = self.engine.max_context - 1 - context
        left = np.array([s.request.max_tokens - len(s.output) - 1 for s in states])
        trees = list(trees)
        for i in np.flatnonzero(sizes > np.minimum(room, left)):  # requests within a tree of their end only
            tree = trees[i]
            if tree.depth.max() > left[i]:
                tree = tree.subtree(np.flatnonzero(tree.depth <= left[i]))  # shallower nodes: closed under ancestors
            trees[i] = prune_tree(tree, int(room[i]))
        return trees

    def _draft_ahead(self, states: list[_Running]) -> int:
        """Draft the next micro-batch while this one is verified; returns the fallbacks."""
        if not states:
            return 0
        cap = self.budget.draft_cap(len(states))
        trees, fallbacks = self._timed_draft(states, cap)
        for state, tree in zip(states, trees):
            self._drafted_ahead[state.request_id] = (tree, cap)
        return fallbacks

    def _timed_draft(self, states: list[_Running], cap: int) -> tuple[list[DraftTree], int]:
        """`_draft`, keeping the seconds per request of whole drafting calls (`pipelining_pays` weighs them)."""
        started = time.perf_counter()
        trees, fallbacks = self._draft(states, cap)
        if cap > 0 and not fallbacks:
            self._draft_s_per_request.append((time.perf_counter() - started) / len(states))
        return trees, fallbacks

    def _drain(self, states: list[_Running]) -> dict[str, np.ndarray]:
        """While an offline batch drains, `allocate`'s `remaining_steps` and `tokens_per_step`: per request, tokens
        left (to max_tokens) over its tokens per step so far, and that rate. Otherwise nothing."""
        if not self.offline_batch or self.waiting or self.prefilling:
            return {}
        left = np.array([s.request.max_tokens - len(s.output) for s in states], dtype=np.float64)
        per_step = np.array([max(s.stats.tokens_per_step, 1.0) for s in states])
        return {"remaining_steps": left / per_step, "tokens_per_step": per_step}

    def run_until_idle(self, *, max_steps: int | None = None) -> None:
        steps = 0
        while not self.idle and (max_steps is None or steps < max_steps):
            self.step()
            steps += 1

    # -- internals ------------------------------------------------------------------------------------------------
    def _admit(self) -> int:
        """Continue chunked prefills, oldest first, then admit waiting requests FIFO while KV blocks (and the step's
        prefill budget, with `prefill_chunk`) allow; returns how many were admitted."""
        budget = self.prefill_chunk  # prompt tokens this step may still compute (None: no limit)
        for state in list(self.prefilling.values()):
            if budget is not None and budget <= 0:
                break
            budget -= self._prefill_more(state, budget)
        admitted = 0
        while (self.waiting and len(self.running) + len(self.prefilling) < self.max_running
               and (budget is None or budget > 0)):
            request_id, request, callback = self.waiting[0]
            need = self.engine.blocks_needed(len(request.prompt_ids) + request.max_tokens + self._max_tree_slots())
            if need > self.engine.total_blocks():  # can never fit: fail it rather than wait forever
                self.waiting.popleft()
                self._fail(request_id, callback, f"the request needs {need} KV blocks; the engine has "
                           f"{self.engine.total_blocks()} in all: lower max_tokens or shorten the prompt")
                continue
            if sum(self._reserved.values()) + need > self.engine.total_blocks():
                break
            self.waiting.popleft()
            state = _Running(request_id, request, callback, context_len=len(request.prompt_ids),
                             started_s=self.clock())
            if request.stop_strings or self.tokenizer is not None:
                state.detok = IncrementalDetokenizer(self.tokenizer, request.stop_strings)
            try:
                prefill_started = self.clock()  # the simulator's event clock, which its engine advances
                # a salt (or a chunk) only where asked for: engines without a prefix cache need not take one
                options = {} if request.cache_salt is None else {"cache_salt": request.cache_salt}
                if budget is not None:
                    options["prefill_tokens"] = budget
                first = self.engine.add_request(request_id, list(request.prompt_ids), request.sampling, **options)
                seconds = self.clock() - prefill_started
                cached = getattr(self.engine, "cached_prompt_tokens", lambda _: 0)(request_id)  # engines with a cache
                left = 0 if first is not None else self.engine.prompt_tokens_left(request_id)
                computed = len(request.prompt_ids) - cached - left
                self._prefills.append((computed, seconds, cached, cached))
                state.stats.cached_prompt_tokens = cached
            except KVCacheFullError:
                self.waiting.appendleft((request_id, request, callback))
                break
            except RequestError as exc:
                self._fail(request_id, callback, str(exc))
                continue
            self.drafter.start_request(request_id, np.asarray(request.prompt_ids, dtype=np.int32))
            self._reserved[request_id] = need
            admitted += 1
            if budget is not None:
                budget -= computed
            if first is None:
                self.prefilling[request_id] = state
            else:
                self._start_running(state, int(first))
        return admitted

    def _prefill_more(self, state: _Running, budget: int) -> int:
        """The next chunk (at most `budget` tokens) of a prompt being prefilled; returns the tokens computed."""
        try:
            left = self.engine.prompt_tokens_left(state.request_id)
            started = self.clock()
            first = self.engine.prefill(state.request_id, budget)
        except RequestError as exc:
            self._refuse(state, exc)
            return 0
        seconds = self.clock() - started
        computed = left - (0 if first is not None else self.engine.prompt_tokens_left(state.request_id))
        self._prefills.append((computed, seconds, 0, len(state.request.prompt_ids) - left))
        if first is not None:
            del self.prefilling[state.request_id]
            self._start_running(state, int(first))
        return computed

    def _start_running(self, state: _Running, first: int) -> None:
        """A request whose prompt is in joins the running batch; the prefill's token is its first output token and
        the root of its first verify (not cached yet)."""
        self.running[state.request_id] = state
        logprobs = None
        if state.request.sampling.logprobs is not None:
            logprobs = token_logprob_list([first], self.engine.first_token_logprobs(state.request_id))
        self._emit_tokens(state, [first], logprobs)

    def _max_tree_slots(self) -> int:
        return 1 + self.budget.policy.max_nodes_per_request  # the root + the largest tree a step may send

    def _draft(self, states: list[_Running], cap: int) -> tuple[list[DraftTree], int]:
        if cap <= 0:
            return [DraftTree.empty() for _ in states], 0
        batch = [(s.request_id, cap) for s in states]
        try:
            self._index_outputs(states)
            if self._draft_pool is None:
                return list(self.drafter.draft(batch)), 0
            future = self._draft_pool.submit(self.drafter.draft, batch)
            try:
                return list(future.result(timeout=self.draft_timeout_s)), 0
            except FutureTimeout:
                self._late_draft = future
                self.drafter_timeouts += len(states)
        except Exception:  # a drafter failure must never lose a request: this step decodes plainly
            pass
        self.drafter_fallbacks += len(states)
        for s in states:
            s.stats.fallbacks += 1
        return [DraftTree.empty() for _ in states], len(states)

    def _index_outputs(self, states: list[_Running]) -> None:
        """Give the drafter each request's output tokens it has not seen yet: one call per request for the tokens of
        every step since it last drafted (each call costs ~30 us of Python, so feeding them step by step cost a
        plain batch-16 step on the CPU about 1%)."""
        for state in states:
            if len(state.output) > state.indexed:
                self.drafter.extend(state.request_id, np.asarray(state.output[state.indexed:], dtype=np.int32))
                state.indexed = len(state.output)

    def _drafter_idle(self) -> None:
        """Wait for a timed-out draft call still running on the worker (its result, or error, is dropped)."""
        if self._late_draft is not None:
            late, self._late_draft = self._late_draft, None
            late.exception()  # waits; a late failure changes nothing: that step already decoded plainly

    def _advance(self, state: _Running, accepted_nodes: np.ndarray, new_tokens: np.ndarray,
                 logprobs: list[TokenLogprob] | None) -> None:
        tokens = [int(t) for t in new_tokens]
        try:
            self.engine.commit(state.request_id, accepted_nodes, next_root=tokens[-1])
        except RequestError as exc:
            self._refuse(state, exc)
            return
        state.context_len += len(tokens)  # the old root + accepted nodes are cached now
        self._emit_tokens(state, tokens, logprobs)

    def _emit_tokens(self, state: _Running, tokens: list[int], logprobs: list[TokenLogprob] | None = None) -> None:
        """Append tokens up to the first stop condition, stream them (with their `logprobs`, one per token, where
        asked for), and finish the request if one was hit."""
        request = state.request
        eos = () if request.ignore_eos else self.engine.eos_token_ids
        kept: list[int] = []
        reason = None
        for token in tokens:
            kept.append(token)
            if token in eos or token in request.stop_token_ids:
                reason = FinishReason.STOP
                break
            if len(state.output) + len(kept) >= request.max_tokens:
                reason = FinishReason.LENGTH
                break
        text = ""
        if state.detok is not None:
            text, stopped_after = state.detok.add(kept)
            if stopped_after is not None:  # a stop string: the tokens after the one it ends in are not output
                kept = kept[:stopped_after]
                reason = FinishReason.STOP
            elif reason is not None:
                text += state.detok.flush()
        state.output += kept
        kept_logprobs = None if logprobs is None else logprobs[: len(kept)]
        if state.first_token_s is None:
            state.first_token_s = self.clock()
        if reason is not None:
            self._finish(state, reason, kept, text, logprobs=kept_logprobs)
        elif not self._call_back(state.request_id, state.on_output,
                                 RequestOutput(state.request_id, kept, text, logprobs=kept_logprobs)):
            state.on_output = None  # it has failed once: the cancellation is not sent to it
            self._finish(state, FinishReason.CANCELLED)

    def _finish(self, state: _Running, reason: FinishReason, tokens: list[int] | None = None, text: str = "", *,
                error: str | None = None, logprobs: list[TokenLogprob] | None = None) -> None:
        """Retire a request and send its last update. `error`: the engine refused it (`_refuse`), a server error."""
        self.running.pop(state.request_id, None)
        self.prefilling.pop(state.request_id, None)
        self._drafted_ahead.pop(state.request_id, None)
        self._reserved.pop(state.request_id, None)
        try:
            self.engine.release(state.request_id)
        except RequestError:
            if error is None:
                raise
            # failing a request the engine refused: one it does not know holds nothing there
        self._index_outputs([state])  # the whole output joins the drafter's output history
        self.drafter.stop_request(state.request_id)
        self._call_back(state.request_id, state.on_output,
                        RequestOutput(state.request_id, tokens or [], text, finish_reason=reason, stats=state.stats,
                                      error=error, server_error=error is not None,
                                      logprobs=self._finish_logprobs(state, logprobs)))

    @staticmethod
    def _finish_logprobs(state: _Running, logprobs: list[TokenLogprob] | None) -> list[TokenLogprob] | None:
        """The last update's logprobs: those of its tokens, an empty list where it has none but the request asked
        for them (every update of such a request carries a list), None where it did not ask."""
        if state.request.sampling.logprobs is None:
            return None
        return logprobs or []

    def _refuse(self, state: _Running, exc: RequestError) -> None:
        """Fail a request the engine refused mid-generation; the caller's step goes on for the others."""
        self.engine_refusals += 1
        _LOG.error("the engine refused request %r; it fails, the others go on: %s", state.request_id, exc)
        self._finish(state, FinishReason.ERROR, error=str(exc))

    def _fail(self, request_id: str, callback: OutputCallback | None, message: str) -> None:
        self._call_back(request_id, callback, RequestOutput(request_id, [], finish_reason=FinishReason.ERROR,
                                                            stats=RequestStats(), error=message))

    def _call_back(self, request_id: str, callback: OutputCallback | None, output: RequestOutput) -> bool:
        """Hand `output` to the request's callback; False if the callback raised. A client's broken callback must
        not stop the loop that serves every request: its error is logged and counted, and its request cancelled."""
        if callback is None:
            return True
        try:
            callback(output)
        except Exception:  # noqa: BLE001 - any client error; it is logged with its traceback
            self.callback_errors += 1
            _LOG.exception("the output callback of request %r raised; %s", request_id,
                           "the request had finished" if output.finished else "the request is cancelled")
            return False
        return True


def check_prefill_chunk(prefill_chunk: int | None) -> int | None:
    """`prefill_chunk` if valid (None: whole prompts; an int >= 1: prompt tokens a step may compute), else a
    ValueError that says so."""
    if prefill_chunk is not None and (isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int)
                                      or prefill_chunk < 1):
        raise ValueError(f"prefill_chunk must be an int >= 1 (prompt tokens per step) or None (whole prompts); "
                         f"got {prefill_chunk!r}")
    return prefill_chunk


def check_micro_batches(micro_batches: int | None) -> int | None:
    """`micro_batches` if valid (None: decide each step; an int >= 1), else a ValueError that says so."""
    if micro_batches is not None and (isinstance(micro_batches, bool) or not isinstance(micro_batches, int)
                                      or micro_batches < 1):
        raise ValueError(f"micro_batches must be an int >= 1 (or None: decide each step); got {micro_batches!r}")
    return micro_batches


def engine_device(engine) -> str:
    """The kind of device an engine verifies on ("cpu", "cuda", ...): its `device` attribute (a torch.device or a
    string), "cpu" for an engine without one."""
    device = getattr(engine, "device", "cpu")
    return str(getattr(device, "type", device)).split(":")[0]


def pipelining_pays(step_model, tokens: np.ndarray, context: np.ndarray, draft_s_per_request: float) -> bool:
    """Whether two micro-batches that take turns (one verified while the other is drafted) finish a round of the
    batch sooner than one whole-batch step after its drafting, by the step-time model (`tokens[i]`: request i's
    tokens per verify, root included): SPIN's trade of a second pass over the weights (two half-batch steps instead
    of one, which costs little where the step is compute-bound) for hiding drafting behind verification.

        whole:  T(batch) + d * b
        split:  T(first) + T(second) + max(0, d * |second| - T(first)) + max(0, d * |first| - T(second))

    with d the drafting seconds per request and each half's drafting hidden behind the other half's verify, except
    for what outlasts it."""
    tokens = np.asarray(tokens, dtype=np.float64)
    context = np.asarray(context, dtype=np.float64)
    b = context.shape[0]
    if b < 2:
        return False
    half = -(-b // 2)
    t_whole = step_model.predict(tokens, context)
    t_first = step_model.predict(tokens[:half], context[:half])
    t_second = step_model.predict(tokens[half:], context[half:])
    whole = t_whole + draft_s_per_request * b
    split = (t_first + t_second + max(0.0, draft_s_per_request * (b - half) - t_first)
             + max(0.0, draft_s_per_request * half - t_second))
    return split < whole
