"""`Drafter`: SSSD-style draft trees for a whole batch, from prompt + self-output and datastores, no draft model.

Vocabulary
    request       one generation stream; the drafter indexes its prompt and every accepted token
                  (`start_request`, `extend`, `stop_request`).
    history       the outputs of this drafter's finished requests (SuffixDecoding's global tree), newest
                  `history_tokens` tokens; drafted as its own source (id `history_source`). `clear_history()`
                  forgets them: do it between benchmark runs that serve the same prompts again.
    budget        the number of tree nodes (root excluded) the caller allows for one request this step; 0 means
                  "do not speculate" and yields an empty tree.
    sources       "fused" (input index + output history + every datastore, one tree), "input" (input index +
                  output history) or "datastore" only.
    DraftResult   the tree plus what calibration needs per node: raw fusion score and matched suffix length
                  (`source` and `depth` are in the tree).

Worked example:
    ds = Datastore.open(path)
    drafter = Drafter(DrafterConfig(), datastores=[ds])          # loads <path>/calibration.json if present
    drafter.start_request("r1", prompt_ids)
    trees = drafter.draft([("r1", 32)])                          # one DraftTree per (request, budget)
    drafter.extend("r1", accepted_ids)                           # accepted path + bonus token
    drafter.stop_request("r1")

`trees[i].probs` are calibrated path-acceptance probabilities, so `trees[i].expected_accepted + 1` predicts the
tokens the step yields.
"""

from __future__ import annotations

from collections.abc import Hashable, KeysView, Sequence
from dataclasses import dataclass

import numpy as np

from drafter.calibration import CalibrationMap
from drafter.datastore_source import kernel_datastores
from drafter.fusion import PARALLEL_MIN_BATCH, draft_batch
from drafter.input_index import InputIndex
from drafter.tree import DraftTree

SOURCES = ("fused", "input", "datastore")


