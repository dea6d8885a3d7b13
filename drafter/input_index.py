"""Per-request index of prompt + self-output: a depth-limited count-trie that grows as tokens are accepted.

Vocabulary
    sequence      the prompt followed by every accepted output token of one request, as ONE token stream (so an
                  n-gram may cross the prompt/output boundary).
    window        the n-grams of length <= D = query_len + depth ending at each position. Appending one token adds
                  the D n-grams that end at it, so the index grows in O(D) per new token.
    count-trie    node = an n-gram (the path from the root); `count` = how many times that n-gram occurs in the
                  sequence. A node's children are the tokens that followed it.
    suffix match  for the last q tokens (q = query_len), every suffix length m = q..1 whose m-gram also occurs
                  EARLIER in the sequence. Its continuations (up to `depth` tokens) are the subtree under the m-gram's
                  node; because the newest occurrence (the query itself) is followed by nothing, the number of earlier
                  occurrences is count(node) - 1, and it equals the sum of the children's counts.

Worked example (query_len=2, depth=2): sequence `a b c a b d a b`.
    last 2 tokens `a b` occur twice before: followed by `c a` and `d a`  -> m=2: {c: 1, c a: 1, d: 1, d a: 1}
    last 1 token  `b`   occurs twice before: the same continuations     -> m=1: the same counts
A match near the end of the sequence has a shorter continuation (the window is not complete yet): that is correct,
it is exactly what has been seen so far.

Memory is bounded by `max_tokens` per request: when a request outgrows it, the oldest quarter of its tokens is dropped
and the trie is rebuilt from the rest (amortised O(D) per token). Lifecycle (ArcticInference style): `start_request`,
`extend`, `stop_request`; misuse raises `ValueError` and changes nothing.

Output history (SuffixDecoding's global tree of earlier responses): with `history_tokens > 0`, `stop_request` adds the
request's OUTPUT (every token passed to `extend`, never the prompt) to one shared count-trie of finished requests'
outputs, newest `history_tokens` tokens kept (whole outputs are dropped oldest first). Outputs are separate segments:
no n-gram crosses from one output into the next. The drafter queries it with a request's last q tokens like its own
index; the query is not part of the history, so every count there is an earlier occurrence. Drafts never change
outputs (verification is lossless), so sharing the history across requests changes speed only.
"""

from __future__ import annotations

from collections.abc import Hashable, KeysView
from dataclasses import dataclass

import numba as nb
import numpy as np

_EMPTY = np.int64(-1)
_HASH_MULT = np.uint64(0x9E3779B97F4A7C15)


@nb.njit(cache=True, inline="always")
def _slot(key, mask):
    return np.int64((np.uint64(key) * _HASH_MULT) >> np.uint64(29)) & mask


@nb.njit(cache=True)
def trie_child(hkeys, hvals, parent, token):
    """Node index of `token` under `parent`, or -1 (open addressing with linear probing)."""
    key = (np.int64(parent) << 31) | np.int64(token)
    mask = hkeys.shape[0] - 1
    s = _slot(key, mask)
    while True:
        k = hkeys[s]
        if k == key:
            return np.int64(hvals[s])
        if k == -1:
            return np.int64(-1)
        s = (s + 1) & mask


@nb.njit(cache=True)
def _hash_put(hkeys, hvals, key, value):
    mask = hkeys.shape[0] - 1
    s = _slot(key, mask)
    while hkeys[s] != -1:
        s = (s + 1) & mask
    hkeys[s] = key
    hvals[s] = value


@nb.njit(cache=True)
def _rehash(hkeys, hvals, par, tok, n_nodes):
    hkeys[:] = -1
    for c in range(1, n_nodes):
        _hash_put(hkeys, hvals, (np.int64(par[c]) << 31) | np.int64(tok[c]), c)


@nb.njit(cache=True, inline="always")
def _ranks_above(a, b, cnt, tok):
    return cnt[a] > cnt[b] or (cnt[a] == cnt[b] and tok[a] < tok[b])


