"""Datastore benchmark: build phases, size on disk and query latency, side by side with `draftretriever`.

Corpora (full run): the CPython standard library source and chitchat-dataset (train split, chat-rendered), both
tokenized with the default tokenizer, and a synthetic 50M-token corpus (Zipf-distributed ids, vocab 49,152).
For each: build seconds by phase (tokenize / suffix array / write), suffix-array tokens/s, peak RSS of the build
(measured in a child process), bytes per token on disk; `count` and `continuations(k=100, length=8)` latency p50/p99
per prefix, single calls and batches of 64 (prefixes of 1-4 tokens taken from the corpus). `draftretriever` (PyPI;
REST-style u16 tokens + i32 suffix array) builds on the same tokens: build seconds, bytes per token, search latency.

    python benchmarks/datastore.py            # full run → benchmarks/results/datastore.json + .md
    python benchmarks/datastore.py --quick    # <= 90 s on the default datastore → datastore_quick.json + .md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.results_files import RESULTS, write_results_json  # noqa: E402 - after the path (run as a script)

GOALS = {"bytes_per_token": 6.0, "sa_build_tokens_per_s": 3e6, "query_p50_us_batch64": 10.0,
         "continuations_p50_us_batch64": 30.0}


# ------------------------------------------------------------------ build workers (run in child processes)
def _save_docs(path: Path, docs: list[np.ndarray]) -> None:
    offsets = np.zeros(len(docs) + 1, dtype=np.int64)
    np.cumsum([d.size for d in docs], out=offsets[1:])
    np.savez(path, flat=np.concatenate(docs).astype(np.int32), offsets=offsets)


def _load_docs(path: Path) -> list[np.ndarray]:
    z = np.load(path)
    flat, offsets = z["flat"], z["offsets"]
    return [flat[offsets[i] : offsets[i + 1]] for i in range(offsets.size - 1)]


def worker_tokenize(corpus: str, docs_file: Path) -> dict:
    from datastore.corpora import chitchat_conversations, stdlib_sources
    from datastore.tokenizer import LoadedTokenizer

    tok = LoadedTokenizer.load("default")
    t0 = time.perf_counter()
    if corpus == "stdlib":
        texts = [p.read_bytes().decode("utf-8", errors="replace") for p in stdlib_sources()]
    else:
        texts = [tok.render_chat(m, cid) for cid, m in chitchat_conversations("train")]
    t1 = time.perf_counter()
    docs = list(tok.encode_stream(texts))
    t2 = time.perf_counter()
    _save_docs(docs_file, docs)
    return {"read_s": t1 - t0, "tokenize_s": t2 - t1, "vocab_size": tok.identity.vocab_size}


def worker_build(docs_file: Path, out: Path, vocab_size: int) -> dict:
    from datastore.build import BuildStats, TokenizerIdentity, build_datastore

    docs = _load_docs(docs_file)
    stats = BuildStats()
    t0 = time.perf_counter()
    build_datastore(docs, out, tokenizer=TokenizerIdentity("bench", "bench", vocab_size), stats=stats, overwrite=True)
    return {"total_s": time.perf_counter() - t0, "suffix_array_s": stats.seconds["suffix_array"],
            "write_s": stats.seconds["write"], "tokens": stats.tokens, "documents": stats.documents,
            "bytes": stats.bytes_written}


def worker_draftretriever(docs_file: Path, out: Path, vocab_size: int) -> dict:
    import draftretriever

    docs = _load_docs(docs_file)
    t0 = time.perf_counter()
    w = draftretriever.Writer(str(out), vocab_size=vocab_size)
    for d in docs:
        w.add_entry(d.tolist())
    w.finalize()
    return {"total_s": time.perf_counter() - t0, "bytes": out.stat().st_size}


def _child(kind: str, *args: str) -> dict:
    """Run a worker in a fresh interpreter; its own peak RSS comes back with its result."""
    r = subprocess.run([sys.executable, __file__, "--worker", kind, *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"worker {kind} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------ query latency (in this process)
def _prefixes(ds, n: int, seed: int) -> list[np.ndarray]:
    """n prefixes of 1-4 tokens copied from random positions of the first shard (not crossing a separator)."""
    from datastore.encoding import TokenEncoding

    rng = np.random.default_rng(seed)
    enc = TokenEncoding.for_vocab(ds.vocab_size)
    tokens = ds._tokens[0]
    out: list[np.ndarray] = []
    while len(out) < n:
        i, m = int(rng.integers(0, tokens.shape[0] - 4)), int(rng.integers(1, 5))
        p = enc.decode(tokens[i : i + m])
        if (p != enc.separator).all():
            out.append(p)
    return out


def _pct(xs: list[float]) -> dict:
    a = np.asarray(xs)
    return {"p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99))}


def measure_queries(ds, *, n_single: int, n_batches: int, seed: int = 0) -> dict:
    prefixes = _prefixes(ds, max(n_single, 64 * n_batches), seed)
    ds.count_batch(prefixes[:64]), ds.continuations_batch(prefixes[:64], 100, 8)  # JIT warm-up
    ds.count(prefixes[0]), ds.continuations(prefixes[0], 100, 8)
    res: dict = {}
    for name, fn in (("count", lambda p: ds.count(p)), ("continuations", lambda p: ds.continuations(p, 100, 8))):
        lat = []
        for p in prefixes[:n_single]:
            t0 = time.perf_counter_ns()
            fn(p)
            lat.append((time.perf_counter_ns() - t0) / 1e3)
        res[f"{name}_single_us"] = _pct(lat)
    for name, fn in (("count", lambda b: ds.count_batch(b)),
                     ("continuations", lambda b: ds.continuations_batch(b, 100, 8))):
        lat = []
        for j in range(n_batches):
            batch = prefixes[64 * j : 64 * (j + 1)]
            t0 = time.perf_counter_ns()
            fn(batch)
            lat.append((time.perf_counter_ns() - t0) / 1e3 / 64)
        res[f"{name}_batch64_us_per_prefix"] = _pct(lat)
    res["mean_count"] = float(np.mean(ds.count_batch(prefixes[:n_single])))
    return res


def measure_draftretriever(index: Path, prefixes: list[np.ndarray], n: int) -> dict:
    import draftretriever

    r = draftretriever.Reader(str(index))
    lat = []
    for p in [p for p in prefixes if p.size >= 2][:n]:  # its search panics on 1-token queries
        q = p.tolist()
        t0 = time.perf_counter_ns()
        r.search(q, choices=100)
        lat.append((time.perf_counter_ns() - t0) / 1e3)
    return {"search_single_us": _pct(lat)}


# ------------------------------------------------------------------ one corpus end to end
def bench_corpus(name: str, docs_file: Path, vocab: int, work: Path, *, tokenize: dict | None, n_single: int,
                 n_batches: int, with_draftretriever: bool) -> dict:
    from datastore import Datastore

    build = _child("build", str(docs_file), str(work / f"{name}.ds"), str(vocab))
    ds = Datastore.open(work / f"{name}.ds")
    row: dict = {"corpus": name, "tokens": build["tokens"], "documents": build["documents"],
                 "bytes_per_token": ds.bytes_on_disk / ds.num_tokens,
                 "build_s": {"read": (tokenize or {}).get("read_s", 0.0), "tokenize": (tokenize or {}).get(
                     "tokenize_s", 0.0), "suffix_array": build["suffix_array_s"], "write": build["write_s"],
                     "total_build": build["total_s"]},
                 "sa_build_tokens_per_s": build["tokens"] / build["suffix_array_s"],
                 "build_tokens_per_s": build["tokens"] / build["total_s"],
                 "build_peak_rss_mb": build["peak_rss_mb"],
                 "queries": measure_queries(ds, n_single=n_single, n_batches=n_batches)}
    if with_draftretriever:
        dr = _child("draftretriever", str(docs_file), str(work / f"{name}.dr"), str(vocab))
        row["draftretriever"] = {"build_s": dr["total_s"], "bytes_per_token": dr["bytes"] / build["tokens"],
                                 "peak_rss_mb": dr["peak_rss_mb"],
                                 **measure_draftretriever(work / f"{name}.dr", _prefixes(ds, n_single, 1), n_single)}
    (work / f"{name}.dr").unlink(missing_ok=True)
    return row


def synthetic_docs(n_tokens: int, vocab: int, seed: int = 0) -> list[np.ndarray]:
    """Zipf(1.2)-distributed ids (a crude stand-in for text statistics), documents of 200-2000 tokens."""
    rng = np.random.default_rng(seed)
    flat = (rng.zipf(1.2, size=n_tokens) - 1) % vocab
    cuts = np.cumsum(rng.integers(200, 2000, size=n_tokens // 200))
    cuts = cuts[cuts < n_tokens]
    return np.split(flat.astype(np.int32), cuts)


# ------------------------------------------------------------------ report
def summarize(rows: list[dict], ref: str) -> dict:
    r = next(x for x in rows if x["corpus"] == ref)
    q = r["queries"]
    s = {"reference_corpus": ref, "bytes_per_token": r["bytes_per_token"],
         "sa_build_tokens_per_s": r["sa_build_tokens_per_s"],
         "query_p50_us_batch64": q["count_batch64_us_per_prefix"]["p50"],
         "continuations_p50_us_batch64": q["continuations_batch64_us_per_prefix"]["p50"],
         "query_p50_us_single": q["count_single_us"]["p50"],
         "continuations_p50_us_single": q["continuations_single_us"]["p50"]}
    if "draftretriever" in r:
        s["draftretriever_bytes_per_token"] = r["draftretriever"]["bytes_per_token"]
        s["draftretriever_build_s"] = r["draftretriever"]["build_s"]
        s["build_s_ours_suffix_array_plus_write"] = r["build_s"]["suffix_array"] + r["build_s"]["write"]
    s["goals"] = {k: {"goal": v, "value": s[k], "met": s[k] <= v if k != "sa_build_tokens_per_s" else s[k] >= v}
                  for k, v in GOALS.items()}
    return s


def markdown(rows: list[dict], summary: dict, meta: dict) -> str:
    lines = [f"# Datastore benchmark ({meta['mode']})", "",
             f"Machine: {meta['machine']}, {meta['cpus']} CPU(s), Python {meta['python']}. "
             "Latencies are per prefix (batch rows: batch time / 64); k=100, length=8 for continuations.", "",
             "| corpus | tokens | docs | bytes/token | tokenize s | SA s | write s | SA tok/s | peak RSS MB "
             "| count p50/p99 µs (single) | count p50/p99 µs (b64) | cont. p50/p99 µs (single) "
             "| cont. p50/p99 µs (b64) | mean count |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        q, b = r["queries"], r["build_s"]
        f = lambda d: f"{d['p50']:.1f} / {d['p99']:.1f}"  # noqa: E731
        lines.append(f"| {r['corpus']} | {r['tokens']:,} | {r['documents']:,} | {r['bytes_per_token']:.3f} | "
                     f"{b['tokenize']:.1f} | {b['suffix_array']:.2f} | {b['write']:.2f} | "
                     f"{r['sa_build_tokens_per_s'] / 1e6:.2f}M | {r['build_peak_rss_mb']:.0f} | "
                     f"{f(q['count_single_us'])} | {f(q['count_batch64_us_per_prefix'])} | "
                     f"{f(q['continuations_single_us'])} | {f(q['continuations_batch64_us_per_prefix'])} | "
                     f"{q['mean_count']:.0f} |")
    dr = [r for r in rows if "draftretriever" in r]
    if dr:
        lines += ["", "Side by side with `draftretriever` 0.1.1 (same tokens):", "",
                  "| corpus | ours: SA+write s | ours bytes/token | draftretriever build s | draftretriever bytes/token "
                  "| draftretriever peak RSS MB | draftretriever search p50/p99 µs (single, choices=100) |",
                  "|---|---|---|---|---|---|---|"]
        for r in dr:
            d = r["draftretriever"]
            lines.append(f"| {r['corpus']} | {r['build_s']['suffix_array'] + r['build_s']['write']:.2f} | "
                         f"{r['bytes_per_token']:.3f} | {d['build_s']:.2f} | {d['bytes_per_token']:.3f} | "
                         f"{d['peak_rss_mb']:.0f} | {d['search_single_us']['p50']:.1f} / "
                         f"{d['search_single_us']['p99']:.1f} |")
    lines += ["", f"Goals (reference corpus: {summary['reference_corpus']}):", ""]
    for k, g in summary["goals"].items():
        lines.append(f"- {k}: {g['value']:.3g} (goal {'≥' if k == 'sa_build_tokens_per_s' else '≤'} {g['goal']:g})"
                     f" — {'met' if g['met'] else 'MISSED'}")
    lines += ["", *meta.get("notes", [])]
    return "\n".join(lines) + "\n"


NOTES = [
    "Notes:",
    "- bytes/token counts everything on disk (token array incl. one 2-byte separator per document, int32 suffix "
    "array, .npy headers, manifest) divided by real tokens: 6 + 2/(mean document length) at vocab <= 65,535, so "
    "short documents (chitchat conversations) land slightly above 6.",
    "- Peak RSS is the build child's own ru_maxrss (token documents loaded + token array + byte-level suffix array).",
    "- draftretriever's search returns REST-style candidate trees, not the same output as `continuations`; its "
    "latency is listed for scale only.",
    "- draftretriever's search is timed on the 2-4-token prefixes only: it panics (index out of bounds) on "
    "1-token queries.",
    "- Two CPU cores shared with other jobs: latencies vary run to run. Batches of 64 run the serial numba kernel: "
    "the prange kernel waited ~8 ms per batch for the busy second core (125 µs/prefix), so it is used only from "
    "PARALLEL_MIN_BATCH = 512 prefixes (datastore/store.py).",
    "- The bytes/token goal (<= 6) is missed by the separators only (6.0005 on stdlib, 6.004 on chitchat); the "
    "token + suffix-array payload is exactly 6 bytes per real token.",
    "- draftretriever stores fewer bytes/token than the 6 of REST's format on these corpora (its index file is "
    "smaller than u16 + i32 per token); we did not investigate its layout further.",
]


def run_full(args: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="ds-bench-"))
    rows = []
    for corpus in ("stdlib", "chitchat"):
        docs_file = work / f"{corpus}.npz"
        tok = _child("tokenize", corpus, str(docs_file))
        print(f"[{corpus}] tokenized: {tok}", file=sys.stderr)
        rows.append(bench_corpus(corpus, docs_file, tok["vocab_size"], work, tokenize=tok, n_single=2000,
                                 n_batches=60, with_draftretriever=True))
        print(json.dumps(rows[-1]), file=sys.stderr)
    docs_file = work / "synthetic.npz"
    _save_docs(docs_file, synthetic_docs(args.synthetic_tokens, 49152))
    rows.append(bench_corpus(f"synthetic-{args.synthetic_tokens // 1_000_000}M", docs_file, 49152, work,
                             tokenize=None, n_single=2000, n_batches=60, with_draftretriever=args.dr_synthetic))
    write_results("datastore", rows, summarize(rows, "stdlib"), "full")


def run_quick() -> None:
    """Queries on the default datastore + a build of its first 2M tokens (ours and draftretriever)."""
    from datastore import Datastore
    from datastore.encoding import TokenEncoding
    from datastore.paths import default_datastore_dir

    path = default_datastore_dir()
    if not (path / "manifest.json").exists():
        subprocess.run([sys.executable, "-m", "datastore.cli", "--preset", "default"], check=True, cwd=ROOT)
    ds = Datastore.open(path)
    work = Path(tempfile.mkdtemp(prefix="ds-bench-quick-"))
    enc = TokenEncoding.for_vocab(ds.vocab_size)
    ids = enc.decode(ds._tokens[0][:2_000_000])
    cuts = np.flatnonzero(ids == enc.separator)
    docs = [d[d != enc.separator].astype(np.int32) for d in np.split(ids, cuts + 1)]
    docs_file = work / "sample.npz"
    _save_docs(docs_file, [d for d in docs if d.size])
    rows = [bench_corpus("default-sample-2M", docs_file, ds.vocab_size, work, tokenize=None, n_single=1000,
                         n_batches=30, with_draftretriever=True)]
    full = {"corpus": f"default ({path})", "tokens": ds.num_tokens, "documents": ds.num_documents,
            "bytes_per_token": ds.bytes_on_disk / ds.num_tokens, "queries": measure_queries(
                ds, n_single=1000, n_batches=30)}
    full.update({"build_s": {"tokenize": float("nan"), "suffix_array": float("nan"), "write": float("nan")},
                 "sa_build_tokens_per_s": rows[0]["sa_build_tokens_per_s"], "build_peak_rss_mb": float("nan")})
    rows.insert(0, full)
    write_results("datastore_quick", rows, summarize(rows, "default-sample-2M"), "quick")


def write_results(name: str, rows: list[dict], summary: dict, mode: str) -> None:
    meta = {"mode": mode, "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "notes": NOTES}
    RESULTS.mkdir(parents=True, exist_ok=True)
    write_results_json(RESULTS / f"{name}.json", {"summary": summary, "rows": rows, "meta": meta})
    md = markdown(rows, summary, meta)
    (RESULTS / f"{name}.md").write_text(md)
    print(md)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="<= 90 s on the default datastore (datastore_quick.*)")
    p.add_argument("--synthetic-tokens", type=int, default=50_000_000)
    p.add_argument("--dr-synthetic", action="store_true", help="also build draftretriever on the synthetic corpus")
    p.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        kind, *rest = args.worker
        if kind == "tokenize":
            out = worker_tokenize(rest[0], Path(rest[1]))
        elif kind == "build":
            out = worker_build(Path(rest[0]), Path(rest[1]), int(rest[2]))
        else:
            out = worker_draftretriever(Path(rest[0]), Path(rest[1]), int(rest[2]))
        out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(json.dumps(out))
        return 0
    run_quick() if args.quick else run_full(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
