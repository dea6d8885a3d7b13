"""Corpus readers: turn input paths (files, directories, globs) into document texts.

Formats, by file name:
- `.jsonl`: one JSON object per line; the document is the `--text-field` string (default "text"), or, when that
  field is absent, a chat `messages` list ([{"role", "content"}, ...]) rendered with the tokenizer's chat template.
- `.parquet`: the same two choices per row (column `--text-field`, else `messages`).
- anything else (`.txt`, source files picked by `--glob '**/*.py'`): the whole file is one document (UTF-8;
  undecodable bytes become U+FFFD).
A directory input contributes the files matching `--glob` under it (default: every .jsonl/.txt/.parquet file,
recursively). Bad JSONL lines or rows raise an error naming file, line and field, unless `skip_bad_lines` is set,
in which case they are counted in `bad_lines` and skipped.
"""

from __future__ import annotations

import glob as globlib
import json
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import DatastoreError

DEFAULT_EXTENSIONS = (".jsonl", ".txt", ".parquet")
_GLOB_CHARS = set("*?[")


def expand_inputs(inputs: Sequence[str], pattern: str | None = None) -> list[Path]:
    """Files named by `inputs` (files, directories searched with `pattern`, or glob expressions), deduplicated in
    order. Raises `DatastoreError` for a missing or unreadable input, or one that matches no file."""
    files: list[Path] = []
    for spec in inputs:
        path = Path(spec).expanduser()
        if path.is_file():
            found = [path]
        elif path.is_dir():
            if pattern:
                found = sorted(p for p in path.glob(pattern) if p.is_file())
            else:
                found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in DEFAULT_EXTENSIONS)
            if not found:
                what = f"--glob {pattern!r}" if pattern else "a .jsonl/.txt/.parquet name"
                raise DatastoreError(f"{path}: directory has no file matching {what}; pass --glob PATTERN "
                                     "(e.g. '**/*.py') or another input")
        elif _GLOB_CHARS & set(spec):
            found = sorted(Path(p) for p in globlib.glob(os.path.expanduser(spec), recursive=True) if Path(p).is_file())
            if not found:
                raise DatastoreError(f"{spec}: the glob matches no file; check the pattern (quote it for the shell)")
        else:
            raise DatastoreError(f"{spec}: no such file or directory; check the input path")
        for f in found:
            if not os.access(f, os.R_OK):
                raise DatastoreError(f"{f}: file is not readable (permissions); fix them or leave the file out")
        files.extend(found)
    seen: set[Path] = set()
    return [f for f in files if not (f.resolve() in seen or seen.add(f.resolve()))]


@dataclass
class CorpusReader:
    """Yields document texts from files; counts documents and skipped bad lines.

    `render_chat(messages, where)` turns a chat `messages` list into text (the tokenizer's chat template).
    """

    render_chat: Callable[[list[dict[str, Any]], str], str]
    text_field: str = "text"
    skip_bad_lines: bool = False
    bad_lines: int = 0
    bad_examples: list[str] | None = None

    def texts(self, files: Sequence[Path]) -> Iterator[str]:
        for f in files:
            if f.suffix == ".jsonl":
                yield from self._jsonl(f)
            elif f.suffix == ".parquet":
                yield from self._parquet(f)
            else:
                try:
                    yield f.read_bytes().decode("utf-8", errors="replace")
                except OSError as e:
                    raise DatastoreError(f"{f}: cannot read ({e.strerror}); fix the file or leave it out")

    def _bad(self, where: str, problem: str, fix: str) -> None:
        if not self.skip_bad_lines:
            raise DatastoreError(f"{where}: {problem}; {fix}, or pass --skip-bad-lines to skip such lines")
        self.bad_lines += 1
        if self.bad_examples is None:
            self.bad_examples = []
        if len(self.bad_examples) < 5:
            self.bad_examples.append(f"{where}: {problem}")

    def _record_text(self, rec: Any, where: str) -> str | None:
        if not isinstance(rec, dict):
            self._bad(where, f"expected a JSON object, got {type(rec).__name__}", "make each line an object")
            return None
        if self.text_field in rec:
            value = rec[self.text_field]
            if not isinstance(value, str):
                self._bad(where, f"field {self.text_field!r} is {type(value).__name__}, not a string",
                          "choose a string field with --text-field")
                return None
            return value
        if "messages" in rec:
            msgs = rec["messages"]
            if not (isinstance(msgs, list) and all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in msgs)):
                self._bad(where, "field 'messages' is not a list of {\"role\": str, \"content\": str} objects",
                          "fix the messages")
                return None
            return self.render_chat(msgs, where)
        keys = ", ".join(sorted(map(str, rec))[:8]) or "none"
        self._bad(where, f"no field {self.text_field!r} and no 'messages' (fields: {keys})",
                  "choose the text field with --text-field")
        return None

    def _jsonl(self, f: Path) -> Iterator[str]:
        try:
            fh = open(f, "rb")
        except OSError as e:
            raise DatastoreError(f"{f}: cannot open ({e.strerror}); fix the file or leave it out")
        with fh:
            for lineno, raw in enumerate(fh, start=1):
                if not raw.strip():
                    continue
                where = f"{f}:{lineno}"
                try:
                    rec = json.loads(raw)
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    self._bad(where, f"malformed JSON ({getattr(e, 'msg', e)})", "fix the line")
                    continue
                text = self._record_text(rec, where)
                if text is not None:
                    yield text

    def _parquet(self, f: Path) -> Iterator[str]:
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(f)
        except Exception as e:  # pyarrow raises several types for a bad file
            raise DatastoreError(f"{f}: not a readable parquet file ({e}); fix or leave out the file")
        names = pf.schema_arrow.names
        column = self.text_field if self.text_field in names else "messages" if "messages" in names else None
        if column is None:
            raise DatastoreError(f"{f}: no column {self.text_field!r} and no 'messages' column (columns: "
                                 f"{', '.join(names[:8])}); choose the text column with --text-field")
        row = 0
        for batch in pf.iter_batches(columns=[column]):
            for value in batch.column(0).to_pylist():
                row += 1
                text = self._record_text({column: value}, f"{f}: row {row}")
                if text is not None:
                    yield text
