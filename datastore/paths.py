"""Cache locations: everything lives under $RETROSPEC_CACHE (default ~/.cache/retrospec)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("RETROSPEC_CACHE") or Path.home() / ".cache" / "retrospec")


def default_model_dir() -> Path:
    """Where `retrospec model prepare` puts the default model (and its tokenizer.json)."""
    return cache_dir() / "models" / "default"


def default_datastore_dir() -> Path:
    """Where `build-datastore --preset default` writes the default datastore."""
    return cache_dir() / "datastores" / "default"
