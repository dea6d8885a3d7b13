"""Query API against brute force: counts and sampled continuations on random and real text, every encoding width,
several shards, document boundaries."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_datastore_naive import naive_continuations, naive_count, shard_docs
from datastore import Datastore, DatastoreError, build_from_token_docs
from datastore.encoding import TokenEncoding
from datastore.paths import default_model_dir

# Vocabulary sizes covering every width: 2 bytes, exactly 65536 (3 bytes), 3 bytes, above 2^24 (4 bytes).
VOCABS = [12, 65535, 65536, 70_000, 2**24 + 5, 2**31 - 1]


def _check(ds: Datastore, docs: list[list[int]], prefixes: list[list[int]], k: int, length: int) -> None:
    shards = shard_docs(docs, [s.num_documents for s in ds.manifest.shards])
    sep = ds.manifest.separator
    batch = ds.continuations_batch(prefixes, k, length)
    assert batch.rows.dtype == np.int32 and batch.offsets.dtype == np.int64 and batch.counts.dtype == np.int64
    np.testing.assert_array_equal(ds.count_batch(prefixes), [naive_count(docs, p) for p in prefixes])
    for i, p in enumerate(prefixes):
        count, rows = naive_continuations(shards, p, k, length, sep)
        assert ds.count(p) == count == batch.counts[i]
        np.testing.assert_array_equal(batch.rows[batch.offsets[i] : batch.offsets[i + 1]], rows)
        np.testing.assert_array_equal(ds.continuations(p, k, length), rows)


@st.composite
def corpora(draw):
    alphabet = draw(st.integers(2, 6))
    vocab = draw(st.sampled_from(VOCABS))
    offset = max(0, vocab - alphabet)  # use the top ids so every byte of the width is exercised
    docs = draw(st.lists(st.lists(st.integers(0, alphabet - 1), min_size=0, max_size=12), min_size=1, max_size=8))
    docs = [[t + offset for t in d] for d in docs]
    if not any(docs):
        docs.append([offset])
    max_shard = draw(st.one_of(st.none(), st.integers(12, 40)))
    flat = [t for d in docs for t in d]
    prefixes = draw(st.lists(st.one_of(
        st.lists(st.integers(0, alphabet - 1).map(lambda t: t + offset), min_size=0, max_size=4),
        st.tuples(st.integers(0, len(flat) - 1), st.integers(1, 5)).map(lambda a: flat[a[0] : a[0] + a[1]]),
    ), min_size=1, max_size=7))
    return vocab, docs, max_shard, prefixes, draw(st.integers(0, 9)), draw(st.integers(0, 5))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=corpora())
def test_random_corpora_match_naive_scan(tmp_path: Path, case) -> None:
    vocab, docs, max_shard, prefixes, k, length = case
    out = Path(tempfile.mkdtemp(dir=tmp_path)) / "ds"
    build_from_token_docs(docs, out, vocab_size=vocab, max_shard_tokens=max_shard)
    ds = Datastore.open(out, verify=True)
    assert ds.num_tokens == sum(len(d) for d in docs)
    assert ds.manifest.token_bytes == TokenEncoding.for_vocab(vocab).width
    _check(ds, docs, prefixes, k, length)


@pytest.mark.parametrize(("vocab", "width"), [(65535, 2), (65536, 3), (2**24 - 1, 3), (2**24, 4), (2**31 - 1, 4)])
def test_width_per_vocab_and_top_ids_roundtrip(tmp_path: Path, vocab: int, width: int) -> None:
    top = vocab - 1
    docs = [[top, 0, top, 1], [0, top, top]]
    ds = Datastore.open(build_from_token_docs(docs, tmp_path / "ds", vocab_size=vocab))
    assert ds.manifest.token_bytes == width
    assert ds.count([top]) == 4 and ds.count([0, top]) == 2 and ds.count([top, top]) == 1
    _check(ds, docs, [[top], [0], [top, 0], [0, top, top], []], k=5, length=3)


def test_vocab_above_int32_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(DatastoreError, match="2\\^31 - 1"):
        build_from_token_docs([[1]], tmp_path / "ds", vocab_size=2**31)
    assert not (tmp_path / "ds").exists()


def test_no_match_or_continuation_crosses_a_document_end(tmp_path: Path) -> None:
    docs = [[1, 2, 3], [4, 5], [3, 4, 5, 6]]
    ds = Datastore.open(build_from_token_docs(docs, tmp_path / "ds", vocab_size=10))
    assert ds.count([3, 4]) == 1  # only inside the third document, not across the first boundary
    assert ds.count([5, 3]) == 0 and ds.count([2, 3, 4]) == 0
    np.testing.assert_array_equal(ds.continuations([2, 3], k=4, length=3), [[-1, -1, -1]])
    rows = ds.continuations([4, 5], k=4, length=2)
    assert sorted(map(tuple, rows.tolist())) == [(-1, -1), (6, -1)]


def test_k_is_split_across_shards_by_match_count(tmp_path: Path) -> None:
    # shard 0 holds 6 matches of [1], shard 1 holds 2: k=4 → 3 + 1 samples.
    docs = [[1, 2] * 6, [1, 3, 1, 4]]
    ds = Datastore.open(build_from_token_docs(docs, tmp_path / "ds", vocab_size=10, max_shard_tokens=12))
    assert ds.num_shards == 2 and ds.count([1]) == 8
    rows = ds.continuations([1], k=4, length=1)
    assert rows.shape == (4, 1)
    assert (rows[:3, 0] == 2).all() and rows[3, 0] in (3, 4)
    _check(ds, docs, [[1], [1, 2], [2, 1], [4]], k=4, length=2)


def test_batch_accepts_2d_arrays_and_rejects_bad_queries(tmp_path: Path) -> None:
    docs = [[1, 2, 3, 1, 2, 4]]
    ds = Datastore.open(build_from_token_docs(docs, tmp_path / "ds", vocab_size=5))
    arr = np.array([[1, 2], [2, 3], [4, 4]])
    np.testing.assert_array_equal(ds.count_batch(arr), [2, 1, 0])
    batch = ds.continuations_batch(arr, k=10, length=1)
    np.testing.assert_array_equal(batch.offsets, [0, 2, 3, 3])
    for bad in ([5], [-1], [1.5]):
        with pytest.raises(DatastoreError):
            ds.count(bad)
    with pytest.raises(DatastoreError, match="outside the vocabulary"):
        ds.continuations_batch([[1], [7]], k=2, length=2)


def test_many_prefixes_in_one_batch_match_single_calls(tmp_path: Path) -> None:
    # 600 prefixes: above PARALLEL_MIN_BATCH, so the prange kernels run; single calls use the serial ones.
    from datastore.store import PARALLEL_MIN_BATCH

    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 8, size=int(rng.integers(1, 300))).tolist() for _ in range(20)]
    ds = Datastore.open(build_from_token_docs(docs, tmp_path / "ds", vocab_size=8, max_shard_tokens=1000))
    prefixes = [rng.integers(0, 8, size=int(rng.integers(0, 5))) for _ in range(600)]
    assert len(prefixes) > PARALLEL_MIN_BATCH
    batch = ds.continuations_batch(prefixes, k=100, length=8)
    np.testing.assert_array_equal(ds.count_batch(prefixes), batch.counts)
    for i, p in enumerate(prefixes):
        np.testing.assert_array_equal(batch.rows[batch.offsets[i] : batch.offsets[i + 1]], ds.continuations(p, 100, 8))
        assert batch.counts[i] == ds.count(p)
    np.testing.assert_array_equal(batch.counts[:50], [naive_count(docs, p.tolist()) for p in prefixes[:50]])


@pytest.mark.skipif(not (default_model_dir() / "tokenizer.json").is_file(), reason="default model not prepared")
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_real_text_matches_naive_scan(tmp_path_factory, data) -> None:
    docs, ds = _real_datastore(tmp_path_factory)
    flat = [t for d in docs for t in d]
    prefixes = [data.draw(st.tuples(st.integers(0, len(flat) - 1), st.integers(1, 4)).map(
        lambda a: flat[a[0] : a[0] + a[1]])) for _ in range(3)]
    prefixes.append(data.draw(st.lists(st.integers(0, ds.vocab_size - 1), min_size=1, max_size=2)))
    _check(ds, docs, prefixes, k=data.draw(st.integers(1, 20)), length=4)


_REAL: dict = {}


def _real_datastore(tmp_path_factory):
    if not _REAL:
        from tokenizers import Tokenizer

        import textwrap
        tok = Tokenizer.from_file(str(default_model_dir() / "tokenizer.json"))
        texts = [Path(textwrap.__file__).read_text()[:6000], Path(np.__file__).read_text()[:3000]]
        docs = [tok.encode(t, add_special_tokens=False).ids for t in texts]
        out = tmp_path_factory.mktemp("real") / "ds"
        build_from_token_docs(docs, out, vocab_size=tok.get_vocab_size(True), max_shard_tokens=max(map(len, docs)))
        _REAL["v"] = (docs, Datastore.open(out))
    return _REAL["v"]


@pytest.mark.parametrize("vocab", [300, 70_000])
def test_documents_round_trip_across_shards(tmp_path: Path, vocab: int) -> None:
    rng = np.random.default_rng(vocab)
    docs = [rng.integers(0, vocab, int(rng.integers(1, 40))).astype(np.int32) for _ in range(25)]
    ds = Datastore.open(build_from_token_docs(docs, tmp_path / "ds", vocab_size=vocab, max_shard_tokens=128))
    assert ds.num_shards > 1
    got = list(ds.documents())
    assert [d.tolist() for d in got] == [d.tolist() for d in docs]