@nb.njit(cache=True)
def _top_update(top, k, p, c, cnt, tok):
    """Child c of node p gained a count: keep top[p*k : p*k+k] = p's k most frequent children (ties: lower token),
    -1 padded. Counts only grow, so a child outside the row enters only by beating the row's last."""
    row = p * k
    i = k - 1
    while i >= 0 and top[row + i] != c:
        i -= 1
    if i < 0:
        last = top[row + k - 1]
        if last >= 0 and not _ranks_above(c, last, cnt, tok):
            return
        i = k - 1
        while i > 0 and top[row + i - 1] < 0:
            i -= 1
        top[row + i] = c
    while i > 0 and _ranks_above(top[row + i], top[row + i - 1], cnt, tok):
        top[row + i], top[row + i - 1] = top[row + i - 1], top[row + i]
        i -= 1


@nb.njit(cache=True)
def _append(new, buf, n, tok, cnt, par, first, sib, n_nodes, hkeys, hvals, active, top, k):
    """Append `new` to the sequence; capacities were ensured by the caller. Returns the new node count.

    active[j] is the node of the last j tokens (active[0] = root = 0, -1 while the sequence is shorter than j).
    Each appended token t extends every suffix: node(last j+1) = child(active[j], t), count + 1.
    """
    D = active.shape[0]
    for i in range(new.shape[0]):
        t = new[i]
        for j in range(D - 1, -1, -1):  # descending: active[j] is read before active[j] is overwritten (by j-1)
            p = active[j]
            if p < 0:
                continue
            key = (np.int64(p) << 31) | np.int64(t)
            c = trie_child(hkeys, hvals, p, t)
            if c < 0:
                c = n_nodes
                n_nodes += 1
                tok[c] = t
                cnt[c] = 0
                par[c] = p
                first[c] = -1
                sib[c] = first[p]
                first[p] = c
                _hash_put(hkeys, hvals, key, c)
                top[c * k : c * k + k] = -1
            cnt[c] += 1
            if k > 0:
                _top_update(top, k, p, c, cnt, tok)
            if j + 1 < D:
                active[j + 1] = c
        buf[n + i] = t
    return n_nodes


class _Seq:
    """Arrays of one request's index (owned by InputIndex; read directly by the fusion kernel)."""

    __slots__ = ("buf", "n", "total", "prompt_len", "tok", "cnt", "par", "first", "sib", "n_nodes", "hkeys", "hvals",
                 "active", "version", "top", "top_k")

    def __init__(self, window: int, token_cap: int, top_k: int = 0):
        node_cap = 1 + window * max(token_cap, 16)
        self.buf = np.empty(max(token_cap, 16), np.int32)
        self.n = 0
        self.total = 0
        self.prompt_len = 0  # tokens given at start_request (the rest of `total` is output)
        self.tok = np.empty(node_cap, np.int32)
        self.cnt = np.empty(node_cap, np.int32)
        self.par = np.empty(node_cap, np.int32)
        self.first = np.empty(node_cap, np.int32)
        self.sib = np.empty(node_cap, np.int32)
        self.tok[0], self.cnt[0], self.par[0], self.first[0], self.sib[0] = -1, 0, -1, -1, -1
        self.n_nodes = 1
        self.hkeys = np.full(_pow2(2 * node_cap), -1, np.int64)
        self.hvals = np.empty(self.hkeys.shape[0], np.int32)
        self.active = np.full(window, -1, np.int32)
        self.active[0] = 0
        # top_k > 0: top[node * top_k : ...] lists each node's top_k most frequent children, kept as tokens arrive, so
        # a reader need not walk a node with hundreds of children (the output history's common tokens)
        self.top_k = top_k
        self.top = np.full(node_cap * top_k, -1, np.int32)
        self.version = 0  # bumped whenever an array is reallocated (the batch tables must re-point to it)

    def reserve(self, k: int) -> None:
        """Grow buffers so that k more tokens fit (amortised doubling)."""
        D = self.active.shape[0]
        if self.n + k > self.buf.shape[0]:
            self.buf = _grow(self.buf, self.n + k)
            self.version += 1
        need = self.n_nodes + D * k
        if need > self.tok.shape[0]:
            for name in ("tok", "cnt", "par", "first", "sib"):
                setattr(self, name, _grow(getattr(self, name), need))
            if self.top_k:
                self.top = _grow(self.top, self.tok.shape[0] * self.top_k)
            self.version += 1
        if 2 * need > self.hkeys.shape[0]:
            self.version += 1
            self.hkeys = np.full(_pow2(2 * self.tok.shape[0]), -1, np.int64)
            self.hvals = np.empty(self.hkeys.shape[0], np.int32)
            _rehash(self.hkeys, self.hvals, self.par, self.tok, self.n_nodes)

    def new_segment(self) -> None:
        """The next appended token starts a fresh segment: no n-gram spans the boundary."""
        self.active[:] = -1
        self.active[0] = 0

    def append(self, new: np.ndarray) -> None:
        self.reserve(new.shape[0])
        self.n_nodes = _append(
            new, self.buf, self.n, self.tok, self.cnt, self.par, self.first, self.sib, self.n_nodes,
            self.hkeys, self.hvals, self.active, self.top, self.top_k,
        )
        self.n += new.shape[0]


