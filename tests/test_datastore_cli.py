"""`build-datastore` end to end on a small real corpus, its bad-input errors, and the default preset's split."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import xxhash

from test_datastore_naive import naive_count
from datastore import Datastore
from datastore.cli import main
from datastore.corpora import chitchat_conversations, is_heldout, stdlib_sources
from datastore.manifest import file_checksum
from datastore.paths import default_model_dir

HAS_DEFAULT = (default_model_dir() / "tokenizer.json").is_file()


def _tiny_tokenizer(folder: Path, words: list[str], *, template: bool = True) -> Path:
    """A word-level tokenizer (whitespace split) in a model folder, with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["[UNK]", *sorted(set(words))])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    if template:
        (folder / "chat_template.jinja").write_text(
            "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} .\n{% endfor %}")
    return folder


WORDS = "the cat sat on mat dog ran user assistant : . hello there".split()


def _snapshot(path: Path) -> dict[str, str]:
    return {p.name: file_checksum(p) for p in sorted(path.iterdir())}


def _corpus(tmp_path: Path) -> Path:
    src = tmp_path / "corpus"
    (src / "code" / "pkg").mkdir(parents=True)
    (src / "a.jsonl").write_text(
        json.dumps({"text": "the cat sat on the mat"}) + "\n\n"
        + json.dumps({"messages": [{"role": "user", "content": "hello there"},
                                   {"role": "assistant", "content": "the dog ran"}]}) + "\n")
    (src / "b.txt").write_text("the dog sat on the cat")
    pq.write_table(pa.table({"body": ["the mat ran", "hello cat"]}), src / "c.parquet")
    (src / "code" / "pkg" / "m.py").write_text("the cat ran")
    (src / "code" / "notes.md").write_text("not picked by the glob")
    return src


def test_cli_end_to_end_tiny_tokenizer(tmp_path: Path, capsys) -> None:
    tok = _tiny_tokenizer(tmp_path / "tok", WORDS)
    src = _corpus(tmp_path)
    out = tmp_path / "ds"
    assert main([str(src / "a.jsonl"), str(src / "b.txt"), "--out", str(out), "--tokenizer", str(tok), "--quiet"]) == 0
    assert main([str(src / "c.parquet"), "--text-field", "body", "--out", str(out), "--tokenizer", str(tok),
                 "--append", "--quiet"]) == 0
    assert main([str(src / "code"), "--glob", "**/*.py", "--out", str(out), "--tokenizer", str(tok), "--append",
                 "--quiet"]) == 0
    summary = capsys.readouterr().out
    assert "documents" in summary and "bytes/token" in summary and "suffix_array" in summary
    from tokenizers import Tokenizer

    t = Tokenizer.from_file(str(tok / "tokenizer.json"))
    texts = ["the cat sat on the mat", "user : hello there .\nassistant : the dog ran .\n",
             "the dog sat on the cat", "the mat ran", "hello cat", "the cat ran"]
    docs = [t.encode(x, add_special_tokens=False).ids for x in texts]
    ds = Datastore.open(out, verify=True)
    assert ds.num_shards == 3 and ds.num_documents == 6 and ds.num_tokens == sum(map(len, docs))
    for phrase in ["the cat", "the", "cat sat", "ran", "the dog ran", ". assistant", "mat ran", "notes"]:
        ids = t.encode(phrase, add_special_tokens=False).ids
        assert ds.count(ids) == naive_count(docs, ids), phrase


@pytest.mark.skipif(not HAS_DEFAULT, reason="default model not prepared (`retrospec model prepare`)")
def test_cli_default_tokenizer_on_real_source_files(tmp_path: Path) -> None:
    import shutil, textwrap

    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(textwrap.__file__, src / "textwrap.py")
    shutil.copy(json.__file__, src / "json_init.py")
    out = tmp_path / "ds"
    assert main([str(src / "*.py"), "--out", str(out), "--tokenizer", "default", "--quiet"]) == 0
    from tokenizers import Tokenizer

    t = Tokenizer.from_file(str(default_model_dir() / "tokenizer.json"))
    docs = [t.encode(p.read_text(), add_special_tokens=False).ids for p in sorted(src.glob("*.py"))]
    ds = Datastore.open(out, verify=True)
    assert ds.num_tokens == sum(map(len, docs)) and ds.vocab_size == t.get_vocab_size(True)
    rng = np.random.default_rng(1)
    for _ in range(30):
        d = docs[int(rng.integers(len(docs)))]
        i, m = int(rng.integers(len(d) - 4)), int(rng.integers(1, 5))
        assert ds.count(d[i : i + m]) == naive_count(docs, d[i : i + m])


