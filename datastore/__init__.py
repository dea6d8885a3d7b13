"""retrospec datastore: suffix-array retrieval over tokenized corpora (build, on-disk format, prefix search).

Build with the `build-datastore` CLI (`datastore.cli`) or `build_from_token_docs`; query with `Datastore.open`.
"""

import kernel_cache  # noqa: F401  (first: numba's cache of our kernels follows their imports)
from .build import build_from_token_docs
from .errors import DatastoreError
from .store import ContinuationBatch, Datastore

__all__ = ["ContinuationBatch", "Datastore", "DatastoreError", "build_from_token_docs"]
