"""Datastore source: batched back-off lookups merged into one small count-trie per (request, datastore).

Vocabulary
    prefix        the last q (= 4) tokens of a request's sequence.
    round         one `continuations_batch` call for every request of the batch that still needs candidates.
    back-off      (SSSD) after a round, a request whose merged trie holds fewer than `threshold` (50) continuations
                  and whose prefix is still longer than 1 token drops the prefix's FIRST token and is queried again;
                  the new continuations are ADDED to the same trie (counts summed). At most q rounds.
    match length  the longest prefix length that returned anything (the calibration bucket of datastore nodes).
    branch length how many tokens each continuation contributes: fixed, or SSSD's `default_branch_func` of the
                  tree size s = budget + 1 (s <= 5: s - 1; <= 8: 5; <= 32: 6; <= 48: 8; else 10).

Worked example (threshold 50, K = 100): prefix `a b c d` has 12 matches -> 12 rows; 12 < 50 so `b c d` is queried:
300 matches, 100 sampled rows -> the merged trie's root count is 112 and back-off stops; match length = 4.

The tries of all (datastore, request) groups live in shared flat arrays `tok, cnt, first, sib` (group g's nodes are
a contiguous block starting at its root); `roots[b, k]` is -1 when datastore k gave request b nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numba as nb
import numpy as np


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


# Serial on purpose: the whole batch is tens of microseconds of work, less than one wake-up of numba's thread pool on
# a loaded 2-core host (measured ~5 ms per launch while other processes ran).
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
        while stack:
            c, path = stack.pop()
            while c >= 0:
                p = path + (int(self.tok[c]),)
                out[p] = int(self.cnt[c])
                stack.append((int(self.first[c]), p))
                c = int(self.sib[c])
        return out


class DatastoreSource:
    """Back-off retrieval over one or more datastores for a whole batch (one call per datastore per round).

    Example:
        src = DatastoreSource([ds], query_len=4, samples=100, threshold=50)
        cand = src.lookup([np.array([5, 6, 7, 8])], lengths=np.array([6]))
        cand.counts(0, 0)   # {(): 112, (9,): 80, (9, 3): 41, ...}
    """

    def __init__(self, datastores: Sequence, *, query_len: int = 4, samples: int = 100, threshold: int = 50):
        self.datastores = list(datastores)
        self.query_len = query_len
        self.samples = samples
        self.threshold = threshold

    def lookup(self, prefixes: Sequence[np.ndarray], lengths: np.ndarray) -> DatastoreCandidates:
        """Candidates for each request: `prefixes[b]` = its recent tokens (the last q are used), `lengths[b]` its
        branch length (0 = skip the request)."""
        q = self.query_len
        B, K = len(prefixes), len(self.datastores)
        lengths = np.asarray(lengths, np.int32)
        L = int(lengths.max()) if B else 1
        # right-aligned [B, q] prefix matrix: the prefix of length c of request b is P[b, q - c:]
        P = np.zeros((B, q), np.int64)
        plen = np.zeros(B, np.int64)
        for b, p in enumerate(prefixes):
            p = np.asarray(p)[-q:]
            plen[b] = p.shape[0]
            if p.shape[0]:
                P[b, q - p.shape[0] :] = p
        rows_all, owner_all = [], []
        match_len = np.zeros((B, K), np.int32)
        rounds = np.zeros((B, K), np.int32)
        active = np.nonzero((plen > 0) & (lengths > 0))[0]
        # Every back-off round of every request in ONE datastore call: round j of request b queries its last
        # plen[b] - j tokens. Which rounds SSSD would have run is decided afterwards from the per-round counts
        # (round j runs while rounds 0..j-1 gathered fewer than `threshold` continuations), so the result is the
        # same as querying round by round, without a Python round trip per round.
        n_rounds = plen[active]
        req = np.repeat(active, n_rounds)  # one entry per (request, round)
        rnd = np.arange(req.size) - np.repeat(np.cumsum(n_rounds) - n_rounds, n_rounds)
        c = plen[req] - rnd  # prefix length of that round
        offsets = np.zeros(req.size + 1, np.int64)
        np.cumsum(c, out=offsets[1:])
        cols = np.arange(q)
        flat = P[req][cols[None, :] >= (q - c)[:, None]]  # row-major: each prefix's tokens in order
        for k, ds in enumerate(self.datastores):
            if req.size == 0:
                break
            res = _continuations(ds, flat, offsets, self.samples, L)
            rows = np.asarray(res.rows, np.int32).reshape(-1, L)
            per = np.diff(np.asarray(res.offsets, np.int64))
            query_of_row = np.repeat(np.arange(req.size), per)
            got = np.bincount(query_of_row, weights=rows[:, 0] >= 0, minlength=req.size)
            before = np.cumsum(got) - got  # continuations gathered by earlier queries, across requests...
            first_of_req = np.repeat(np.cumsum(n_rounds) - n_rounds, n_rounds)
            before -= before[first_of_req]  # ...made per request
            run = (rnd == 0) | (before < self.threshold)
            keep = run[query_of_row]
            rows_all.append(rows[keep])
            owner_all.append(req[query_of_row[keep]] + k * B)
            rounds[:, k] = np.bincount(req[run], minlength=B)
            hit = run & (got > 0)
            longest = np.zeros(B, np.int64)
            np.maximum.at(longest, req[hit], c[hit])  # the longest prefix that returned anything
            match_len[:, k] = longest
        G = B * K
        if rows_all:
            rows = np.concatenate(rows_all)
            owner = np.concatenate(owner_all)
            order = np.argsort(owner, kind="stable")  # group rows per (datastore, request), rounds in order
            rows = np.ascontiguousarray(rows[order])
            per_group = np.bincount(owner, minlength=G)
        else:
            rows = np.full((0, L), -1, np.int32)
            per_group = np.zeros(G, np.int64)
        row_off = np.zeros(G + 1, np.int64)
        np.cumsum(per_group, out=row_off[1:])
        glens = np.tile(lengths, K).astype(np.int64)
        node_off = np.zeros(G + 1, np.int64)
        np.cumsum(per_group * glens + 1, out=node_off[1:])
        N = int(node_off[-1])
        tok = np.empty(N, np.int32)
        cnt = np.empty(N, np.int32)
        first = np.empty(N, np.int32)
        sib = np.empty(N, np.int32)
        if G:
            build_tries(rows, row_off, glens, node_off, tok, cnt, first, sib)
        roots = node_off[:-1].reshape(K, B).T.copy() if G else np.zeros((B, K), np.int64)
        if G:
            roots[cnt[roots] <= 0] = -1
        return DatastoreCandidates(tok=tok, cnt=cnt, first=first, sib=sib, roots=roots, match_len=match_len,
                                   rounds=rounds)


def _continuations(ds, flat: np.ndarray, offsets: np.ndarray, k: int, length: int):
    """One batched datastore query; prefers the flat entry point (no per-prefix Python work)."""
    if hasattr(ds, "continuations_flat"):
        return ds.continuations_flat(flat, offsets, k, length)
    return ds.continuations_batch([flat[offsets[i] : offsets[i + 1]] for i in range(offsets.size - 1)], k, length)