def _fails(argv: list[str], capsys, *needles: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    for n in needles:
        assert n in err, (n, err)


def test_cli_bad_inputs(tmp_path: Path, capsys) -> None:
    tok = str(_tiny_tokenizer(tmp_path / "tok", WORDS))
    out = tmp_path / "ds"
    _fails([str(tmp_path / "missing.jsonl"), "--out", str(out), "--tokenizer", tok], capsys, "missing.jsonl",
           "no such file")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "the cat"}\n{"text": "the\n{"body": "x"}\n')
    _fails([str(bad), "--out", str(out), "--tokenizer", tok], capsys, f"{bad}:2", "malformed JSON",
           "--skip-bad-lines")
    nofield = tmp_path / "nofield.jsonl"
    nofield.write_text('{"body": "the cat"}\n')
    _fails([str(nofield), "--out", str(out), "--tokenizer", tok], capsys, f"{nofield}:1", "'text'", "--text-field")
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    _fails([str(empty), "--out", str(out), "--tokenizer", tok], capsys, "empty corpus")
    _fails([str(empty), "--out", str(out), "--tokenizer", str(tmp_path / "nope")], capsys, "tokenizer.json")
    _fails([str(tmp_path / "*.nothing"), "--out", str(out), "--tokenizer", tok], capsys, "matches no file")
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": "hello"}]}) + "\n")
    notemplate = str(_tiny_tokenizer(tmp_path / "tok2", WORDS, template=False))
    _fails([str(chat), "--out", str(out), "--tokenizer", notemplate], capsys, "chat template")
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["tok", "tok2", "bad.jsonl", "nofield.jsonl", "empty.txt", "chat.jsonl"])  # no temp dirs left

    assert main([str(bad), "--out", str(out), "--tokenizer", tok, "--skip-bad-lines", "--quiet"]) == 0
    assert "skipped 2 bad line(s)" in capsys.readouterr().out
    assert Datastore.open(out).num_documents == 1


def test_cli_refuses_to_damage_an_existing_datastore(tmp_path: Path, capsys) -> None:
    tok = str(_tiny_tokenizer(tmp_path / "tok", WORDS))
    other = str(_tiny_tokenizer(tmp_path / "other", WORDS + ["extra"]))
    text = tmp_path / "a.txt"
    text.write_text("the cat sat")
    out = tmp_path / "ds"
    assert main([str(text), "--out", str(out), "--tokenizer", tok, "--quiet"]) == 0
    before = _snapshot(out)
    _fails([str(text), "--out", str(out), "--tokenizer", tok], capsys, "already exists", "--append")
    _fails([str(text), "--out", str(out), "--tokenizer", other, "--append"], capsys, "cannot append",
           "same tokenizer")
    _fails([str(tmp_path / "missing.txt"), "--out", str(out), "--tokenizer", tok, "--append"], capsys, "missing.txt")
    assert _snapshot(out) == before


def test_preset_split_is_fixed_disjoint_and_about_ten_percent() -> None:
    train = chitchat_conversations("train")
    held = chitchat_conversations("heldout")
    train_ids, held_ids = {c for c, _ in train}, {c for c, _ in held}
    assert not train_ids & held_ids
    assert all(xxhash.xxh64_intdigest(c.encode()) % 10 == 0 for c in held_ids)
    assert all(is_heldout(c) for c in held_ids) and not any(is_heldout(c) for c in train_ids)
    assert 0.07 < len(held) / (len(held) + len(train)) < 0.13
    _, messages = train[0]
    assert messages[0]["role"] == "user" and all(
        m["role"] == ("user" if i % 2 == 0 else "assistant") for i, m in enumerate(messages))


def test_stdlib_sources_exclude_third_party(tmp_path: Path) -> None:
    for rel in ["os.py", "json/__init__.py", "site-packages/numpy/core.py", "x/dist-packages/pip.py"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("pass")
    assert [p.relative_to(tmp_path).as_posix() for p in stdlib_sources(tmp_path)] == ["json/__init__.py", "os.py"]
    assert not any("site-packages" in p.parts for p in stdlib_sources())
