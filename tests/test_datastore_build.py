"""Building, appending, and every bad-input / damaged-datastore case of the programmatic API."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from test_datastore_naive import naive_count
from datastore import Datastore, DatastoreError, build_from_token_docs
from datastore.manifest import MANIFEST, file_checksum


def _snapshot(path: Path) -> dict[str, str]:
    return {p.name: file_checksum(p) for p in sorted(path.iterdir())}


def _ds(tmp_path: Path, docs=None, **kw) -> Path:
    return build_from_token_docs(docs or [[1, 2, 3, 4], [2, 3, 5]], tmp_path / "ds", vocab_size=8, **kw)


def test_format_files_and_manifest(tmp_path: Path) -> None:
    path = _ds(tmp_path)
    m = json.loads((path / MANIFEST).read_text())
    assert m["format_version"] == 1 and m["vocab_size"] == 8 and m["token_bytes"] == 2
    (shard,) = m["shards"]
    assert (shard["num_tokens"], shard["num_documents"], shard["length"]) == (7, 2, 9)
    for name in (shard["tokens_file"], shard["sa_file"]):
        assert shard["checksums"][name] == file_checksum(path / name)
        assert isinstance(np.load(path / name, mmap_mode="r", allow_pickle=False), np.memmap)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]  # no temporary directory left behind


def test_bytes_per_token_is_six_plus_separators(tmp_path: Path) -> None:
    docs = [list(range(100))] * 10
    ds = Datastore.open(build_from_token_docs(docs, tmp_path / "ds", vocab_size=200))
    arrays = ds.bytes_on_disk - (ds.path / MANIFEST).stat().st_size - 2 * 128  # two .npy headers
    assert arrays == 6 * ds.num_tokens + 2 * ds.num_documents


def test_append_adds_shards_and_max_shards_drops_oldest(tmp_path: Path) -> None:
    a, b, c = [[1, 2, 3]], [[1, 2, 4], [2, 2]], [[1, 2, 5]]
    path = build_from_token_docs(a, tmp_path / "ds", vocab_size=8)
    build_from_token_docs(b, path, vocab_size=8, append=True)
    ds = Datastore.open(path, verify=True)
    assert ds.num_shards == 2 and ds.count([1, 2]) == naive_count(a + b, [1, 2]) == 2
    build_from_token_docs(c, path, vocab_size=8, append=True, max_shards=2)
    ds = Datastore.open(path, verify=True)
    assert ds.num_shards == 2 and ds.count([1, 2, 3]) == 0 and ds.count([1, 2]) == 2
    assert [s.id for s in ds.manifest.shards] == [1, 2]
    on_disk = {p.name for p in path.iterdir()}
    assert on_disk == {MANIFEST} | {n for s in ds.manifest.shards for n in (s.tokens_file, s.sa_file)}


def test_append_with_another_tokenizer_is_refused_and_damages_nothing(tmp_path: Path) -> None:
    path = _ds(tmp_path)
    before = _snapshot(path)
    with pytest.raises(DatastoreError, match="same tokenizer"):
        build_from_token_docs([[1]], path, vocab_size=8, tokenizer_id="other", append=True)
    with pytest.raises(DatastoreError, match="same tokenizer"):
        build_from_token_docs([[1]], path, vocab_size=9, append=True)
    assert _snapshot(path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]


@pytest.mark.parametrize(("docs", "match"), [
    ([[1, 2], [3, 8]], "token id 8 is outside the vocabulary"),
    ([[1, -2]], "token id -2"),
    ([], "empty corpus"),
    ([[], []], "empty corpus"),
    ([[1.0, 2.0]], "integer token ids"),
])
def test_bad_documents_raise_and_leave_nothing(tmp_path: Path, docs, match: str) -> None:
    with pytest.raises(DatastoreError, match=match):
        build_from_token_docs(docs, tmp_path / "ds", vocab_size=8)
    assert list(tmp_path.iterdir()) == []


def test_bad_build_into_existing_datastore_keeps_it(tmp_path: Path) -> None:
    path = _ds(tmp_path)
    before = _snapshot(path)
    with pytest.raises(DatastoreError, match="already exists"):
        build_from_token_docs([[1]], path, vocab_size=8)
    with pytest.raises(DatastoreError, match="outside the vocabulary"):
        build_from_token_docs([[1], [99]], path, vocab_size=8, overwrite=True)
    with pytest.raises(DatastoreError, match="outside the vocabulary"):
        build_from_token_docs([[1], [99]], path, vocab_size=8, append=True)
    assert _snapshot(path) == before
    assert Datastore.open(path, verify=True).count([2, 3]) == 2
    build_from_token_docs([[7, 7]], path, vocab_size=8, overwrite=True)
    assert Datastore.open(path).num_tokens == 2


def test_long_documents_are_cut_at_shard_size(tmp_path: Path) -> None:
    ds = Datastore.open(build_from_token_docs([list(range(10))], tmp_path / "ds", vocab_size=10, max_shard_tokens=4))
    assert ds.num_shards == 3 and ds.num_tokens == 10 and ds.count([4, 5]) == 1 and ds.count([3, 4]) == 0


def test_missing_manifest_or_directory(tmp_path: Path) -> None:
    with pytest.raises(DatastoreError, match="no such datastore"):
        Datastore.open(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatastoreError, match="manifest missing"):
        Datastore.open(tmp_path / "empty")


def test_unknown_format_version(tmp_path: Path) -> None:
    path = _ds(tmp_path)
    m = json.loads((path / MANIFEST).read_text())
    m["format_version"] = 99
    (path / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(DatastoreError, match="unknown format version 99"):
        Datastore.open(path)


def test_missing_shard_file(tmp_path: Path) -> None:
    path = _ds(tmp_path)
    next(path.glob("*.sa.npy")).unlink()
    with pytest.raises(DatastoreError, match="shard file missing"):
        Datastore.open(path)


def test_truncated_shard_file(tmp_path: Path) -> None:
    path = _ds(tmp_path, docs=[list(range(8)) * 50])
    f = next(path.glob("*.tokens.npy"))
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(DatastoreError, match="truncated"):
        Datastore.open(path)


def test_corrupted_shard_detected_by_verify(tmp_path: Path) -> None:
    path = _ds(tmp_path, docs=[list(range(8)) * 50])
    f = next(path.glob("*.tokens.npy"))
    data = bytearray(f.read_bytes())
    data[-3] ^= 0x01
    f.write_bytes(bytes(data))
    Datastore.open(path)  # verify=False only checks presence and shapes
    with pytest.raises(DatastoreError, match="checksum mismatch"):
        Datastore.open(path, verify=True)