class _SlotTables:
    """Every active request's index arrays, referenced by slot in one numba typed list, so that one compiled kernel
    can read a whole batch of indexes (`drafter.fusion.draft_batch`) without a Python call per request.

    Slot s holds the tuple `(buf, tok, cnt, first, sib, hkeys, hvals, top)` of one `_Seq` (`FIELDS`); `n[s]` is its
    current token count. A slot is taken at `start_request` and given back at `stop_request`; its tuple is replaced
    when the request's index reallocates an array (`_Seq.version`). One list of tuples, not a list per field: a
    kernel call unboxes each typed list in Python, ~10 us apiece once a verify step has left the caches cold.
    """

    FIELDS = ("buf", "tok", "cnt", "first", "sib", "hkeys", "hvals", "top")
    _I32 = nb.types.int32[::1]
    _TUPLE = nb.types.Tuple((_I32, _I32, _I32, _I32, _I32, nb.types.int64[::1], _I32, _I32))

    def __init__(self) -> None:
        from numba.typed import List

        self.arrays = List.empty_list(self._TUPLE)
        self.n = np.zeros(16, np.int64)
        self._synced: list[int] = []
        self._free: list[int] = []
        empty32 = np.empty(0, np.int32)
        self._empty = (empty32,) * 5 + (np.empty(0, np.int64),) + (empty32,) * 2

    def acquire(self) -> int:
        if self._free:
            return self._free.pop()
        slot = len(self._synced)
        self.arrays.append(self._empty)
        self._synced.append(-1)
        if slot >= self.n.shape[0]:
            self.n = _grow(self.n, slot + 1)
        return slot

    def sync(self, slot: int, seq: "_Seq") -> None:
        if self._synced[slot] != seq.version:
            self.arrays[slot] = tuple(getattr(seq, name) for name in self.FIELDS)
            self._synced[slot] = seq.version
        self.n[slot] = seq.n

    def release(self, slot: int) -> None:
        self.arrays[slot] = self._empty  # drop the references so the memory is freed now
        self._synced[slot] = -1
        self.n[slot] = 0
        self._free.append(slot)


def _pow2(x: int) -> int:
    return 1 << max(4, int(x - 1).bit_length())


def _grow(a: np.ndarray, need: int) -> np.ndarray:
    b = np.empty(max(need, 2 * a.shape[0]), a.dtype)
    b[: a.shape[0]] = a
    return b


@dataclass(frozen=True)
class SuffixMatch:
    """Continuations of one matching suffix length (debug/test view, built in Python: not for the hot path).

    `occurrences` = earlier occurrences of the last `m` tokens; `counts[path]` = how many of them were followed by
    `path` (a tuple of 1..depth tokens).
    """

    m: int
    occurrences: int
    counts: dict[tuple[int, ...], int]