@dataclass(frozen=True)
class DrafterConfig:
    """SSSD's defaults (sssd-notes §1.3, §2), except the input source's depth and score constants, which
    `tools/calibrate.py` grid-searched on the calibration trajectories (benchmarks/results/calibration.json;
    SSSD uses depth 8, scale 0.6, delta base 0.6)."""

    sources: str = "fused"  # "fused" | "input" | "datastore"
    query_len: int = 4  # q: suffix length looked up in both sources
    input_depth: int = 24  # L: continuation depth from the input index
    input_max_tokens: int = 16384  # per-request memory cap of the input index (oldest tokens dropped beyond)
    input_scale: float = 1.0  # input score at depth 1 = input_scale * c(child) / c(node)
    delta_base: float = 0.6  # deeper input levels are damped by delta(m) = delta_base + delta_step * m
    delta_step: float = 0.1
    datastore_samples: int = 100  # K: continuations sampled per lookup
    backoff_threshold: int = 50  # keep shortening the prefix while the merged trie has fewer continuations
    datastore_branch_len: int | None = None  # None: SSSD schedule by budget (sssd_branch_length)
    fanout: int = 5  # max children per tree node (also capped by the budget)
    max_budget: int = 64
    history_tokens: int = 32768  # output history of finished requests (0 = none); not used with sources="datastore"

    def __post_init__(self):
        if self.sources not in SOURCES:
            raise ValueError(f"sources must be one of {SOURCES}, got {self.sources!r}")
        for name in ("query_len", "input_depth", "datastore_samples", "fanout", "max_budget"):
            if getattr(self, name) < 1:
                raise ValueError(f"DrafterConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.history_tokens < 0:
            raise ValueError(f"DrafterConfig.history_tokens must be >= 0 (0 = no output history), got "
                             f"{self.history_tokens}")
        if self.datastore_branch_len is not None and self.datastore_branch_len < 1:
            raise ValueError("DrafterConfig.datastore_branch_len must be >= 1 or None (SSSD schedule)")
        if not (0 < self.input_scale <= 1 and self.delta_base > 0 and self.delta_step >= 0):
            raise ValueError("need 0 < input_scale <= 1, delta_base > 0 and delta_step >= 0")


@dataclass(frozen=True, eq=False)
class DraftResult:
    tree: DraftTree
    raw_score: np.ndarray  # float32 [n] uncalibrated fusion score of each node
    match_len: np.ndarray  # int32 [n] matched suffix / prefix length of the node's source


class Drafter:
    """Batch drafter over an input index and any number of datastores (each datastore is its own source)."""

    def __init__(self, config: DrafterConfig = DrafterConfig(), *, datastores: Sequence = (),
                 calibration: CalibrationMap | None = None, vocab_size: int | None = None):
        self.config = config
        self.datastores = list(datastores)
        vocabs = {int(ds.vocab_size) for ds in self.datastores}
        if len(vocabs) > 1:
            raise ValueError(f"attached datastores disagree on vocab_size: {sorted(vocabs)}")
        if vocabs and vocab_size is not None and vocab_size not in vocabs:
            raise ValueError(f"vocab_size={vocab_size} differs from the datastores' {vocabs.pop()}")
        self.vocab_size = vocab_size if vocab_size is not None else (vocabs.pop() if vocabs else None)
        if config.sources != "input" and not self.datastores:
            raise ValueError(f"sources={config.sources!r} needs at least one datastore; pass datastores=[...] or "
                             "use DrafterConfig(sources='input')")
        if calibration is None:
            path = getattr(self.datastores[0], "path", None) if self.datastores else None
            calibration = CalibrationMap.for_datastore(path) if path is not None else CalibrationMap.identity()
        self.calibration = calibration
        self.history_source = 1 + len(self.datastores)  # source ids: 0 input, 1..K datastores, then the history
        self._cal_tables = calibration.tables(2 + len(self.datastores))
        history = config.history_tokens if config.sources != "datastore" else 0
        self._index = InputIndex(query_len=config.query_len, depth=config.input_depth,
                                 max_tokens=config.input_max_tokens, vocab_size=self.vocab_size,
                                 history_tokens=history, history_top=config.fanout)
        # which sources `draft_batch` reads, and its datastores ("input" drafts without them)
        self._use_input = config.sources != "datastore"
        self._use_datastores = config.sources != "input"
        self._kernel_datastores = kernel_datastores(self.datastores if self._use_datastores else ())
        self._warm_up()

    # ---- lifecycle (forwarded to the input index) -----------------------------------------------------------
    @property
    def active_requests(self) -> KeysView:
        return self._index.active_requests

    def start_request(self, request_id: Hashable, prompt_ids) -> None:
        self._index.start_request(request_id, prompt_ids)

    def extend(self, request_id: Hashable, accepted_ids) -> None:
        self._index.extend(request_id, accepted_ids)

    def stop_request(self, request_id: Hashable) -> None:
        self._index.stop_request(request_id)

    def clear_history(self) -> None:
        """Forget the outputs of finished requests (the output history)."""
        self._index.clear_history()

    def fresh(self) -> "Drafter":
        """A new drafter on the same config, datastores and calibration, with no requests and no history (e.g. one
        per policy of a side-by-side benchmark, so no policy drafts from another's outputs of the same prompts)."""
        return Drafter(self.config, datastores=self.datastores, calibration=self.calibration,
                       vocab_size=self.vocab_size)

    @property
    def input_index(self) -> InputIndex:
        return self._index

    # ---- drafting --------------------------------------------------------------------------------------------
    def draft(self, batch: Sequence[tuple[Hashable, int]]) -> list[DraftTree]:
        """One DraftTree per (request id, budget), in batch order."""
        return [r.tree for r in self.draft_detailed(batch)]

    def draft_detailed(self, batch: Sequence[tuple[Hashable, int]]) -> list[DraftResult]:
        """Like `draft`, plus raw scores and match lengths per node (for calibration logging)."""
        cfg = self.config
        slots, budgets = self._check_batch(batch)
        lookup, kx, ky, kn = self._cal_tables
        tables = self._index.tables
        o_tok, o_par, o_prob, o_depth, o_src, o_raw, o_mlen, o_n = draft_batch(
            slots, budgets, tables.arrays, tables.n, self._use_input, self._index.history_slot,
            self.history_source, self._index.history_top, cfg.query_len, cfg.input_depth, cfg.input_scale,
            cfg.delta_base, cfg.delta_step, self._kernel_datastores, self._use_datastores, cfg.datastore_samples,
            cfg.backoff_threshold, cfg.datastore_branch_len or 0, cfg.fanout, lookup, kx, ky, kn)
        # Each tree views its row of this call's fresh output arrays: no per-request copies.
        return [
            DraftResult(
                tree=DraftTree(tokens=o_tok[b, :n], parents=o_par[b, :n], probs=o_prob[b, :n],
                               depth=o_depth[b, :n], source=o_src[b, :n]),
                raw_score=o_raw[b, :n], match_len=o_mlen[b, :n],
            )
            for b, n in enumerate(o_n.tolist())
        ]

    # ---- internals -------------------------------------------------------------------------------------------
    def _check_batch(self, batch) -> tuple[np.ndarray, np.ndarray]:
        """The batch's input-index slots and budgets, as int64 arrays; a clear ValueError for any bad item."""
        slots, budgets, seen = [], [], set()
        slot_of = self._index.slot
        max_budget = self.config.max_budget
        for item in batch:
            try:
                rid, budget = item
            except (TypeError, ValueError):
                raise ValueError(f"batch items must be (request_id, budget) pairs, got {item!r}") from None
            if not isinstance(budget, (int, np.integer)) or isinstance(budget, bool):
                raise ValueError(f"budget for request {rid!r} must be an int, got {budget!r}")
            if budget < 0:
                raise ValueError(f"budget for request {rid!r} is {budget}; it must be >= 0 (0 = no speculation)")
            if budget > max_budget:
                raise ValueError(f"budget for request {rid!r} is {budget}, above DrafterConfig.max_budget="
                                 f"{max_budget}; raise max_budget or lower the budget")
            if rid in seen:
                raise ValueError(f"request {rid!r} appears twice in the batch")
            seen.add(rid)
            slots.append(slot_of(rid))
            budgets.append(budget)
        return np.array(slots, np.int64), np.array(budgets, np.int64)

    def _warm_up(self) -> None:
        """Compile (or load cached) numba kernels now, serial and parallel, so no request pays for it."""
        ids = [object() for _ in range(PARALLEL_MIN_BATCH)]
        vocab = self.vocab_size or 2
        for rid in ids:
            self._index.start_request(rid, np.arange(2 * self.config.query_len + 4, dtype=np.int32) % vocab)
        try:
            self.draft([(ids[0], 2)])
            self.draft([(rid, 2) for rid in ids])
        finally:
            for rid in ids:
                self._index.stop_request(rid)
            self._index.clear_history()  # the warm-up's requests are not outputs
