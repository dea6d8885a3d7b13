"""Drafter: datastore back-off/merge, fusion (SSSD Algorithm 1) against Python references, tree invariants, errors."""

from __future__ import annotations

import heapq
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from datastore import Datastore, build_from_token_docs
from drafter.calibration import CalibrationMap
from drafter.datastore_source import DatastoreSource, sssd_branch_length
from drafter.drafter import Drafter, DrafterConfig
from drafter.tree import SOURCE_DATASTORE, SOURCE_INPUT

VOCAB = 12  # tokens 10, 11 never occur in the datastore


def markov_docs(seed: int, n_docs: int, length: int, states: int = 8) -> list[np.ndarray]:
    """Documents from a skewed random Markov chain, so continuations have uneven counts (and ties)."""
    rng = np.random.default_rng(seed)
    trans = rng.dirichlet(np.full(states, 0.4), size=states)
    docs = []
    for _ in range(n_docs):
        x = [int(rng.integers(states))]
        for _ in range(int(rng.integers(length // 2, length))):
            x.append(int(rng.choice(states, p=trans[x[-1]])))
        docs.append(np.array(x, np.int32))
    return docs


@pytest.fixture(scope="module")
def docs():
    return markov_docs(0, 60, 80)


@pytest.fixture(scope="module")
def ds(tmp_path_factory, docs):
    return Datastore.open(build_from_token_docs(docs, tmp_path_factory.mktemp("ds") / "a", vocab_size=VOCAB))


@pytest.fixture(scope="module")
def ds2(tmp_path_factory):
    # in shards, unlike `ds`: a drafter's datastores of different shard counts run as one type (`kernel_datastores`)
    path = build_from_token_docs(markov_docs(1, 30, 60), tmp_path_factory.mktemp("ds") / "b", vocab_size=VOCAB,
                                 max_shard_tokens=700)
    opened = Datastore.open(path)
    assert len(opened.kernel_arrays()[0]) > 1
    return opened


# ---------------------------------------------------------------- references
def add_row(counts: dict, row) -> bool:
    if len(row) == 0 or row[0] < 0:
        return False
    counts[()] = counts.get((), 0) + 1
    for d in range(len(row)):
        if row[d] < 0:
            break
        counts[tuple(row[: d + 1])] = counts.get(tuple(row[: d + 1]), 0) + 1
    return True


def brute_backoff(docs, prefix, *, q, L, threshold):
    """All continuations (no sampling) of the last q..1 tokens, SSSD back-off, counted straight from the documents."""
    p = [int(t) for t in prefix[-q:]]
    counts: dict = {}
    mlen = 0
    for c in range(len(p), 0, -1):
        sub = p[len(p) - c :]
        hit = False
        for d in docs:
            d = d.tolist()
            for i in range(len(d) - c + 1):
                if d[i : i + c] == sub:
                    row = d[i + c : i + c + L] + [-1] * (L - len(d[i + c : i + c + L]))
                    hit |= add_row(counts, row)
        if hit and not mlen:
            mlen = c
        if counts.get((), 0) >= threshold or c == 1:
            break
    return counts, mlen


def sampled_backoff(ds, prefix, *, q, K, L, threshold):
    """The same back-off, through single `continuations` calls (sampling is the datastore's)."""
    p = np.asarray(prefix[-q:])
    counts: dict = {}
    mlen = 0
    for c in range(len(p), 0, -1):
        hit = False
        for row in ds.continuations(p[len(p) - c :], K, L).tolist():
            hit |= add_row(counts, row)
        if hit and not mlen:
            mlen = c
        if counts.get((), 0) >= threshold or c == 1:
            break
    return counts, mlen


def input_matches(seq, q, L):
    """Brute force of the input source: {m: (earlier occurrences, {path: count})}."""
    n = len(seq)
    out = {}
    for m in range(min(q, n), 0, -1):
        counts, occ = {}, 0
        for s in range(n - m):
            if seq[s : s + m] == seq[n - m :]:
                occ += 1
                cont = seq[s + m : s + m + L]
                for d in range(1, len(cont) + 1):
                    counts[tuple(cont[:d])] = counts.get(tuple(cont[:d]), 0) + 1
        if occ:
            out[m] = (occ, counts)
    return out


def history_matches(outputs, seq, q, L):
    """Brute force of the output history: {m: (occurrences in earlier outputs, {path: count})}; no n-gram crosses
    from one output into the next, and the query itself is not an occurrence."""
    out = {}
    for m in range(min(q, len(seq)), 0, -1):
        counts, occ = {}, 0
        for o in outputs:
            o = [int(t) for t in o]
            for s in range(len(o) - m + 1):
                if o[s : s + m] == list(seq[len(seq) - m :]):
                    occ += 1
                    cont = o[s + m : s + m + L]
                    for d in range(1, len(cont) + 1):
                        counts[tuple(cont[:d])] = counts.get(tuple(cont[:d]), 0) + 1
        if occ and counts:
            out[m] = (occ, counts)
    return out


def reference_fusion(seq, ds_tries, cfg: DrafterConfig, budget: int, *, use_input=True, history=(), history_src=None):
    """SSSD Algorithm 1 in plain Python over dict tries, with the kernel's documented tie order. `history`: earlier
    requests' outputs, drafted as source `history_src` like the input source."""
    if budget == 0:
        return []
    fan = min(cfg.fanout, budget)
    heap, counter = [], [0]

    def push(key, raw, depth, tok, src, mlen, at, ref, delta):
        heapq.heappush(heap, (-key, -depth, tok, src, -mlen, at, counter[0], raw, ref, delta))
        counter[0] += 1

    def children(counts, path, top=None):
        kids = [p[-1] for p in counts if len(p) == len(path) + 1 and p[:-1] == path]
        if top is not None:  # the output history offers a node's `top` most frequent children (ties: lower token)
            kids = sorted(kids, key=lambda t: (-counts[path + (t,)], t))[:top]
        return kids

    inp = input_matches(seq, cfg.query_len, cfg.input_depth) if use_input else {}
    hist = history_matches(history, seq, cfg.query_len, cfg.input_depth) if use_input else {}
    for kind, src, matches in (("in", 0, inp), ("hist", history_src, hist)):
        for m, (occ, counts) in matches.items():
            for t in children(counts, (), None if kind == "in" else cfg.fanout):
                raw = cfg.input_scale * counts[(t,)] / occ
                delta = cfg.delta_base + cfg.delta_step * m
                push(min(max(raw, 0.0), 1.0), raw, 1, t, src, m, -1, (kind, m, (t,)), delta)
    for k, (counts, mlen) in enumerate(ds_tries):
        if counts.get((), 0) > 0:
            for t in children(counts, ()):
                raw = counts[(t,)] / counts[()]
                push(min(max(raw, 0.0), 1.0), raw, 1, t, 1 + k, mlen, -1, ("ds", k, (t,)), 1.0)
    nodes = []  # (tok, parent, prob32, depth, src)
    kids: dict[int, dict[int, int]] = {}
    while heap and len(nodes) < budget:
        negkey, negd, tok, src, negm, at, _, raw, ref, delta = heapq.heappop(heap)
        sib = kids.setdefault(at, {})
        if tok in sib:
            c = sib[tok]
        elif len(sib) >= fan:
            continue
        else:
            c = len(nodes)
            nodes.append((tok, at, float(np.float32(-negkey)), -negd, src))
            sib[tok] = c
        if len(nodes) >= budget:
            break
        depth, pprob = nodes[c][3] + 1, nodes[c][2]
        kind, which, path = ref
        if kind in ("in", "hist"):
            if depth > cfg.input_depth:
                continue
            occ, counts = (inp if kind == "in" else hist)[which]
            for t in children(counts, path, None if kind == "in" else cfg.fanout):
                r = raw * counts[path + (t,)] / counts[path] * delta
                push(min(min(max(r, 0.0), 1.0), pprob), r, depth, t, src, -negm, c, (kind, which, path + (t,)), delta)
        else:
            counts = ds_tries[which][0]
            for t in children(counts, path):
                r = raw * counts[path + (t,)] / counts[path]
                push(min(min(max(r, 0.0), 1.0), pprob), r, depth, t, src, -negm, c, ("ds", which, path + (t,)), 1.0)
    return nodes


def tree_rows(tree):
    return [(int(t), int(p), float(pr), int(d), int(s))
            for t, p, pr, d, s in zip(tree.tokens, tree.parents, tree.probs, tree.depth, tree.source)]


def check_tree(tree, budget, fanout, vocab=VOCAB):
    tree.validate(vocab)
    assert len(tree) <= budget
    par = tree.parents
    assert np.all(par < np.arange(len(tree)))  # parents first
    ok = np.where(par < 0, tree.probs <= 1.0, tree.probs <= tree.probs[np.maximum(par, 0)])
    assert ok.all(), "probabilities must not increase along a path"
    assert np.all(tree.probs > 0)
    for p in np.unique(par):
        sib = tree.tokens[par == p]
        assert sib.size <= min(fanout, budget) and np.unique(sib).size == sib.size


# ---------------------------------------------------------------- datastore source
@pytest.mark.parametrize("threshold", [1, 50, 10**9])
def test_backoff_merge_matches_brute_force_count(ds, docs, threshold):
    rng = np.random.default_rng(threshold % 97)
    prefixes = [rng.integers(0, 8, int(rng.integers(1, 7))) for _ in range(40)] + [np.array([10, 11, 3]),
                                                                                 np.array([], np.int64)]
    lengths = rng.integers(1, 6, len(prefixes)).astype(np.int32)
    src = DatastoreSource([ds], query_len=4, samples=10**6, threshold=threshold)
    cand = src.lookup(prefixes, lengths)
    for b, p in enumerate(prefixes):
        want, mlen = brute_backoff(docs, list(p), q=4, L=int(lengths[b]), threshold=threshold) if len(p) else ({}, 0)
        assert cand.counts(b, 0) == want, (b, p)
        assert cand.match_len[b, 0] == mlen


def test_backoff_over_two_datastores_laid_end_to_end_matches_brute_force(ds, ds2, docs):
    """`lookup_tries` lays each request's tries (`request_tries`) end to end: every request's root in every datastore
    still leads to exactly its own counts (links moved with their block), the sharded one included."""
    rng = np.random.default_rng(11)
    prefixes = [rng.integers(0, 8, int(rng.integers(1, 7))) for _ in range(25)] + [np.array([], np.int64)]
    lengths = rng.integers(0, 6, len(prefixes)).astype(np.int32)  # 0: the request is skipped
    cand = DatastoreSource([ds, ds2], query_len=4, samples=10**6, threshold=50).lookup(prefixes, lengths)
    for b, p in enumerate(prefixes):
        for k, d in enumerate((docs, markov_docs(1, 30, 60))):
            if len(p) and lengths[b]:
                want, mlen = brute_backoff(d, list(p), q=4, L=int(lengths[b]), threshold=50)
            else:
                want, mlen = {}, 0
            assert cand.counts(b, k) == want, (b, k, p)
            assert cand.match_len[b, k] == mlen


def test_sampled_backoff_matches_single_lookups(ds):
    rng = np.random.default_rng(7)
    prefixes = [rng.integers(0, 8, 4) for _ in range(30)] + [np.array([2]), np.array([10, 2])]
    src = DatastoreSource([ds], query_len=4, samples=100, threshold=50)
    cand = src.lookup(prefixes, np.full(len(prefixes), 6, np.int32))
    for b, p in enumerate(prefixes):
        want, mlen = sampled_backoff(ds, p, q=4, K=100, L=6, threshold=50)
        assert cand.counts(b, 0) == want
        assert cand.match_len[b, 0] == mlen
        assert want.get((), 0) <= 100 * cand.rounds[b, 0]


def test_sssd_branch_schedule():
    assert [sssd_branch_length(b) for b in (1, 2, 4, 5, 7, 31, 32, 47, 48, 63)] == [1, 2, 4, 5, 5, 6, 8, 8, 10, 10]


# ---------------------------------------------------------------- fusion vs reference
@pytest.mark.parametrize("sources", ["fused", "input", "datastore"])
@pytest.mark.parametrize("fanout", [1, 2, 5])
def test_fusion_equals_reference(ds, ds2, docs, sources, fanout):
    docs2 = markov_docs(1, 30, 60)
    cfg = DrafterConfig(sources=sources, fanout=fanout, datastore_samples=10**6, input_depth=5)
    dr = Drafter(cfg, datastores=[ds, ds2], calibration=CalibrationMap.identity())
    rng = np.random.default_rng(fanout)
    history = []  # finished requests: their outputs (never their prompts) are the output history
    for i in range(6):
        prompt, output = rng.integers(0, 8, 12), rng.integers(0, 9, int(rng.integers(1, 40)))
        dr.start_request(f"done{i}", prompt)
        dr.extend(f"done{i}", output)
        dr.stop_request(f"done{i}")
        history.append(output)
    batch, seqs = [], {}
    for i in range(20):  # above PARALLEL_MIN_BATCH: the parallel kernel is checked against the reference too
        base = rng.integers(0, 8, 12)
        seq = np.concatenate([base, rng.integers(0, 9, 20), base[: int(rng.integers(1, 8))]]).tolist()
        dr.start_request(i, seq[:10])
        dr.extend(i, seq[10:])
        seqs[i] = seq
        batch.append((i, int(rng.choice([0, 1, 2, 3, 8, 17, 32, 64]))))
    results = dr.draft_detailed(batch)
    for (rid, budget), res in zip(batch, results):
        seq = seqs[rid]
        tries = []
        if sources != "input":
            L = sssd_branch_length(budget)
            tries = [brute_backoff(d, seq, q=4, L=L, threshold=50) for d in (docs, docs2)]
        want = reference_fusion(seq, tries, cfg, budget, use_input=sources != "datastore", history=history,
                                history_src=dr.history_source)
        assert tree_rows(res.tree) == want
        check_tree(res.tree, budget, fanout)
        if sources == "input":
            assert set(res.tree.source.tolist()) <= {SOURCE_INPUT, dr.history_source}
        if sources == "datastore":
            assert np.all(res.tree.source >= SOURCE_DATASTORE)
    from_history = sum(int(np.sum(r.tree.source == dr.history_source)) for r in results)
    assert (from_history > 0) == (sources != "datastore")  # the history is drafted, except by datastore-only drafts


_FRESH_DRAFTER = textwrap.dedent("""
    import json, sys
    import numpy as np
    from numba.core.registry import CPUDispatcher
    from datastore import Datastore, kernels as datastore_kernels
    from drafter import calibration, datastore_source, fusion, input_index
    from drafter.drafter import Drafter, DrafterConfig

    modules = (fusion, input_index, datastore_source, calibration, datastore_kernels)
    dispatchers = {f"{m.__name__}.{name}": f for m in modules for name, f in vars(m).items()
                   if isinstance(f, CPUDispatcher)}
    compiled = lambda: {name: len(f.signatures) for name, f in dispatchers.items() if f.signatures}
    drafter = Drafter(DrafterConfig(), datastores=[Datastore.open(sys.argv[1])])
    built = compiled()
    rng = np.random.default_rng(0)
    for i in range(3):  # finished requests: an output history
        drafter.start_request(f"done{i}", rng.integers(0, 8, 12))
        drafter.extend(f"done{i}", rng.integers(0, 9, 30))
        drafter.stop_request(f"done{i}")
    for n in (2, 20):  # the serial kernel, then the parallel one; every source drafts
        for i in range(n):
            drafter.start_request((n, i), rng.integers(0, 8, 40))
        trees = drafter.draft([((n, i), 32) for i in range(n)])
        assert sum(len(t) for t in trees) > 0
    print(json.dumps({"built": built, "drafted": compiled()}))
""")


def test_a_fresh_drafter_compiles_each_fusion_helper_once_and_drafting_compiles_nothing_more(ds, tmp_path):
    # numba compiles a jitted function once per tuple of argument types, and a constant argument has a type of its
    # own (Literal[int](1)): constant call sites once made 8 copies of `_push` (a fresh install's first Drafter
    # compiled for 41 s). In a process with an empty numba cache, building a Drafter (its warm-up) compiles every
    # fusion helper once, and drafting afterwards, serial and parallel, from every source, compiles nothing new.
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", _FRESH_DRAFTER, str(ds.path)], env=env, capture_output=True,
                          text=True, cwd=Path(__file__).resolve().parents[1], timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    helpers = ("fuse_one", "_seed_suffixes", "_push_count_children", "_push", "_pop", "calibrate")
    assert {h: result["built"].get(f"drafter.fusion.{h}") for h in helpers} == {h: 1 for h in helpers}
    assert result["drafted"] == result["built"]


def test_trees_valid_deterministic_and_budgeted(ds, ds2):
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 10, int(rng.integers(1, 200))) for _ in range(40)]
    batch = [(i, int(rng.integers(0, 65))) for i in range(40)]
    out = []
    for _ in range(2):
        dr = Drafter(DrafterConfig(), datastores=[ds, ds2])
        for i, p in enumerate(prompts):
            dr.start_request(i, p)
        out.append(dr.draft(batch))
        out.append(dr.draft(batch))  # drafting has no side effects
    for trees in out[1:]:
        for a, b in zip(out[0], trees):
            assert tree_rows(a) == tree_rows(b)
    for (rid, budget), tree in zip(batch, out[0]):
        check_tree(tree, budget, 5)
        assert tree_rows(dr.draft([(rid, budget)])[0]) == tree_rows(tree)  # alone (serial) == in a batch (parallel)
    assert sum(len(t) for t in out[0]) > 0
    assert {int(s) for t in out[0] for s in t.source} == {0, 1, 2}


def test_requests_that_come_and_go_keep_their_own_index(ds):
    """Slots of stopped requests are reused; a request whose index grows (reallocates) is still read correctly.
    (Without an output history: the stopped requests' outputs would otherwise be drafted, and the reference has
    none.)"""
    rng = np.random.default_rng(11)
    dr = Drafter(DrafterConfig(history_tokens=0), datastores=[ds])
    reference = Drafter(DrafterConfig(history_tokens=0), datastores=[ds])
    live: dict[int, list[int]] = {}
    for step in range(60):
        rid = int(rng.integers(0, 24))
        if rid in live and rng.random() < 0.3:
            dr.stop_request(rid)
            del live[rid]
        elif rid in live:
            more = rng.integers(0, 10, int(rng.integers(1, 300))).tolist()  # sometimes enough to reallocate
            dr.extend(rid, more)
            live[rid] += more
        else:
            live[rid] = rng.integers(0, 10, int(rng.integers(1, 50))).tolist()
            dr.start_request(rid, live[rid])
    batch = [(rid, 16) for rid in live]
    assert len(batch) >= 8
    for rid, seq in live.items():
        reference.start_request(rid, seq)
    got, want = dr.draft(batch), reference.draft(batch)
    assert [tree_rows(t) for t in got] == [tree_rows(t) for t in want]


def test_no_match_gives_empty_tree(ds):
    dr = Drafter(DrafterConfig(), datastores=[ds])
    dr.start_request("x", [10, 11])  # never in the datastore, no repeats in the input
    dr.start_request("e", [])
    dr.start_request("y", [1, 2, 3])
    trees = dr.draft([("x", 32), ("e", 8), ("y", 0)])
    assert [len(t) for t in trees] == [0, 0, 0]
    dr.extend("x", [10, 11])  # now the input repeats: "10 11" -> "10 11"
    assert tree_rows(dr.draft([("x", 4)])[0])[0][0] == 10


def test_calibration_is_applied_and_loaded_by_default(tmp_path, docs):
    path = build_from_token_docs(docs, tmp_path / "cal", vocab_size=VOCAB)
    rng = np.random.default_rng(0)
    n = 20000
    s = rng.uniform(0, 1, n)
    rec = {"source": rng.integers(0, 2, n), "depth": rng.integers(1, 4, n), "match_len": rng.integers(1, 5, n),
           "score": s, "accepted": rng.uniform(0, 1, n) < 0.2 + 0.5 * s}
    cal = CalibrationMap.fit(rec)
    cal.to_json(path / "calibration.json")
    dr = Drafter(DrafterConfig(), datastores=[Datastore.open(path)])
    assert set(dr.calibration.curves) == set(cal.curves)
    dr.start_request("r", docs[0][:30])
    res = dr.draft_detailed([("r", 32)])[0]
    t = res.tree
    assert len(t) > 0
    want = cal.apply(source=t.source, depth=t.depth, match_len=res.match_len, score=res.raw_score)
    for i in range(len(t)):  # calibrated, then capped by the parent's probability
        cap = 1.0 if t.parents[i] < 0 else t.probs[t.parents[i]]
        assert t.probs[i] == pytest.approx(min(want[i], cap), abs=1e-6)
    check_tree(t, 32, 5)


# ---------------------------------------------------------------- errors
def test_bad_input_errors(ds):
    dr = Drafter(DrafterConfig(max_budget=64), datastores=[ds])
    dr.start_request("a", [1, 2, 3, 1, 2])
    before = tree_rows(dr.draft([("a", 8)])[0])
    cases = [
        (lambda: dr.draft([("nope", 4)]), "unknown request id 'nope'"),
        (lambda: dr.draft([("a", -1)]), "must be >= 0"),
        (lambda: dr.draft([("a", 65)]), "max_budget"),
        (lambda: dr.draft([("a", 2.5)]), "must be an int"),
        (lambda: dr.draft([("a", 2), ("a", 3)]), "appears twice"),
        (lambda: dr.draft(["a"]), "pairs"),
        (lambda: dr.start_request("b", [1, VOCAB]), f"token id {VOCAB} outside the vocabulary"),
        (lambda: dr.extend("a", [VOCAB + 5]), "outside the vocabulary"),
        (lambda: dr.extend("nope", [1]), "unknown request id"),
        (lambda: dr.start_request("a", [1]), "already active"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()
    assert set(dr.active_requests) == {"a"}
    assert tree_rows(dr.draft([("a", 8)])[0]) == before
    with pytest.raises(ValueError, match="needs at least one datastore"):
        Drafter(DrafterConfig())
    with pytest.raises(ValueError, match="sources must be one of"):
        DrafterConfig(sources="both")
    with pytest.raises(ValueError, match="differs from the datastores"):
        Drafter(DrafterConfig(), datastores=[ds], vocab_size=VOCAB + 1)


def test_output_history_drafts_earlier_outputs_never_prompts_nor_across_outputs():
    dr = Drafter(DrafterConfig(sources="input"), vocab_size=60)
    finished = (("a", [1, 2, 3], [10, 11, 12, 13, 14, 15]), ("c", [4], [30, 31, 32]), ("d", [5], [40, 41]))
    for rid, prompt, output in finished:
        dr.start_request(rid, prompt)
        dr.extend(rid, output)
        dr.stop_request(rid)

    def draft(prompt, budget=4):
        dr.start_request("q", prompt)
        try:
            return dr.draft([("q", budget)])[0]
        finally:
            dr.stop_request("q")  # no output: adds nothing to the history

    tree = draft([20, 21, 10, 11])  # the last tokens occur only in request a's output
    assert tree.tokens.tolist() == [12, 13, 14, 15] and tree.parents.tolist() == [-1, 0, 1, 2]
    assert np.all(tree.source == dr.history_source)
    assert 40 not in draft([50, 31, 32]).tokens.tolist()  # c's output ends there; d's output is not its continuation
    assert len(draft([50, 1, 2])) == 0  # a's prompt is not remembered
    dr.clear_history()
    assert len(draft([20, 21, 10, 11])) == 0
    off = Drafter(DrafterConfig(sources="input", history_tokens=0), vocab_size=60)
    off.start_request("a", [1])
    off.extend("a", [10, 11, 12])
    off.stop_request("a")
    off.start_request("q", [10, 11])
    assert len(off.draft([("q", 4)])[0]) == 0
    with pytest.raises(ValueError, match="history_tokens"):
        DrafterConfig(history_tokens=-1)
