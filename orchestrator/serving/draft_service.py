"""The drafting service on its own: per-client request state in a drafter, for engines that verify elsewhere
(for example TensorRT-LLM's Triton backend asking `retrospec_draft` for draft tokens each step).

Lifecycle per client request id: the first call starts the request with its context (the prompt); every later call
appends the newly accepted tokens; a call with `end=True` (or `idle_timeout_s` without calls) releases the state.

Example (a client generating "the cat sat"):

    service = DraftService(drafter, idle_timeout_s=300)
    tree = service.draft("r1", prompt_ids, budget=16)        # start + draft
    tree = service.draft("r1", [accepted, tokens], budget=16)  # extend + draft
    service.draft("r1", [], budget=0, end=True)               # release (returns an empty tree)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import numpy as np

from drafter.tree import DraftTree


class DraftService:
    def __init__(self, drafter, *, idle_timeout_s: float = 300.0, vocab_size: int | None = None,
                 max_sessions: int = 4096, clock=time.monotonic) -> None:
        self.drafter = drafter
        self.idle_timeout_s = idle_timeout_s
        self.vocab_size = vocab_size
        self.max_sessions = max_sessions
        self.max_budget = int(drafter.config.max_budget)
        self._clock = clock
        self._last_used: dict[str, float] = {}
        self._lock = threading.Lock()  # the drafter is not thread-safe; calls are short (about a millisecond)

    @property
    def active(self) -> list[str]:
        with self._lock:
            return list(self._last_used)

    def draft(self, request_id: str, new_ids: Sequence[int] | np.ndarray, *, budget: int, end: bool = False) -> DraftTree:
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id must be a non-empty string")
        ids = np.asarray(new_ids)
        if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
            raise ValueError("input_ids must be a 1-D array of integer token ids")
        if ids.size and (ids.min() < 0 or (self.vocab_size is not None and ids.max() >= self.vocab_size)):
            raise ValueError(f"input_ids must lie in [0, {self.vocab_size}); got {ids.min()}..{ids.max()}")
        if not end and not 0 <= budget <= self.max_budget:
            raise ValueError(f"budget must lie in [0, {self.max_budget}] draft nodes; got {budget}")
        ids = ids.astype(np.int32)
        with self._lock:
            self._expire()
            if end:
                if request_id in self._last_used:
                    self._release(request_id)
                return DraftTree.empty()
            if request_id not in self._last_used:
                if ids.size == 0:
                    raise ValueError(f"request {request_id!r} is new: its first call must carry the context (prompt)")
                if len(self._last_used) >= self.max_sessions:
                    raise ValueError(f"{self.max_sessions} draft sessions are open; end some (end=true) first")
                self.drafter.start_request(request_id, ids)
            elif ids.size:
                self.drafter.extend(request_id, ids)
            self._last_used[request_id] = self._clock()
            if budget == 0:
                return DraftTree.empty()
            return self.drafter.draft([(request_id, int(budget))])[0]

    def expire(self) -> int:
        """Release sessions idle for longer than the timeout; returns how many."""
        with self._lock:
            return self._expire()

    def close(self) -> None:
        with self._lock:
            for rid in list(self._last_used):
                self._release(rid)

    def _expire(self) -> int:
        deadline = self._clock() - self.idle_timeout_s
        stale = [rid for rid, t in self._last_used.items() if t < deadline]
        for rid in stale:
            self._release(rid)
        return len(stale)

    def _release(self, request_id: str) -> None:
        self._last_used.pop(request_id, None)
        self.drafter.stop_request(request_id)
