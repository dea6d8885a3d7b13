"""`DraftTree`: the only object the drafter and the target engines share.

A draft tree hangs below the *root*, which is the last accepted token (already in the KV cache, or about to be
written by this step). Nodes are stored flat, in topological order (every parent comes before its children):

    tokens[i]   int32    token id proposed at node i
    parents[i]  int32    index of the parent node, or -1 for children of the root
    probs[i]    float32  calibrated probability that the whole root->i path is accepted
    depth[i]    int32    1 for children of the root, parent's depth + 1 otherwise
    source[i]   int16    which candidate source created the node (SOURCE_INPUT, or SOURCE_DATASTORE + k)

Example: root "the" with drafts "cat sat" and "cat ran" and "dog":

    index   0      1      2      3
    tokens  cat    sat    ran    dog
    parents -1     0      0      -1
    depth   1      2      2      1

Verification feeds [root, tokens...] with positions `ctx_len - 1 + [0, depth...]` and a mask in which each node
sees the cached context, the root, its ancestors and itself (`attention_mask`). The sum of `probs` + 1 predicts the
tokens a step yields (accepted nodes + the bonus token): the orchestrator budgets with that number.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba as nb
import numpy as np

SOURCE_INPUT = 0  # prompt + self-output index of the request
SOURCE_DATASTORE = 1  # datastore k (0-based) is SOURCE_DATASTORE + k


class InvalidTreeError(ValueError):
    """The arrays do not describe a tree (bad parent index, cycle, inconsistent depth or lengths)."""


@dataclass(frozen=True, eq=False)
class DraftTree:
    tokens: np.ndarray  # int32 [n]
    parents: np.ndarray  # int32 [n]
    probs: np.ndarray  # float32 [n]
    depth: np.ndarray  # int32 [n]
    source: np.ndarray  # int16 [n]

    @classmethod
    def empty(cls) -> "DraftTree":
        """The tree of no nodes: one shared, read-only instance (a step that speculates on nothing gives every request
        one, and building it cost ~27 us: ~0.4 ms of a plain batch-16 step on the CPU)."""
        return _EMPTY_TREE

    @classmethod
    def from_arrays(cls, *, tokens, parents, probs=None, source=None) -> "DraftTree":
        """Build and validate a tree; `depth` is derived, `probs` default to 1 and `source` to SOURCE_INPUT."""
        tokens = np.ascontiguousarray(tokens, dtype=np.int32).reshape(-1)
        parents = np.ascontiguousarray(parents, dtype=np.int32).reshape(-1)
        n = tokens.shape[0]
        probs = np.ones(n, np.float32) if probs is None else np.ascontiguousarray(probs, dtype=np.float32).reshape(-1)
        source = (
            np.full(n, SOURCE_INPUT, np.int16) if source is None else np.ascontiguousarray(source, np.int16).reshape(-1)
        )
        if not (parents.shape[0] == probs.shape[0] == source.shape[0] == n):
            raise InvalidTreeError(
                f"tree arrays differ in length: tokens {n}, parents {parents.shape[0]}, probs {probs.shape[0]}, "
                f"source {source.shape[0]}"
            )
        bad = np.nonzero((parents < -1) | (parents >= np.arange(n)))[0]
        if bad.size:
            i = int(bad[0])
            raise InvalidTreeError(
                f"node {i} has parent {int(parents[i])}: a parent must be -1 (the root) or an earlier node index "
                "(nodes are stored parents-first, which also rules out cycles)"
            )
        depth = np.empty(n, np.int32)
        for i in range(n):  # O(n) and n is a per-request node budget (tens), not a token stream
            depth[i] = 1 if parents[i] < 0 else depth[parents[i]] + 1
        return cls(tokens=tokens, parents=parents, probs=probs, depth=depth, source=source)

    @classmethod
    def chain(cls, tokens, probs=None) -> "DraftTree":
        """A linear draft (each node the child of the previous one)."""
        n = len(tokens)
        return cls.from_arrays(tokens=tokens, parents=np.arange(-1, n - 1), probs=probs)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def prefix(self, n: int) -> "DraftTree":
        """The first `n` nodes: in a parents-first tree a prefix is itself a tree (no remapping, no checks)."""
        return DraftTree(tokens=self.tokens[:n], parents=self.parents[:n], probs=self.probs[:n], depth=self.depth[:n],
                         source=self.source[:n])

    def subtree(self, keep: np.ndarray) -> "DraftTree":
        """The nodes `keep` (closed under ancestors, every parent listed before its children: increasing indices, or
        `depth_first_order()`), re-indexed in that order. Depths carry over, so no per-node pass is needed (the budget
        controller prunes every request's tree every step)."""
        keep = np.asarray(keep, dtype=np.int64)
        remap = np.full(len(self), -1, np.int32)
        remap[keep] = np.arange(keep.size, dtype=np.int32)
        parents = self.parents[keep]
        new_parents = np.where(parents >= 0, remap[np.maximum(parents, 0)], -1).astype(np.int32)
        if np.any((parents >= 0) & (new_parents < 0)):
            raise InvalidTreeError("subtree: a kept node's parent was not kept")
        return DraftTree(tokens=self.tokens[keep], parents=new_parents, probs=self.probs[keep],
                         depth=self.depth[keep], source=self.source[keep])

    def depth_first_order(self) -> np.ndarray:
        """int64 [n]: the nodes in depth-first preorder, children in index order (most probable first). In this
        order the path that always follows the first child is contiguous from the start, and every other root path
        is contiguous up to where it leaves that one: engines lay out tree slots this way (see `TorchEngine.verify`,
        which calls this for every request of every step: a compiled stack walk)."""
        return _depth_first_order(self.parents)

    @property
    def expected_accepted(self) -> float:
        """Calibrated expected number of accepted draft tokens (excluding the bonus token)."""
        return float(self.probs.sum(dtype=np.float64))

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise InvalidTreeError unless the arrays form a parents-first tree with consistent depth and token ids."""
        n = len(self)
        for name in ("parents", "probs", "depth", "source"):
            if getattr(self, name).shape != (n,):
                raise InvalidTreeError(f"`{name}` has shape {getattr(self, name).shape}, expected ({n},)")
        if self.tokens.shape != (n,):  # the compiled checks read 1-D tokens
            raise InvalidTreeError(f"`tokens` has shape {self.tokens.shape}, expected ({n},)")
        problem, i = _first_invalid_node(self.parents, self.depth, self.tokens, -1 if vocab_size is None else vocab_size)
        if problem == _BAD_PARENT:
            raise InvalidTreeError(f"node {i} has parent {int(self.parents[i])}; expected -1 or an index below {i}")
        if problem == _BAD_DEPTH:
            parent_depth = 0 if self.parents[i] < 0 else int(self.depth[self.parents[i]])
            raise InvalidTreeError(f"node {i} has depth {int(self.depth[i])}, its parent's depth + 1 is {parent_depth + 1}")
        if problem == _BAD_TOKEN:
            raise InvalidTreeError(f"tree token ids must lie in [0, {vocab_size}); got {self.tokens.min()}..{self.tokens.max()}")

    def ancestor_mask(self) -> np.ndarray:
        """bool [n, n]: mask[i, j] is True when node j is node i or one of its ancestors."""
        n = len(self)
        mask = np.zeros((n, n), dtype=bool)
        for i in range(n):  # parents-first order: a node's row is its parent's row plus itself
            p = self.parents[i]
            if p >= 0:
                mask[i] = mask[p]
            mask[i, i] = True
        return mask

    def attention_mask(self) -> np.ndarray:
        """bool [n+1, n+1] over [root, nodes...]: every row sees the root, nodes also see their ancestors and self."""
        n = len(self)
        mask = np.zeros((n + 1, n + 1), dtype=bool)
        mask[:, 0] = True
        mask[1:, 1:] = self.ancestor_mask()
        return mask

    def position_offsets(self) -> np.ndarray:
        """int32 [n+1]: offsets from the root's position for [root, nodes...]."""
        return np.concatenate([np.zeros(1, np.int32), self.depth])

    def best_path(self, max_len: int | None = None) -> "DraftTree":
        """The linear draft with the most expected accepted tokens: the root-to-node path (at most `max_len` deep)
        maximising the sum of its nodes' path probabilities. Linear-draft engines (TensorRT-LLM's external draft
        tokens) verify this instead of the whole tree."""
        if len(self) == 0 or max_len == 0:
            return DraftTree.empty()
        gain = np.zeros(len(self), np.float64)
        for i in range(len(self)):  # parents-first: a node's path gain is its parent's plus its own probability
            gain[i] = self.probs[i] + (gain[self.parents[i]] if self.parents[i] >= 0 else 0.0)
        if max_len is not None:
            gain[self.depth > max_len] = -1.0
        path = self.path_to(int(np.argmax(gain)))  # first maximum: the shallowest of equal gains
        return DraftTree.from_arrays(tokens=self.tokens[path], parents=np.arange(-1, len(path) - 1),
                                     probs=self.probs[path], source=self.source[path])

    def best_path_nodes(self, max_len: int | None = None, *, below: int = -1) -> np.ndarray:
        """Node indices of the linear draft `best_path` returns (int32 [k], root's child first), or of the best
        path in the subtree under node `below` (excluded) when `below >= 0`; depth and gain then count from it.

        This is the tree -> linear-draft reduction linear-draft engines use (TensorRT-LLM's external draft tokens
        take one token list per request): the path maximising the sum of its nodes' calibrated path-acceptance
        probabilities, i.e. the expected accepted tokens of a linear draft, at most `max_len` nodes long. Ties go
        to the lowest node index (parents-first order, so a node beats its zero-probability children). Keeping the
        indices lets an engine map a path's verification back onto the tree (`tokens[nodes]` == the path).

        Example: tokens [a, b, c, d], parents [-1, 0, -1, 2], probs [0.9, 0.2, 0.6, 0.55]:
            best_path_nodes() -> [2, 3] (0.6 + 0.55 > 0.9 + 0.2);  best_path_nodes(1) -> [0];  (below=0) -> [1]
        """
        n = len(self)
        if not -1 <= below < n:
            raise ValueError(f"below must be -1 (the root) or a node index in [0, {n}); got {below}")
        if n == 0 or max_len == 0:
            return np.zeros(0, np.int32)
        if max_len is not None and max_len < 0:
            raise ValueError(f"max_len must be None or >= 0; got {max_len}")
        gain = np.zeros(n, np.float64)
        inside = np.zeros(n, bool)  # strict descendants of `below`
        for i in range(n):  # parents-first: a node's values follow from its parent's
            p = int(self.parents[i])
            inside[i] = p == below or (p >= 0 and inside[p])
            gain[i] = self.probs[i] + (gain[p] if p >= 0 else 0.0)
        base_gain = gain[below] if below >= 0 else 0.0
        base_depth = int(self.depth[below]) if below >= 0 else 0
        ok = inside if max_len is None else inside & (self.depth - base_depth <= max_len)
        if not ok.any():
            return np.zeros(0, np.int32)
        score = np.where(ok, gain - base_gain, -np.inf)
        path = self.path_to(int(np.argmax(score)))  # first maximum: the lowest index among equal gains
        return path[base_depth:]  # drop `below` and its ancestors (the first base_depth nodes of the path)

    def accepted_path(self, target_tokens: np.ndarray) -> np.ndarray:
        """The nodes verification accepts (int32 [a], the root's child first): from the root, the first child whose
        token equals the target's choice at the current position (`target_tokens[0]` after the root, `[i + 1]` after
        node i), until no child does. The orchestrator's acceptance and an engine that returns per-token data for the
        tokens a step yields (log probabilities) both walk it here, so they cannot disagree.

        Duplicate siblings: always the first, never "whichever continues longest". Under sampling each node's target
        token is an independent draw; choosing a branch by its later draws would bias the output."""
        target = np.asarray(target_tokens, dtype=np.int64).reshape(-1)
        if target.shape[0] < len(self) + 1:
            raise ValueError(f"target_tokens has {target.shape[0]} entries; a tree of {len(self)} nodes needs "
                             f"{len(self) + 1} (root + nodes)")
        return accept_walk(self.parents, self.tokens, target)[0]

    def path_to(self, node: int) -> np.ndarray:
        """Node indices from the root's child down to `node` (inclusive)."""
        path = []
        while node >= 0:
            path.append(node)
            node = int(self.parents[node])
        return np.asarray(path[::-1], dtype=np.int32)


def _read_only_empty_tree() -> DraftTree:
    tree = DraftTree.from_arrays(tokens=[], parents=[])
    for array in (tree.tokens, tree.parents, tree.probs, tree.depth, tree.source):
        array.flags.writeable = False
    return tree


_EMPTY_TREE = _read_only_empty_tree()


_BAD_PARENT, _BAD_DEPTH, _BAD_TOKEN = 1, 2, 3


@nb.njit(cache=True)
def _first_invalid_node(parents: np.ndarray, depth: np.ndarray, tokens: np.ndarray, vocab_size: int) -> tuple[int, int]:
    """`DraftTree.validate`'s checks in its order (every parent, then every depth, then every token; vocab_size < 0:
    no token check): (0, -1) for a valid tree, else (the problem, the first node with it). Compiled because every
    engine validates every request's tree every step: in numpy that cost 12.9 us for an empty tree and 18.2 us for a
    chain of 8 (2-core Zen 4 EPYC, `zen4_oneoffs.txt` §8), 0.2 ms for the 16 trees of a batch-16 plain step."""
    n = parents.shape[0]
    for i in range(n):
        if parents[i] < -1 or parents[i] >= i:
            return _BAD_PARENT, i
    for i in range(n):
        if depth[i] != (0 if parents[i] < 0 else depth[parents[i]]) + 1:
            return _BAD_DEPTH, i
    if vocab_size >= 0:
        for i in range(n):
            if tokens[i] < 0 or tokens[i] >= vocab_size:
                return _BAD_TOKEN, i
    return 0, -1


@nb.njit(cache=True, boundscheck=False)
def accept_walk(parents: np.ndarray, tokens: np.ndarray, target: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`DraftTree.accepted_path` (int32 [a]) and the tokens the step yields (int32 [a + 1]: the accepted nodes' tokens,
    then the target's token after the last of them, the bonus). One compiled walk: it runs for every request of every
    step, where a numpy pass over the tree per accepted token cost 4.7 us for an empty tree and 16.3 us for a chain
    of 8 with 3 accepted (2-core Zen 4 EPYC, `zen4_oneoffs.txt` §8). Parents come before their children, so a node's
    children lie after it."""
    n = parents.shape[0]
    path = np.empty(n, np.int32)
    accepted = 0
    current = -1  # the root
    while True:
        want = target[current + 1]
        child = -1
        for i in range(current + 1, n):
            if parents[i] == current and tokens[i] == want:
                child = i
                break
        if child < 0:
            break
        path[accepted] = child
        accepted += 1
        current = child
    new_tokens = np.empty(accepted + 1, np.int32)
    for j in range(accepted):
        new_tokens[j] = tokens[path[j]]
    new_tokens[accepted] = target[current + 1]
    return path[:accepted].copy(), new_tokens


@nb.njit(cache=True)
def _depth_first_order(parents: np.ndarray) -> np.ndarray:
    n = parents.shape[0]
    # children of the root (slot 0) and of node i (slot i + 1), in index order: counting sort by parent
    starts = np.zeros(n + 2, np.int64)
    for i in range(n):
        starts[parents[i] + 2] += 1
    for i in range(1, n + 2):
        starts[i] += starts[i - 1]
    children = np.empty(n, np.int64)
    fill = starts[:-1].copy()
    for i in range(n):
        children[fill[parents[i] + 1]] = i
        fill[parents[i] + 1] += 1
    order = np.empty(n, np.int64)
    stack = np.empty(n, np.int64)
    top = 0
    for c in range(starts[1] - 1, starts[0] - 1, -1):  # push in reverse so the first child pops first
        stack[top] = children[c]
        top += 1
    k = 0
    while top > 0:
        top -= 1
        node = stack[top]
        order[k] = node
        k += 1
        for c in range(starts[node + 2] - 1, starts[node + 1] - 1, -1):
            stack[top] = children[c]
            top += 1
    return order
