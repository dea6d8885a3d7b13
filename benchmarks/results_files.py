"""Where benchmark results live, and the one way a benchmark writes its JSON and markdown there."""

from __future__ import annotations

import argparse
import functools
import json
import re
import subprocess
from collections.abc import Callable
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
_REPOSITORY = RESULTS.parent.parent


@functools.cache
def code_revision() -> str | None:
    """The commit of the checkout a benchmark runs from (git HEAD), with "+dirty" where tracked files other than
    benchmarks/results differ from it; None outside a git checkout (or without git). Cached, and asked for when this
    module is imported, so a run records the code it started with even if the checkout moves on while it runs."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(_REPOSITORY), *args], capture_output=True, text=True, check=True,
                              timeout=30).stdout.strip()
    try:
        head = git("rev-parse", "--verify", "HEAD")
        changed = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)benchmarks/results")
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if changed else "")


code_revision()


def result_name_problem(name: str) -> str | None:
    """Why `name` cannot name a results file (`results/<name>.json`), or None: it must be a plain file name, so a
    results file never lands outside `results/`."""
    if re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name):
        return None
    return f"{name!r}: a file name in benchmarks/results (letters, digits, '_', '.', '-')"


def write_results_json(path: Path, result: dict, *, indent: int = 2) -> dict:
    """Write a benchmark's results JSON to `path`, with `code_revision` (the commit that ran, `code_revision()`)
    unless `result` names one already; returns what was written. Every results JSON goes through here."""
    result = {**result, "code_revision": result.get("code_revision", code_revision())}
    path.write_text(json.dumps(result, indent=indent) + "\n")
    return result


def save_results(name: str, result: dict, write_markdown: Callable[[Path, dict], None]) -> Path:
    """Write `results/<name>.json` (`write_results_json`) and, through `write_markdown(path, result)`,
    `results/<name>.md`; returns the .md."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    result = write_results_json(RESULTS / f"{name}.json", result)
    markdown = RESULTS / f"{name}.md"
    write_markdown(markdown, result)
    return markdown



def rounds_benchmark_main(name: str, doc: str, measure: Callable[[int], dict],
                          write_markdown: Callable[[Path, dict], None], argv: list[str] | None,
                          default_rounds: int = 40) -> int:
    """The command line of a benchmark whose only option is `--rounds` (interleaved measuring rounds): refuses a
    count below 1 before measuring, runs `measure(rounds)`, saves `results/<name>.*` and prints the markdown."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=default_rounds)
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1; got {args.rounds}")
    print(save_results(name, measure(args.rounds), write_markdown).read_text())
    return 0
