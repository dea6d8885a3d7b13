"""`build-datastore` (also `retrospec build-datastore`): corpora → tokenized shards → suffix arrays on disk.

Examples::

    build-datastore --preset default                         # chitchat train split + CPython stdlib → cache
    build-datastore data/*.jsonl notes.txt --out ds --tokenizer default
    build-datastore src/ --glob '**/*.py' --out ds --tokenizer path/to/model
    build-datastore served.jsonl --out ds --append --max-shards 8

Bad input prints one line naming the file/line/field and the fix, and exits with status 2; nothing on disk is
changed. See `datastore.sources` for the input formats and `datastore.corpora` for the preset's split.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from .build import BuildStats, build_datastore
from .errors import DatastoreError
from .manifest import MANIFEST, Manifest

T = TypeVar("T")
PRESETS = ("default",)


class _Timed(Iterator[T]):
    """Iterator wrapper that adds up the seconds spent producing items."""

    def __init__(self, it: Iterable[T]):
        self._it = iter(it)
        self.seconds = 0.0

    def __next__(self) -> T:
        t0 = time.perf_counter()
        try:
            return next(self._it)
        finally:
            self.seconds += time.perf_counter() - t0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="build-datastore", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="*", help="files, directories or globs (.jsonl, .txt, .parquet, source files)")
    p.add_argument("--out", help="datastore directory (with --preset: defaults to the cache)")
    p.add_argument("--tokenizer", default="default", help="`default`, a tokenizer.json, or a model folder")
    p.add_argument("--text-field", default="text", help="JSONL/parquet field holding the text (default: text)")
    p.add_argument("--glob", help="pattern for files inside directory inputs, e.g. '**/*.py'")
    p.add_argument("--max-shard-tokens", type=int, help="split the corpus into shards of at most this many tokens")
    p.add_argument("--append", action="store_true", help="add shards to an existing datastore (same tokenizer)")
    p.add_argument("--max-shards", type=int, help="keep only the newest N shards (drops the oldest)")
    p.add_argument("--skip-bad-lines", action="store_true", help="count and skip malformed JSONL lines / rows")
    p.add_argument("--preset", choices=PRESETS, help="build a named datastore (default: chitchat train + stdlib)")
    p.add_argument("--force", action="store_true", help="replace an existing datastore / rebuild a preset")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:  # argparse already printed the usage error
        return int(e.code or 0)
    try:
        return _run(args)
    except DatastoreError as e:
        print(f"build-datastore: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("build-datastore: interrupted; nothing was changed", file=sys.stderr)
        return 130


def _run(args: argparse.Namespace) -> int:
    from .sources import CorpusReader, expand_inputs
    from .tokenizer import LoadedTokenizer

    if args.preset and args.inputs:
        raise DatastoreError("--preset builds from its own corpora; drop the inputs or drop --preset")
    if not args.preset and not args.inputs:
        raise DatastoreError("no inputs; pass files, directories or globs (or --preset default)")
    if not args.preset and not args.out:
        raise DatastoreError("--out is required (the datastore directory to create)")

    t_start = time.perf_counter()
    tok = LoadedTokenizer.load(args.tokenizer)
    reader = CorpusReader(render_chat=tok.render_chat, text_field=args.text_field, skip_bad_lines=args.skip_bad_lines)
    build_info: dict[str, Any]
    if args.preset:
        from .paths import default_datastore_dir

        out = Path(args.out) if args.out else default_datastore_dir()
        if _preset_up_to_date(out, args.preset, tok.identity.id) and not args.force:
            print(f"build-datastore: {out} is already built (preset {args.preset}); pass --force to rebuild")
            return 0
        texts, build_info = _preset_texts(args.preset, tok)
    else:
        out = Path(args.out)
        files = expand_inputs(args.inputs, args.glob)
        texts = reader.texts(files)
        build_info = {"inputs": [str(f) for f in files[:1000]], "num_input_files": len(files),
                      "text_field": args.text_field}
    build_info["tokenizer_path"] = str(tok.path)

    read = _Timed(texts)
    encoded = _Timed(tok.encode_stream(read))
    stats = BuildStats()
    from tqdm import tqdm

    with tqdm(desc="tokenizing", unit=" doc", disable=True if args.quiet else None, mininterval=0.5) as bar:
        def progress(docs: Iterable[Any]) -> Iterator[Any]:
            for d in docs:
                bar.update(1)
                yield d

        build_datastore(progress(encoded), out, tokenizer=tok.identity, max_shard_tokens=args.max_shard_tokens,
                        append=args.append, max_shards=args.max_shards, overwrite=args.force or bool(args.preset),
                        build_info=build_info, stats=stats)
    phases = {"read": read.seconds, "tokenize": encoded.seconds - read.seconds, **stats.seconds,
              "total": time.perf_counter() - t_start}
    shards = Manifest.read(out).shards
    print(f"built {out}: {stats.documents:,} documents, {stats.tokens:,} tokens, {stats.shards_written} new "
          f"shard(s) ({len(shards)} in the datastore, {stats.shards_dropped} dropped), "
          f"{stats.bytes_per_token:.3f} bytes/token on disk ({stats.bytes_written / 1e6:.1f} MB)")
    if reader.bad_lines:
        print(f"skipped {reader.bad_lines} bad line(s), e.g. {reader.bad_examples[0] if reader.bad_examples else ''}")
    print("seconds: " + ", ".join(f"{k} {v:.2f}" for k, v in phases.items()))
    return 0


def _preset_up_to_date(out: Path, preset: str, tokenizer_id: str) -> bool:
    if not (out / MANIFEST).is_file():
        return False
    try:
        m = Manifest.read(out)
    except DatastoreError:
        return False
    return m.build.get("preset") == preset and m.tokenizer_id == tokenizer_id


def _preset_texts(preset: str, tok: Any) -> tuple[Iterator[str], dict[str, Any]]:
    from .corpora import HELDOUT_MODULUS, chitchat_conversations, stdlib_root, stdlib_sources

    assert preset == "default"
    convs = chitchat_conversations("train")
    files = stdlib_sources()

    def texts() -> Iterator[str]:
        for cid, messages in convs:
            yield tok.render_chat(messages, f"chitchat conversation {cid}")
        for f in files:
            yield f.read_bytes().decode("utf-8", errors="replace")

    info = {"preset": preset, "chitchat_train_conversations": len(convs),
            "chitchat_split": f"held out iff xxh64(conversation_id) % {HELDOUT_MODULUS} == 0",
            "stdlib_root": str(stdlib_root()), "stdlib_files": len(files)}
    return texts(), info


if __name__ == "__main__":
    sys.exit(main())
