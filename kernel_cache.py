"""numba's on-disk cache of retrospec's kernels, kept fresh when a file a kernel's module imports changes.

numba stamps a cached function with its own source file's hash (and keys it on its bytecode and closure). A kernel
compiled together with functions from another file carries their code in its cache entry, so after that other file
changes, the entry still loads, with the old code in it. The compiled forward (`cpu_forward._decoder_layers`) links
the linear kernels of `cpu_kernels.py`: after 9fecc99 changed their passes for two and three rows, a checkout whose
cache predated it kept running the old ones in every verify step (one node cost 1.07-1.09x a plain step, against
1.02x compiled afresh), and nothing said so. A wheel's upgrade rewrites every file, but a checkout that pulls or
switches branches rewrites only the changed ones.

Here, a function defined in one of our packages is stamped with its file and every file of ours that file imports,
directly or not (its import statements, read with `ast`: any import of one of our modules, wherever it sits in the
file), so a change to any of them recompiles it. The cache stays where numba puts it (the package's __pycache__, or
NUMBA_CACHE_DIR). Each package's `__init__` imports this module before defining any kernel: numba picks a function's
locator when its decorator runs.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import os
from pathlib import Path

from numba.core import caching

ROOT = Path(__file__).resolve().parent
PACKAGES = ("datastore", "drafter", "trt_engines", "orchestrator", "tools")
_tracked: dict[Path, frozenset[str]] = {ROOT: frozenset(PACKAGES)}


def track(root: Path | str, packages: tuple[str, ...]) -> None:
    """Also stamp the kernels of `packages` under `root` by their imports (tests; another project's packages)."""
    _tracked[Path(root).resolve()] = frozenset(packages)


def _root_of(path: Path) -> Path | None:
    """The tracked root that holds `path` in one of its packages, or None."""
    for root, packages in _tracked.items():
        try:
            parts = path.relative_to(root).parts
        except ValueError:
            continue
        if len(parts) > 1 and parts[0] in packages:
            return root
    return None


def _module_file(root: Path, dotted: str) -> Path | None:
    """The file of module `dotted` under `root` (a module or a package's __init__), or None."""
    base = root.joinpath(*dotted.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


@functools.lru_cache(maxsize=None)
def _imported_files(path: Path, mtime_ns: int, size: int) -> frozenset[Path]:
    """Our files that `path` imports directly (keyed on its stamp, so an edit in a running process re-reads it)."""
    root = _root_of(path)
    tree = ast.parse(path.read_bytes(), filename=str(path))
    package = ".".join(path.relative_to(root).parts[:-1])  # of a module, or of a package's __init__: itself
    found: set[Path] = set()

    def add(dotted: str) -> None:
        if dotted.split(".")[0] in _tracked[root]:
            target = _module_file(root, dotted)
            if target is not None:
                found.add(target)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the package `level - 1` levels above this module's
                parts = package.split(".") if package else []
                parts = parts[: len(parts) - (node.level - 1)]
                module = ".".join(parts + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            add(module)
            for alias in node.names:  # `from package import module` imports a module too
                add(f"{module}.{alias.name}")
    found.discard(path)
    return frozenset(found)


def _stat_key(path: Path) -> tuple[Path, int, int]:
    st = os.stat(path)
    return path, st.st_mtime_ns, st.st_size


@functools.lru_cache(maxsize=None)
def _file_hash(path: Path, mtime_ns: int, size: int) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def source_stamp(path: Path | str) -> tuple[tuple[str, str], ...]:
    """(file, sha256) of `path` and of every file of ours it imports, transitively, sorted by file."""
    start = Path(path).resolve()
    root = _root_of(start)
    seen = {start}
    todo = [start]
    while todo:
        for imported in _imported_files(*_stat_key(todo.pop())):
            if imported not in seen:
                seen.add(imported)
                todo.append(imported)
    return tuple(sorted((str(p.relative_to(root)), _file_hash(*_stat_key(p))) for p in seen))


class ImportsStampLocator(caching._CacheLocator):
    """numba's own locator for a function of ours, stamped by `source_stamp` instead of its file alone."""

    def __init__(self, inner: caching._CacheLocator, py_file: str) -> None:
        self._inner = inner
        self._py_file = py_file

    def ensure_cache_path(self) -> None:
        self._inner.ensure_cache_path()

    def get_cache_path(self) -> str:
        return self._inner.get_cache_path()

    def get_source_stamp(self):
        return source_stamp(self._py_file)

    def get_disambiguator(self) -> str:
        return self._inner.get_disambiguator()

    @classmethod
    def from_function(cls, py_func, py_file):
        if not os.path.isfile(py_file) or _root_of(Path(py_file).resolve()) is None:
            return None
        for other in _LOCATORS:
            if other is not cls:
                inner = other.from_function(py_func, py_file)
                if inner is not None:
                    return cls(inner, py_file)
        return None


_CACHE_IMPL = getattr(caching, "CacheImpl", None) or caching._CacheImpl  # `_CacheImpl` in older numba
_LOCATORS = _CACHE_IMPL._locator_classes  # the list numba's caches read (shared by its subclasses)
if ImportsStampLocator not in _LOCATORS:
    _LOCATORS.insert(0, ImportsStampLocator)
