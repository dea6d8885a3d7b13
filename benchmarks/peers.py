"""Peer drafters for side-by-side benchmarks, behind the same lifecycle API as `drafter.Drafter`:
`start_request(id, prompt_ids)`, `extend(id, accepted_ids)`, `stop_request(id)`, `draft([(id, budget), ...])`.

- `PromptLookupDrafter`: prompt lookup decoding with vLLM v1 `NgramProposer` semantics: n from `max_n` down to
  `min_n`, the longest suffix n-gram that occurs earlier in prompt + output, its *earliest* occurrence (or the most
  recent one with `most_recent=True`), then the next `budget` tokens as one linear draft.
- `RestRulesDrafter`: REST's retrieval rules, REIMPLEMENTED on our datastore (REST's own DraftRetriever is not on
  PyPI): the longest suffix from 16 down to 2 tokens that occurs, the first such length only, up to 5,000
  continuations of 10 tokens, a count trie, and the `budget` most frequent nodes. One deliberate difference: when more
  than 5,000 matches exist we take 5,000 evenly spaced over the suffix-array range (our datastore's sampling) where
  REST takes the first 5,000; even spacing keeps the distribution, so this favours REST.
- `AdedDrafter`: ADED's trigram retriever through the PyPI package `draftretriever` (third-party code, unchanged):
  one `add_entry` per datastore document, `search(context, choices=budget)` (choices=2 cut to 1 node at B=1, where
  the package panics on some contexts).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numba import njit

from drafter.tree import SOURCE_DATASTORE, SOURCE_INPUT, DraftTree


class _ContextStore:
    """Per-request token buffers (prompt + accepted output), the only state the peers need."""

    def __init__(self) -> None:
        self._tokens: dict[object, list[np.ndarray]] = {}

    def start_request(self, request_id, prompt_ids) -> None:
        if request_id in self._tokens:
            raise ValueError(f"request {request_id!r} already started")
        self._tokens[request_id] = [np.asarray(prompt_ids, dtype=np.int32)]

    def extend(self, request_id, accepted_ids) -> None:
        self._chunks(request_id).append(np.asarray(accepted_ids, dtype=np.int32))

    def stop_request(self, request_id) -> None:
        self._chunks(request_id)
        del self._tokens[request_id]

    def context(self, request_id) -> np.ndarray:
        chunks = self._chunks(request_id)
        if len(chunks) > 1:  # amortised: concatenate once per step, keep one chunk
            chunks[:] = [np.concatenate(chunks)]
        return chunks[0]

    def _chunks(self, request_id) -> list[np.ndarray]:
        try:
            return self._tokens[request_id]
        except KeyError:
            raise ValueError(f"unknown request {request_id!r}: call start_request first") from None


@njit(cache=True)
def _prompt_lookup(tokens, min_n, max_n, k, most_recent):
    """Tokens following the longest (max_n..min_n) suffix n-gram's earliest (or latest) earlier occurrence."""
    length = tokens.shape[0]
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        last = length - n  # the suffix itself starts here and must not match itself
        start, stop, step = (last - 1, -1, -1) if most_recent else (0, last, 1)
        for i in range(start, stop, step):
            match = True
            for j in range(n):
                if tokens[i + j] != tokens[last + j]:
                    match = False
                    break
            if match:
                end = min(i + n + k, length)
                return tokens[i + n : end].copy()
    return np.empty(0, dtype=tokens.dtype)


class PromptLookupDrafter(_ContextStore):
    def __init__(self, *, min_n: int = 1, max_n: int = 4, most_recent: bool = False) -> None:
        super().__init__()
        self.min_n, self.max_n, self.most_recent = min_n, max_n, most_recent
        self.name = "pld-recent" if most_recent else "pld"
        _prompt_lookup(np.arange(8, dtype=np.int32), min_n, max_n, 2, most_recent)  # compile before timing

    def draft(self, batch: Sequence[tuple[object, int]]) -> list[DraftTree]:
        trees = []
        for request_id, budget in batch:
            tokens = _prompt_lookup(self.context(request_id), self.min_n, self.max_n, budget, self.most_recent)
            trees.append(DraftTree.chain(tokens) if budget > 0 else DraftTree.empty())
        return trees


@njit(cache=True)
def _count_trie_of_sorted_rows(rows):
    """Count trie of lexicographically sorted rows (-1 = end): (token, parent, depth, count) per node."""
    n_rows, length = rows.shape
    cap = n_rows * length
    token = np.empty(cap, np.int32)
    parent = np.empty(cap, np.int64)
    depth = np.empty(cap, np.int32)
    count = np.zeros(cap, np.int64)
    path = np.full(length, -1, np.int64)  # node ids along the previous row
    n = 0
    for r in range(n_rows):
        shared = 0  # rows are sorted, so a shared prefix with the previous row means shared nodes
        if r > 0:
            while shared < length and rows[r, shared] >= 0 and rows[r, shared] == rows[r - 1, shared]:
                shared += 1
        for d in range(length):
            if rows[r, d] < 0:
                break
            if d >= shared:
                token[n] = rows[r, d]
                parent[n] = path[d - 1] if d > 0 else -1
                depth[n] = d + 1
                path[d] = n
                n += 1
            count[path[d]] += 1
    return token[:n], parent[:n], depth[:n], count[:n]


