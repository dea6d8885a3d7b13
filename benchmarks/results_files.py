"""Where benchmark results live, and the one way a benchmark writes its JSON and markdown there."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def save_results(name: str, result: dict, write_markdown: Callable[[Path, dict], None]) -> Path:
    """Write `results/<name>.json` and, through `write_markdown(path, result)`, `results/<name>.md`; returns the .md."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    markdown = RESULTS / f"{name}.md"
    write_markdown(markdown, result)
    return markdown

