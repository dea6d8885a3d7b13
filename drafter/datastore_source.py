"""Datastore source: batched back-off lookups merged into one small count-trie per (request, datastore).

Vocabulary
    prefix        the last q (= 4) tokens of a request's sequence.
    round         one lookup of a (shorter) prefix; a request's rounds in one datastore run in one compiled call
                  (`backoff_rows`) that reuses the datastore's search kernels.
    back-off      (SSSD) after a round, a request whose merged trie holds fewer than `threshold` (50) continuations
                  and whose prefix is still longer than 1 token drops the prefix's FIRST token and is queried again;
                  the new continuations are ADDED to the same trie (counts summed). At most q rounds.
    match length  the longest prefix length that returned anything (the calibration bucket of datastore nodes).
    branch length how many tokens each continuation contributes: fixed, or SSSD's `default_branch_func` of the
                  tree size s = budget + 1 (s <= 5: s - 1; <= 8: 5; <= 32: 6; <= 48: 8; else 10).

Worked example (threshold 50, K = 100): prefix `a b c d` has 12 matches -> 12 rows; 12 < 50 so `b c d` is queried:
300 matches, 100 sampled rows -> the merged trie's root count is 112 and back-off stops; match length = 4.

A request's tries (one per datastore) live in flat arrays `tok, cnt, first, sib` of its own (`request_tries`; each
datastore's nodes a contiguous block starting at its root), so requests are looked up independently, in parallel
inside the drafter's kernel; `lookup_tries` lays a batch's end to end. `roots[b, k]` is -1 when datastore k gave
request b nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numba as nb
import numpy as np
from numba import typed

from datastore.kernels import gather_one, ranges_one, split_k


@nb.njit(cache=True)
def sssd_branch_length(budget: int) -> int:
    """SSSD's `default_branch_func`: continuation length for a tree of s = budget + 1 nodes (root included)."""
    s = budget + 1
    if s <= 5:
        return max(s - 1, 1)
    if s <= 8:
        return 5
    if s <= 32:
        return 6
    if s <= 48:
        return 8
    return 10


@nb.njit(cache=True)
def backoff_rows(tokens_tup, sa_tup, sep, prefix, k, L, threshold, rows, owner, o, group):
    """SSSD's back-off lookup of one request against one datastore, its rows written from row `o` of `rows` on (each
    row's `owner`: `group`); returns (the next free row, the match length, the rounds queried).

    It queries `prefix` (the request's last plen tokens), then ever shorter suffixes: round r uses its last plen - r
    tokens and runs only while rounds 0..r-1 gathered fewer than `threshold` continuations. Each round samples at most
    k continuations of length L (datastore.kernels), so `rows` [>= o + k * plen, L] holds them all, rounds in order.
    The match length is the longest suffix that returned anything (0: none)."""
    plen = prefix.shape[0]
    n_shards = len(tokens_tup)
    lo = np.empty((1, n_shards), np.int64)
    hi = np.empty_like(lo)
    take = np.empty_like(lo)
    query = np.empty(max(plen, 1), np.int64)
    q_off = np.zeros(2, np.int64)
    match_len, rounds, gathered = 0, 0, 0
    for r in range(plen):
        if r > 0 and gathered >= threshold:
            break
        c = plen - r
        for j in range(c):
            query[j] = prefix[r + j]
        q_off[1] = c
        total = ranges_one(tokens_tup, sa_tup, query, q_off, 0, lo, hi)
        n = split_k(lo, hi, 0, k, total, take)
        gather_one(tokens_tup, sa_tup, sep, q_off, 0, lo, hi, take, L, rows, o)
        got = 0
        for row in range(o, o + n):
            owner[row] = group
            if rows[row, 0] >= 0:
                got += 1
        if got > 0 and match_len == 0:
            match_len = c
        gathered += got
        rounds += 1
        o += n
    return o, match_len, rounds


# Serial on purpose: one request's tries are microseconds of work, less than one wake-up of numba's thread pool on a
# loaded 2-core host (measured ~5 ms per launch while other processes ran); the drafter's loop runs requests in
# parallel instead (`drafter.fusion._fuse_rows`).
@nb.njit(cache=True)
def build_tries(rows, row_off, lens, node_off, tok, cnt, first, sib):
    """Group g's rows rows[row_off[g]:row_off[g+1]] (each cut at -1 and at lens[g]) into a count-trie rooted at
    node_off[g]. Siblings are prepended, so rows arriving in sorted order find their shared prefix first."""
    for g in range(row_off.shape[0] - 1):
        root = node_off[g]
        n = root + 1
        tok[root] = -1
        cnt[root] = 0
        first[root] = -1
        sib[root] = -1
        for r in range(row_off[g], row_off[g + 1]):
            if rows[r, 0] < 0:
                continue
            cnt[root] += 1
            node = root
            for j in range(lens[g]):
                t = rows[r, j]
                if t < 0:
                    break
                c = first[node]
                while c >= 0 and tok[c] != t:
                    c = sib[c]
                if c < 0:
                    c = n
                    n += 1
                    tok[c] = t
                    cnt[c] = 0
                    first[c] = -1
                    sib[c] = first[node]
                    first[node] = c
                cnt[c] += 1
                node = c
        # unused slots of the block keep garbage: nothing links to them


