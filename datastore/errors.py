"""The one exception type of the datastore package."""

from __future__ import annotations


class DatastoreError(ValueError):
    """A datastore cannot be built, opened or queried as asked.

    Every message names the problem (file, line, field, shard or token id) and the fix. It subclasses
    `ValueError` so callers that validate arguments generically still catch a bad query.
    """