def tree_from_rows(rows: np.ndarray, budget: int, *, source: int) -> DraftTree:
    """The `budget` most frequent nodes of the count trie of `rows` (int32 [R, L], -1 padded at the end).

    Counts never grow along a path, and ties go to the shallower node, so the top-`budget` set always contains
    every selected node's parent. probs = path count / number of rows.
    """
    rows = np.asarray(rows, dtype=np.int32)
    if budget <= 0 or rows.size == 0:
        return DraftTree.empty()
    # Any lexicographic order puts rows with a common prefix next to each other, which is all the trie needs:
    # sorting the rows as raw bytes is that, and far cheaper than a lexsort over columns.
    rows = np.ascontiguousarray(rows)
    rows = rows[np.argsort(rows.view(np.dtype((np.void, rows.shape[1] * 4))).ravel(), kind="stable")]
    tokens, parents, depths, counts = _count_trie_of_sorted_rows(rows)
    order = np.lexsort((depths, -counts))[:budget]  # most frequent first, shallower first on ties
    order = order[np.argsort(depths[order], kind="stable")]  # parents before children
    new_index = np.full(tokens.shape[0], -1, np.int64)
    new_index[order] = np.arange(order.shape[0])
    new_parents = np.where(parents[order] >= 0, new_index[np.maximum(parents[order], 0)], -1)
    return DraftTree.from_arrays(
        tokens=tokens[order],
        parents=new_parents,
        probs=counts[order] / rows.shape[0],
        source=np.full(order.shape[0], source),
    )


class RestRulesDrafter(_ContextStore):
    """REST's rules on our datastore (a labelled reimplementation; see the module docstring)."""

    name = "rest-rules"

    def __init__(self, datastore, *, max_suffix: int = 16, min_suffix: int = 2, max_matches: int = 5000,
                 length: int = 10) -> None:
        super().__init__()
        self.datastore = datastore
        self.max_suffix, self.min_suffix = max_suffix, min_suffix
        self.max_matches, self.length = max_matches, length

    def draft(self, batch: Sequence[tuple[object, int]]) -> list[DraftTree]:
        trees = []
        for request_id, budget in batch:
            context = self.context(request_id)
            lengths = list(range(min(self.max_suffix, context.shape[0]), self.min_suffix - 1, -1))
            counts = self.datastore.count_batch([context[-n:] for n in lengths]) if lengths else []
            hit = next((n for n, c in zip(lengths, counts) if c > 0), None)
            if hit is None or budget <= 0:
                trees.append(DraftTree.empty())
                continue
            rows = self.datastore.continuations(context[-hit:], self.max_matches, self.length)
            trees.append(tree_from_rows(rows, budget, source=SOURCE_DATASTORE))
        return trees


class AdedDrafter(_ContextStore):
    """ADED's retriever (PyPI `draftretriever`) over an index built with one entry per document."""

    name = "aded"

    def __init__(self, index_path: str, *, query_tokens: int = 16) -> None:
        import draftretriever

        super().__init__()
        self.reader = draftretriever.Reader(str(index_path))
        self.query_tokens = query_tokens

    @staticmethod
    def build_index(index_path: str, documents, vocab_size: int) -> None:
        import draftretriever

        writer = draftretriever.Writer(str(index_path), vocab_size)
        for doc in documents:
            writer.add_entry([int(t) for t in doc])
        writer.finalize()

    def draft(self, batch: Sequence[tuple[object, int]]) -> list[DraftTree]:
        trees = []
        for request_id, budget in batch:
            if budget <= 0:
                trees.append(DraftTree.empty())
                continue
            context = self.context(request_id)[-self.query_tokens :]
            # draftretriever 0.1.1 panics (aborting the process) on some contexts with choices=1, so B=1 asks for
            # 2 nodes and keeps the more frequent one.
            paths = self.reader.search([int(t) for t in context], choices=max(budget, 2))[0]
            rows = np.asarray(paths, dtype=np.int32) if paths else np.empty((0, 1), np.int32)
            rows[rows < 0] = -1  # draftretriever pads with -2
            trees.append(tree_from_rows(rows, budget, source=SOURCE_DATASTORE))
        return trees


__all__ = ["PromptLookupDrafter", "RestRulesDrafter", "AdedDrafter", "tree_from_rows", "SOURCE_INPUT"]
