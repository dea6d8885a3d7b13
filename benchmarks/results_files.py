"""Where benchmark results live, and the one way a benchmark writes its JSON and markdown there."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def result_name_problem(name: str) -> str | None:
    """Why `name` cannot name a results file (`results/<name>.json`), or None: it must be a plain file name, so a
    results file never lands outside `results/`."""
    if re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name):
        return None
    return f"{name!r}: a file name in benchmarks/results (letters, digits, '_', '.', '-')"


def save_results(name: str, result: dict, write_markdown: Callable[[Path, dict], None]) -> Path:
    """Write `results/<name>.json` and, through `write_markdown(path, result)`, `results/<name>.md`; returns the .md."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    markdown = RESULTS / f"{name}.md"
    write_markdown(markdown, result)
    return markdown

