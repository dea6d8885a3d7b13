"""Fusion: SSSD Algorithm 1 — best-first growth of ONE draft tree from every candidate source.

Vocabulary
    candidate trie  a count-trie per source, in flat arrays `tok, cnt, first (child), sib (next sibling)`:
                    the request's input index (prompt + self-output), the output history of earlier requests
                    (optional, source id 1 + number of datastores) and one small merged trie per datastore.
    entry           a heap item: "put token `tok` under tree node `at`; it comes from trie node `ref` of source
                    `src`, has raw score `raw` and calibrated key `key`".
    raw score       conditional frequency count(child) / count(parent) multiplied along the path. Input-source
                    scores are scaled by `input_scale` (0.6) at depth 1 and damped by delta(m) = 0.6 + 0.1 m at every
                    deeper level (m = length of the matched suffix); output-history scores likewise (each of
                    its trie nodes offers only its `fanout` most frequent children). Datastore scores are plain
                    frequencies.
    key             calibrated raw score, capped by the tree parent's probability, so probabilities never increase
                    along a path (the heap is then a true best-first order over path probabilities).

Algorithm (sssd-notes §2.1): push the children of every matched input suffix node (m = q..1), of every matched
output-history suffix node, and of every datastore root; then pop the best entry (ties: deeper first, then lower
token, lower source id, longer match, lower tree parent); insert its token under its tree parent, or reuse the
existing node with the same token (two sources that agree make one node; scores are not summed); a parent already
holding `fanout` children rejects new tokens; while the tree is below budget, push the popped entry's trie children
under the (new or reused) node. Stop at the budget or when the heap is empty.

Worked example (budget 2, fanout 5): input matched m=1 with children {x: 3, y: 1} -> keys 0.45, 0.15; the datastore
root has {x: 60, z: 40} -> keys 0.6, 0.4. Pops: x (0.6, datastore) -> node 0, its datastore children are pushed;
x (0.45, input) is the same token under the same parent, so it is merged into node 0 and its input children are pushed
there too; the best of z (0.4) and those children becomes node 1, and the budget is reached.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from drafter.datastore_source import request_tries, sssd_branch_length
from drafter.input_index import trie_child

# entry columns (float64 [cap, 9]; integer fields are exact in float64)
_KEY, _RAW, _DEPTH, _TOK, _REF, _SRC, _AT, _DELTA, _MLEN = range(9)

# Integer arguments of the helpers below are passed as int64 values, never as literals or narrower ints: numba
# compiles a jitted callee once per tuple of argument types, and a constant argument has a type of its own
# (Literal[int](1)), so each constant call site compiled `_push` and its callers again: 8 copies of `_push`, and a
# fresh install's first `Drafter` compiled 2.6x as long: 43 s against 16 (`benchmarks/results/compile_time.md` at
# 8e52746).
_ZERO = np.int64(0)
_ONE = np.int64(1)
_ROOT = np.int64(-1)  # tree parent of a root-level entry


@nb.njit(cache=True)
def calibrate(src, depth, mlen, raw, lookup, kx, ky, kn):
    """Piecewise-linear calibration of one raw score (identity when the lookup table has no curve)."""
    v = min(max(raw, 0.0), 1.0)
    if src >= lookup.shape[0]:
        return v
    d = min(depth, lookup.shape[1]) - 1
    b = min(max(mlen, 1), lookup.shape[2]) - 1
    ci = lookup[src, d, b]
    if ci < 0:
        return v
    n = kn[ci]
    if raw <= kx[ci, 0]:
        return ky[ci, 0]
    if raw >= kx[ci, n - 1]:
        return ky[ci, n - 1]
    lo = 0
    hi = n - 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if kx[ci, mid] <= raw:
            lo = mid
        else:
            hi = mid
    t = (raw - kx[ci, lo]) / (kx[ci, hi] - kx[ci, lo])
    return ky[ci, lo] + t * (ky[ci, hi] - ky[ci, lo])


@nb.njit(cache=True, inline="always")
def _better(ent, a, b):
    if ent[a, _KEY] != ent[b, _KEY]:
        return ent[a, _KEY] > ent[b, _KEY]
    if ent[a, _DEPTH] != ent[b, _DEPTH]:
        return ent[a, _DEPTH] > ent[b, _DEPTH]
    # remaining ties: a total order that does not depend on trie sibling order (reproducible by a reference)
    if ent[a, _TOK] != ent[b, _TOK]:
        return ent[a, _TOK] < ent[b, _TOK]
    if ent[a, _SRC] != ent[b, _SRC]:
        return ent[a, _SRC] < ent[b, _SRC]
    if ent[a, _MLEN] != ent[b, _MLEN]:
        return ent[a, _MLEN] > ent[b, _MLEN]
    if ent[a, _AT] != ent[b, _AT]:
        return ent[a, _AT] < ent[b, _AT]
    return a < b


@nb.njit(cache=True)
def _push(ent, heap, n_ent, n_heap, key, raw, depth, tok, ref, src, at, delta, mlen):
    """Append an entry and sift it up; returns possibly reallocated (ent, heap)."""
    if n_ent == ent.shape[0]:
        # copied element by element: a slice assignment compiles numba's shape-mismatch error message (~5 s)
        bigger = np.empty((2 * ent.shape[0], ent.shape[1]), np.float64)
        flat_old, flat_new = ent.reshape(-1), bigger.reshape(-1)
        for i in range(n_ent * ent.shape[1]):
            flat_new[i] = flat_old[i]
        ent = bigger
        h2 = np.empty(2 * heap.shape[0], np.int64)
        for i in range(n_heap):
            h2[i] = heap[i]
        heap = h2
    e = ent[n_ent]
    e[_KEY], e[_RAW], e[_DEPTH], e[_TOK], e[_REF] = key, raw, depth, tok, ref
    e[_SRC], e[_AT], e[_DELTA], e[_MLEN] = src, at, delta, mlen
    i = n_heap
    heap[i] = n_ent
    while i > 0:
        p = (i - 1) // 2
        if _better(ent, heap[i], heap[p]):
            heap[i], heap[p] = heap[p], heap[i]
            i = p
        else:
            break
    return ent, heap


@nb.njit(cache=True)
def _pop(ent, heap, n_heap):
    top = heap[0]
    n_heap -= 1
    heap[0] = heap[n_heap]
    i = 0
    while True:
        l = 2 * i + 1
        if l >= n_heap:
            break
        c = l
        if l + 1 < n_heap and _better(ent, heap[l + 1], heap[l]):
            c = l + 1
        if _better(ent, heap[c], heap[i]):
            heap[i], heap[c] = heap[c], heap[i]
            i = c
        else:
            break
    return top


@nb.njit(cache=True)
def _seed_suffixes(ent, heap, n_ent, n_heap, seq, n_seq, tok, cnt, first, sib, hkeys, hvals, top, k, self_occ, src,
                   query_len, input_scale, delta_base, delta_step, lookup, kx, ky, kn):
    """Push the children of every suffix m = q..1 of `seq` found in a count-trie (the request's own index, where the
    query itself is one occurrence: self_occ = 1; or the output history: self_occ = 0): all of a trie node's
    children (k = 0), or its k most frequent, listed in `top` (`drafter.input_index._Seq.top`)."""
    for m in range(min(query_len, n_seq), 0, -1):
        node = np.int64(0)
        for i in range(n_seq - m, n_seq):
            node = trie_child(hkeys, hvals, node, seq[i])
            if node < 0:
                break
        if node < 0:
            continue
        occ = cnt[node] - self_occ
        if occ <= 0:
            continue
        ent, heap, n_ent, n_heap = _push_count_children(
            ent, heap, n_ent, n_heap, tok, cnt, first, sib, top, k, node, input_scale, np.int64(occ), 1.0,
            delta_base + delta_step * m, m, _ONE, 1.0, src, _ROOT, lookup, kx, ky, kn)
    return ent, heap, n_ent, n_heap


@nb.njit(cache=True)
def _push_count_children(ent, heap, n_ent, n_heap, tok, cnt, first, sib, top, k, ref, scale, occ, damp, delta, mlen,
                         depth, pprob, src, at, lookup, kx, ky, kn):
    """Push the children of count-trie node `ref` (all, k = 0; or its k most frequent, from `top`) under tree node
    `at` (-1: the root), each scored scale * count / occ * damp (seed: input_scale, earlier occurrences, 1; deeper:
    the parent's score, the parent's count, its entry's `delta`)."""
    ch = first[ref] if k == 0 else top[ref * k]
    j = 0
    while ch >= 0:
        raw = scale * cnt[ch] / occ * damp
        key = min(calibrate(src, depth, mlen, raw, lookup, kx, ky, kn), pprob)
        ent, heap = _push(ent, heap, n_ent, n_heap, key, raw, depth, tok[ch], np.int64(ch), src, at, delta, mlen)
        n_ent += 1
        n_heap += 1
        j += 1
        ch = sib[ch] if k == 0 else (top[ref * k + j] if j < k else -1)
    return ent, heap, n_ent, n_heap


@nb.njit(cache=True)
def fuse_one(
    # input source: the request's count-trie (n_seq = 0 disables it)
    seq, n_seq, itok, icnt, ifirst, isib, hkeys, hvals,
    # output history: a count-trie of earlier requests' outputs (source id history_src; -1 disables it); each of its
    # nodes offers its history_top most frequent children, kept in `htop` (a parent takes at most fanout: after a
    # common token the history holds hundreds of continuations, and walking them all made drafting a 64-request
    # batch 25% slower)
    htok, hcnt, hfirst, hsib, hhkeys, hhvals, htop, history_src, history_top,
    query_len, input_depth, input_scale, delta_base, delta_step,
    # datastore sources: global flat tries, one root per datastore (-1 = nothing retrieved)
    dtok, dcnt, dfirst, dsib, ds_roots, ds_mlen,
    # growth
    budget, fanout,
    # calibration tables (CalibrationMap.tables)
    lookup, kx, ky, kn,
    # outputs, each of length >= budget
    o_tok, o_par, o_prob, o_depth, o_src, o_raw, o_mlen,
):
    """Grow one tree; returns its node count. Node i: o_* [i] (parents-first order)."""
    if budget <= 0:
        return 0
    fan = min(fanout, budget)
    ent = np.empty((64, 9), np.float64)
    heap = np.empty(64, np.int64)
    n_ent = _ZERO
    n_heap = _ZERO
    # ---- seed: children of every matched suffix in the request's own index, then in the output history, then of
    # every datastore root. The query is the newest occurrence in its own index (no continuation), not in the history.
    ent, heap, n_ent, n_heap = _seed_suffixes(
        ent, heap, n_ent, n_heap, seq, n_seq, itok, icnt, ifirst, isib, hkeys, hvals, htop, _ZERO, _ONE, _ZERO,
        query_len, input_scale, delta_base, delta_step, lookup, kx, ky, kn)
    if history_src >= 0:
        ent, heap, n_ent, n_heap = _seed_suffixes(
            ent, heap, n_ent, n_heap, seq, n_seq, htok, hcnt, hfirst, hsib, hhkeys, hhvals, htop, history_top, _ZERO,
            history_src, query_len, input_scale, delta_base, delta_step, lookup, kx, ky, kn)
    for k in range(ds_roots.shape[0]):
        r = ds_roots[k]
        if r < 0 or dcnt[r] <= 0:
            continue
        c = dfirst[r]
        while c >= 0:
            raw = dcnt[c] / dcnt[r]
            key = min(calibrate(1 + k, _ONE, np.int64(ds_mlen[k]), raw, lookup, kx, ky, kn), 1.0)
            ent, heap = _push(ent, heap, n_ent, n_heap, key, raw, _ONE, dtok[c], np.int64(c), 1 + k, _ROOT, 1.0,
                              np.int64(ds_mlen[k]))
            n_ent += 1
            n_heap += 1
            c = dsib[c]
    # ---- best-first growth
    t_first = np.full(budget, -1, np.int32)
    t_sib = np.full(budget, -1, np.int32)
    t_nch = np.zeros(budget, np.int32)
    root_first = -1
    root_nch = 0
    n = 0
    while n_heap > 0 and n < budget:
        e = _pop(ent, heap, n_heap)
        n_heap -= 1
        at = np.int64(ent[e, _AT])
        tok = np.int32(ent[e, _TOK])
        c = root_first if at < 0 else t_first[at]
        while c >= 0 and o_tok[c] != tok:
            c = t_sib[c]
        if c < 0:
            if (root_nch if at < 0 else t_nch[at]) >= fan:
                continue  # the parent is full: this token loses to better-scored siblings
            c = n
            n += 1
            o_tok[c] = tok
            o_par[c] = at
            o_prob[c] = ent[e, _KEY]
            o_depth[c] = np.int32(ent[e, _DEPTH])
            o_src[c] = np.int16(ent[e, _SRC])
            o_raw[c] = ent[e, _RAW]
            o_mlen[c] = np.int32(ent[e, _MLEN])
            if at < 0:
                t_sib[c] = root_first
                root_first = c
                root_nch += 1
            else:
                t_sib[c] = t_first[at]
                t_first[at] = c
                t_nch[at] += 1
        if n >= budget:
            break
        # children of the entry's trie node go under tree node c (new, or reused when sources agree)
        src = np.int64(ent[e, _SRC])
        ref = np.int64(ent[e, _REF])
        raw_p = ent[e, _RAW]
        delta = ent[e, _DELTA]
        mlen = np.int64(ent[e, _MLEN])
        depth = o_depth[c] + 1
        pprob = np.float64(o_prob[c])
        if src == 0 or src == history_src:
            if depth > input_depth:
                continue
            if src == 0:
                ent, heap, n_ent, n_heap = _push_count_children(
                    ent, heap, n_ent, n_heap, itok, icnt, ifirst, isib, htop, _ZERO, ref, raw_p, np.int64(icnt[ref]),
                    delta, delta, mlen, depth, pprob, src, c, lookup, kx, ky, kn)
            else:
                ent, heap, n_ent, n_heap = _push_count_children(
                    ent, heap, n_ent, n_heap, htok, hcnt, hfirst, hsib, htop, history_top, ref, raw_p,
                    np.int64(hcnt[ref]), delta, delta, mlen, depth, pprob, src, c, lookup, kx, ky, kn)
        else:
            ch = dfirst[ref]
            while ch >= 0:
                raw = raw_p * dcnt[ch] / dcnt[ref]
                key = min(calibrate(src, depth, mlen, raw, lookup, kx, ky, kn), pprob)
                ent, heap = _push(ent, heap, n_ent, n_heap, key, raw, depth, dtok[ch], np.int64(ch), src, c, 1.0, mlen)
                n_ent += 1
                n_heap += 1
                ch = dsib[ch]
    return n


def _fuse_rows(slots, n_seq, tables, history_slot, history_src, history_top, query_len, input_depth, input_scale,
               delta_base, delta_step, datastores, P, plen, lengths, samples, threshold, budgets, fanout, lookup, kx,
               ky, kn, o_tok, o_par, o_prob, o_depth, o_src, o_raw, o_mlen, o_n):
    """For every row b of a batch: its datastore lookups (`request_tries`: prefix P[b], branch length lengths[b], 0
    skips them) and `fuse_one` over them, request slot `slots[b]` (its arrays: `tables[slots[b]]`, in
    `_SlotTables.FIELDS` order), output row b of the 2-D `o_*`, node count in `o_n[b]`. `n_seq[b]` = 0 disables the
    input source for that row; `history_slot` (-1: none) is the output history's slot, drafted as source
    `history_src`. Compiled twice below: a `prange` version for large batches and a serial one. A request's lookups
    run on the thread that grows its tree: in their own serial pass before the fusion, they were a batch-16 draft
    call's larger part."""
    hsrc = history_src if history_slot >= 0 else -1
    for b in nb.prange(slots.shape[0]):
        buf, itok, icnt, ifirst, isib, hkeys, hvals, _ = tables[slots[b]]
        # without a history any slot will do: hsrc = -1 leaves it unread
        _, htok, hcnt, hfirst, hsib, hhkeys, hhvals, htop = tables[history_slot if history_slot >= 0 else slots[b]]
        # b as int64: a prange index is unsigned, and a second type would compile the lookups a second time
        dtok, dcnt, dfirst, dsib, ds_roots, ds_mlen, _ = request_tries(datastores, P, plen, lengths, np.int64(b),
                                                                       samples, threshold)
        o_n[b] = fuse_one(
            buf, n_seq[b], itok, icnt, ifirst, isib, hkeys, hvals,
            htok, hcnt, hfirst, hsib, hhkeys, hhvals, htop, hsrc, history_top,
            query_len, input_depth, input_scale, delta_base, delta_step,
            dtok, dcnt, dfirst, dsib, ds_roots, ds_mlen, budgets[b], fanout, lookup, kx, ky, kn,
            o_tok[b], o_par[b], o_prob[b], o_depth[b], o_src[b], o_raw[b], o_mlen[b],
        )


fuse_batch_parallel = nb.njit(parallel=True, cache=True)(_fuse_rows)
fuse_batch_serial = nb.njit(cache=True)(_fuse_rows)
PARALLEL_MIN_BATCH = 16  # below this, waking a second thread costs more than it saves (and it may be busy)


@nb.njit(cache=True)
def draft_batch(slots, budgets, tables, n_all, use_input, history_slot, history_src, history_top, query_len,
                input_depth, input_scale, delta_base, delta_step, datastores, use_datastores, samples, threshold,
                branch_len, fanout, lookup, kx, ky, kn):
    """A whole batch's draft trees in one compiled call: each request's last `query_len` tokens (its slot's
    `tables[s][0][:n_all[s]]`) are looked up in every datastore (`request_tries`, unless `use_datastores` is off;
    branch length `branch_len`, or SSSD's schedule by budget where it is 0), and `fuse_one` grows its tree from those
    tries, its own index (`use_input`) and the output history (`_fuse_rows`: both per request, in parallel from
    `PARALLEL_MIN_BATCH` requests). One call, not one per stage with array glue between
    them: after a verify step has left the caches cold, each Python-level operation of the glue cost ~5-20 us (a
    batch-1 draft took ~500 us, ~150 us hot). Returns the [B, max budget] node arrays of `fuse_one` (row b's first
    `n[b]` entries) and `n`."""
    B = slots.shape[0]
    P = np.zeros((B, query_len), np.int64)
    plen = np.zeros(B, np.int64)
    n_seq = np.zeros(B, np.int64)
    lengths = np.zeros(B, np.int32)
    cap = 1
    for b in range(B):
        n = n_all[slots[b]]
        buf = tables[slots[b]][0]
        plen[b] = min(query_len, n)
        for j in range(plen[b]):
            P[b, query_len - plen[b] + j] = buf[n - plen[b] + j]
        if use_input:
            n_seq[b] = n
        if use_datastores and budgets[b] > 0:
            lengths[b] = branch_len if branch_len > 0 else sssd_branch_length(budgets[b])
        cap = max(cap, budgets[b])
    o_tok = np.empty((B, cap), np.int32)
    o_par = np.empty((B, cap), np.int32)
    o_prob = np.empty((B, cap), np.float32)
    o_depth = np.empty((B, cap), np.int32)
    o_src = np.empty((B, cap), np.int16)
    o_raw = np.empty((B, cap), np.float32)
    o_mlen = np.empty((B, cap), np.int32)
    o_n = np.zeros(B, np.int64)
    if B >= PARALLEL_MIN_BATCH:
        fuse_batch_parallel(slots, n_seq, tables, history_slot, history_src, history_top, query_len, input_depth,
                            input_scale, delta_base, delta_step, datastores, P, plen, lengths, samples, threshold,
                            budgets, fanout, lookup, kx, ky, kn, o_tok, o_par, o_prob, o_depth, o_src, o_raw, o_mlen,
                            o_n)
    else:
        fuse_batch_serial(slots, n_seq, tables, history_slot, history_src, history_top, query_len, input_depth,
                          input_scale, delta_base, delta_step, datastores, P, plen, lengths, samples, threshold,
                          budgets, fanout, lookup, kx, ky, kn, o_tok, o_par, o_prob, o_depth, o_src, o_raw, o_mlen,
                          o_n)
    return o_tok, o_par, o_prob, o_depth, o_src, o_raw, o_mlen, o_n