class InputIndex:
    """Prompt + self-output count-tries of all active requests.

    Example:
        idx = InputIndex(query_len=2, depth=2)
        idx.start_request("r1", [5, 6, 7, 5, 6])
        idx.extend("r1", [8, 5, 6])
        [(s.m, s.occurrences) for s in idx.matches("r1")]   # -> [(2, 2), (1, 2)]
        idx.stop_request("r1")
    """

    def __init__(self, *, query_len: int = 4, depth: int = 8, max_tokens: int = 16384, vocab_size: int | None = None,
                 history_tokens: int = 0, history_top: int = 5):
        if query_len < 1 or depth < 1:
            raise ValueError(f"query_len and depth must be >= 1, got {query_len} and {depth}")
        if max_tokens < 4 * (query_len + depth):
            raise ValueError(f"max_tokens={max_tokens} is too small; use at least 4 * (query_len + depth)")
        if history_tokens < 0:
            raise ValueError(f"history_tokens must be >= 0 (0 = no output history), got {history_tokens}")
        if history_top < 1:
            raise ValueError(f"history_top must be >= 1, got {history_top}")
        self.query_len = query_len
        self.depth = depth
        self.window = query_len + depth  # n-grams up to query_len + depth tokens are counted
        self.max_tokens = max_tokens
        self.vocab_size = vocab_size
        self._seqs: dict[Hashable, _Seq] = {}
        self._slots: dict[Hashable, int] = {}
        self.tables = _SlotTables()
        self.history_tokens = history_tokens
        self.history_top = history_top  # children per history node the drafter reads (its most frequent)
        self._history_outputs: list[np.ndarray] = []  # oldest first; together at most history_tokens tokens
        self._history: _Seq | None = None
        self.history_slot = -1  # slot of the shared output history in `tables` (-1: none)
        if history_tokens:
            self.history_slot = self.tables.acquire()
            self.clear_history()

    # ---- lifecycle -------------------------------------------------------------------------------------------
    @property
    def active_requests(self) -> KeysView:
        return self._seqs.keys()

    def start_request(self, request_id: Hashable, prompt_ids) -> None:
        """Begin indexing a request with its prompt. Raises ValueError if the id is active or tokens are invalid."""
        if request_id in self._seqs:
            raise ValueError(f"request {request_id!r} is already active; call stop_request first")
        toks = self._check_tokens(prompt_ids, what="prompt_ids")
        seq = _Seq(self.window, min(max(toks.shape[0] + 64, 64), self.max_tokens))
        self._add(seq, toks)
        seq.prompt_len = toks.shape[0]
        slot = self.tables.acquire()
        self.tables.sync(slot, seq)
        self._seqs[request_id] = seq
        self._slots[request_id] = slot

    def extend(self, request_id: Hashable, accepted_ids) -> None:
        """Append accepted output tokens (O(depth) per token). Raises ValueError for an unknown id or bad tokens."""
        seq = self._get(request_id)
        toks = self._check_tokens(accepted_ids, what="accepted_ids")
        self._add(seq, toks)
        self.tables.sync(self._slots[request_id], seq)

    def stop_request(self, request_id: Hashable) -> None:
        """Forget a request and free its memory; its output joins the output history (when there is one)."""
        seq = self._get(request_id)
        if self._history is not None:
            n_out = min(seq.total - seq.prompt_len, seq.n)
            if n_out > 0:
                self._remember(seq.buf[seq.n - n_out : seq.n].copy())
        del self._seqs[request_id]
        self.tables.release(self._slots.pop(request_id))

    # ---- output history --------------------------------------------------------------------------------------
    def clear_history(self) -> None:
        """Forget every remembered output (e.g. between benchmark runs over the same prompts)."""
        if not self.history_tokens:
            return
        self._history_outputs = []
        self._rebuild_history()

    def history(self) -> list[np.ndarray]:
        """The remembered outputs, oldest first (copies)."""
        return [o.copy() for o in self._history_outputs]

    def _remember(self, output: np.ndarray) -> None:
        output = output[-self.history_tokens :]
        self._history_outputs.append(output)
        total = sum(o.shape[0] for o in self._history_outputs)
        if total <= self.history_tokens:
            self._history.new_segment()
            self._history.append(output)
            self.tables.sync(self.history_slot, self._history)
            return
        # Over the cap: drop whole outputs, oldest first, down to 3/4 of it, and rebuild (amortised O(window)/token).
        while total > self.history_tokens - self.history_tokens // 4 and len(self._history_outputs) > 1:
            total -= self._history_outputs.pop(0).shape[0]
        self._rebuild_history()

    def _rebuild_history(self) -> None:
        total = sum(o.shape[0] for o in self._history_outputs)
        seq = _Seq(self.window, max(total, 64), top_k=self.history_top)
        for output in self._history_outputs:
            seq.new_segment()
            seq.append(output)
        seq.version = (self._history.version + 1) if self._history is not None else 0
        self._history = seq
        self.tables.sync(self.history_slot, seq)

    # ---- views -----------------------------------------------------------------------------------------------
    def tokens(self, request_id: Hashable) -> np.ndarray:
        """Read-only view of the tokens currently indexed (the last <= max_tokens of the sequence)."""
        seq = self._get(request_id)
        v = seq.buf[: seq.n].view()
        v.flags.writeable = False
        return v

    def num_tokens(self, request_id: Hashable) -> int:
        """Tokens seen by the request so far (including any dropped for the memory cap)."""
        return self._get(request_id).total

    def num_nodes(self, request_id: Hashable) -> int:
        return self._get(request_id).n_nodes

    def matches(self, request_id: Hashable) -> list[SuffixMatch]:
        """Every suffix length m = query_len..1 that occurred earlier, with continuation counts (debug/test)."""
        seq = self._get(request_id)
        out = []
        for m in range(min(self.query_len, seq.n), 0, -1):
            node = 0
            for t in seq.buf[seq.n - m : seq.n]:
                node = int(trie_child(seq.hkeys, seq.hvals, node, t))
            if seq.cnt[node] <= 1:
                continue
            counts: dict[tuple[int, ...], int] = {}
            stack = [(int(seq.first[node]), ())]
            while stack:
                c, path = stack.pop()
                while c >= 0:
                    p = path + (int(seq.tok[c]),)
                    counts[p] = int(seq.cnt[c])
                    if len(p) < self.depth:
                        stack.append((int(seq.first[c]), p))
                    c = int(seq.sib[c])
            out.append(SuffixMatch(m=m, occurrences=int(seq.cnt[node]) - 1, counts=counts))
        return out

    def slot(self, request_id: Hashable) -> int:
        """The request's slot in `tables` (for batch kernels)."""
        self._get(request_id)
        return self._slots[request_id]

    # ---- internals -------------------------------------------------------------------------------------------
    def _get(self, request_id: Hashable) -> _Seq:
        try:
            return self._seqs[request_id]
        except (KeyError, TypeError):
            raise ValueError(f"unknown request id {request_id!r}: call start_request first") from None

    def _check_tokens(self, ids, *, what: str) -> np.ndarray:
        arr = np.asarray(ids)
        if arr.ndim != 1:
            raise ValueError(f"{what} must be a 1-D sequence of token ids, got shape {arr.shape}")
        if arr.size == 0:
            return np.empty(0, np.int32)
        if not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"{what} must hold integer token ids, got dtype {arr.dtype}")
        hi = self.vocab_size if self.vocab_size is not None else 2**31 - 1
        lo_v, hi_v = int(arr.min()), int(arr.max())
        if lo_v < 0 or hi_v >= hi:
            bad = lo_v if lo_v < 0 else hi_v
            raise ValueError(f"{what} holds token id {bad} outside the vocabulary [0, {hi}); check the tokenizer")
        return np.ascontiguousarray(arr, dtype=np.int32)

    def _add(self, seq: _Seq, toks: np.ndarray) -> None:
        seq.total += toks.shape[0]
        if seq.n + toks.shape[0] > self.max_tokens:
            # Drop the oldest windows: keep the newest 3/4 of the cap and rebuild (amortised O(window) per token).
            keep = np.concatenate([seq.buf[: seq.n], toks])[-(self.max_tokens - self.max_tokens // 4) :]
            fresh = _Seq(self.window, self.max_tokens)
            fresh.total = seq.total
            fresh.prompt_len = seq.prompt_len
            fresh.append(np.ascontiguousarray(keep))
            fresh.version = seq.version + 1
            for name in _Seq.__slots__:
                setattr(seq, name, getattr(fresh, name))
            return
        if toks.shape[0]:
            seq.append(toks)