@nb.njit(cache=True)
def tries_of_rows(rows, owner, lens):
    """Each group's count-trie (`build_tries`) of its rows: `owner[r]` is row r's group, the rows grouped and in
    order, group g cut at `lens[g]` tokens. Returns (tok, cnt, first, sib, roots): group g's root node, -1 where
    nothing was retrieved. One compiled call: as array operations around `build_tries`, this glue cost more than
    the back-off search itself (~120 us of a ~210 us lookup at batch 1 inside a served run, whose verify steps
    leave the caches cold)."""
    G = lens.shape[0]
    row_off = np.zeros(G + 1, np.int64)
    for r in range(owner.shape[0]):
        row_off[owner[r] + 1] += 1
    node_off = np.zeros(G + 1, np.int64)
    for g in range(G):
        node_off[g + 1] = node_off[g] + row_off[g + 1] * lens[g] + 1
        row_off[g + 1] += row_off[g]
    n = node_off[G]
    tok = np.empty(n, np.int32)
    cnt = np.empty(n, np.int32)
    first = np.empty(n, np.int32)
    sib = np.empty(n, np.int32)
    build_tries(rows, row_off, lens, node_off, tok, cnt, first, sib)
    roots = np.empty(G, np.int64)
    for g in range(G):
        roots[g] = node_off[g] if cnt[node_off[g]] > 0 else -1
    return tok, cnt, first, sib, roots


def _read_only_empty(dtype) -> np.ndarray:
    a = np.zeros(0, dtype)
    a.flags.writeable = False  # datastores are read-only maps: the same array type as theirs
    return a


# `lookup_tries`' stand-in for "no datastore" (a loop over an empty tuple does not compile), to be queried with branch
# length 0 only: typed as a one-shard datastore of a vocabulary under 65536 is, so that a drafter without datastores
# runs the kernels such a drafter compiled (each new type compiles them again)
NO_DATASTORE = ((_read_only_empty(np.uint16),), (_read_only_empty(np.int32),), -1)


def kernel_datastores(datastores: Sequence) -> typed.List:
    """`request_tries`' and `lookup_tries`' `datastores`: each one's `kernel_arrays()`, its shards padded with empty
    ones to the most any of them has, so that all are of one type (a compiled loop can index them; an empty shard
    matches nothing, so it changes no lookup). Every datastore of a drafter has its vocabulary, so its token
    encoding. A numba typed list rather than a tuple: a parallel loop's body cannot take a tuple of arrays in."""
    arrays = [ds.kernel_arrays() for ds in datastores]
    if not arrays:
        return typed.List([NO_DATASTORE])
    shards = max(len(tokens) for tokens, _, _ in arrays)
    return typed.List((tuple(tokens) + (_read_only_empty(tokens[0].dtype),) * (shards - len(tokens)),
                       tuple(sas) + (_read_only_empty(sas[0].dtype),) * (shards - len(sas)), int(sep))
                      for tokens, sas, sep in arrays)


@nb.njit(cache=True)
def request_tries(datastores, P, plen, lengths, b, k, threshold):
    """Request b's back-off lookup in every datastore (`backoff_rows`) and the count-tries of its rows
    (`tries_of_rows`), in arrays of its own, so that requests are independent: the drafter looks each one up on the
    thread that grows its tree (`drafter.fusion`). `datastores` is `kernel_datastores(...)`, `P` [B, q] the
    right-aligned prefixes (request b's are its last plen[b] columns), `lengths[b]` its branch length (0: skip).
    Returns the tries' (tok, cnt, first, sib) and, per datastore, the root (-1: nothing retrieved), the match length
    and the rounds queried."""
    K = len(datastores)
    L = max(lengths[b], 1)
    n_queries = plen[b] if lengths[b] > 0 else 0  # branch length 0: nothing is looked up
    prefix = P[b, P.shape[1] - n_queries:]
    rows = np.empty((K * n_queries * k, L), np.int32)  # upper bound: every round returns k rows
    owner = np.empty(K * n_queries * k, np.int64)
    match_len = np.zeros(K, np.int32)
    rounds = np.zeros(K, np.int32)
    o = np.int64(0)  # not a literal 0: that would compile `backoff_rows` for a type of its own (drafter.fusion)
    for kk in range(K):  # group kk: datastore kk's rows, in order
        tokens, sas, sep = datastores[kk]
        o, match_len[kk], rounds[kk] = backoff_rows(tokens, sas, sep, prefix, k, L, threshold, rows, owner, o,
                                                    np.int64(kk))
    lens = np.full(K, np.int64(lengths[b]))
    tok, cnt, first, sib, roots = tries_of_rows(rows[:o], owner[:o], lens)
    return tok, cnt, first, sib, roots, match_len, rounds


@nb.njit(cache=True)
def lookup_tries(datastores, P, plen, lengths, k, threshold):
    """Every request's `request_tries`, laid end to end in one set of arrays (request after request): the tries'
    (tok, cnt, first, sib) and, per [request, datastore], the root (-1: nothing retrieved), the match length and
    the rounds queried."""
    B = P.shape[0]
    K = len(datastores)
    parts = [request_tries(datastores, P, plen, lengths, b, k, threshold) for b in range(B)]
    total = 0
    for part in parts:
        total += part[0].shape[0]
    tok = np.empty(total, np.int32)
    cnt = np.empty(total, np.int32)
    first = np.empty(total, np.int32)
    sib = np.empty(total, np.int32)
    roots = np.full((B, K), -1, np.int64)
    match_len = np.zeros((B, K), np.int32)
    rounds = np.zeros((B, K), np.int32)
    offset = 0
    for b in range(B):
        t, c, f, s, r, m, q = parts[b]
        for i in range(t.shape[0]):  # links move with their request's block; -1 stays -1
            tok[offset + i] = t[i]
            cnt[offset + i] = c[i]
            first[offset + i] = f[i] + offset if f[i] >= 0 else -1
            sib[offset + i] = s[i] + offset if s[i] >= 0 else -1
        for kk in range(K):
            if r[kk] >= 0:
                roots[b, kk] = r[kk] + offset
            match_len[b, kk] = m[kk]
            rounds[b, kk] = q[kk]
        offset += t.shape[0]
    return tok, cnt, first, sib, roots, match_len, rounds


@dataclass(frozen=True, eq=False)
class DatastoreCandidates:
    tok: np.ndarray  # int32 [N] token of each node (-1 at roots)
    cnt: np.ndarray  # int32 [N] continuations passing through the node
    first: np.ndarray  # int32 [N] first child or -1
    sib: np.ndarray  # int32 [N] next sibling or -1
    roots: np.ndarray  # int64 [B, n_datastores] root node, -1 when nothing was retrieved
    match_len: np.ndarray  # int32 [B, n_datastores] longest prefix length that matched (0 = none)
    rounds: np.ndarray  # int32 [B, n_datastores] prefix lengths queried (back-off rounds)

    def counts(self, b: int, k: int) -> dict[tuple[int, ...], int]:
        """Path -> count of the merged trie of request b, datastore k (debug/test; the root is path ())."""
        r = int(self.roots[b, k])
        if r < 0:
            return {}
        out = {(): int(self.cnt[r])}
        stack = [(int(self.first[r]), ())]
        visited = 0
        while stack:
            c, path = stack.pop()
            while c >= 0:
                visited += 1
                if visited > self.tok.shape[0]:  # more nodes than there are: the links go round
                    raise ValueError(f"the trie of request {b}, datastore {k} links back into itself")
                p = path + (int(self.tok[c]),)
                out[p] = int(self.cnt[c])
                stack.append((int(self.first[c]), p))
                c = int(self.sib[c])
        return out


class DatastoreSource:
    """Back-off retrieval over one or more datastores for a whole batch, from any prefixes (one `lookup_tries` call):
    the candidates as a `DatastoreCandidates` to inspect. `Drafter` runs the same kernel inside its own compiled
    drafting call (`drafter.fusion.draft_batch`), on the prefixes its input index holds.

    Example:
        src = DatastoreSource([ds], query_len=4, samples=100, threshold=50)
        cand = src.lookup([np.array([5, 6, 7, 8])], lengths=np.array([6]))
        cand.counts(0, 0)   # {(): 112, (9,): 80, (9, 3): 41, ...}
    """

    def __init__(self, datastores: Sequence, *, query_len: int = 4, samples: int = 100, threshold: int = 50):
        self.datastores = list(datastores)
        self.kernel_arrays = kernel_datastores(self.datastores)
        self.query_len = query_len
        self.samples = samples
        self.threshold = threshold

    def lookup(self, prefixes: Sequence[np.ndarray], lengths: np.ndarray) -> DatastoreCandidates:
        """Candidates for each request: `prefixes[b]` = its recent tokens (the last q are used), `lengths[b]` its
        branch length (0 = skip the request)."""
        q = self.query_len
        B, K = len(prefixes), len(self.datastores)
        lengths = np.asarray(lengths, np.int32)
        if K == 0:
            empty = np.zeros(0, np.int32)
            return DatastoreCandidates(tok=empty, cnt=empty, first=empty, sib=empty, roots=np.full((B, 0), -1),
                                       match_len=np.zeros((B, 0), np.int32), rounds=np.zeros((B, 0), np.int32))
        # right-aligned [B, q] prefix matrix: the prefix of length c of request b is P[b, q - c:]
        P = np.zeros((B, q), np.int64)
        plen = np.zeros(B, np.int64)
        for b, p in enumerate(prefixes):
            p = np.asarray(p)[-q:]
            plen[b] = p.shape[0]
            if p.shape[0]:
                P[b, q - p.shape[0] :] = p
        tok, cnt, first, sib, roots, match_len, rounds = lookup_tries(self.kernel_arrays, P, plen, lengths,
                                                                      self.samples, self.threshold)
        return DatastoreCandidates(tok=tok, cnt=cnt, first=first, sib=sib, roots=roots, match_len=match_len,
                                   rounds=rounds)
