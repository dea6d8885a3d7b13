"""drafter.tree.DraftTree: validation, masks, positions, paths (brute-force references)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from drafter.tree import DraftTree, InvalidTreeError


@st.composite
def trees(draw):
    n = draw(st.integers(0, 15))
    parents = [draw(st.integers(-1, i - 1)) for i in range(n)]
    tokens = draw(st.lists(st.integers(0, 50), min_size=n, max_size=n))
    return DraftTree.from_arrays(tokens=tokens, parents=parents)


def _ancestors_or_self(tree: DraftTree, i: int) -> set[int]:
    out = set()
    while i >= 0:
        out.add(i)
        i = int(tree.parents[i])
    return out


@settings(max_examples=100, deadline=None)
@given(trees())
def test_masks_positions_and_paths_match_definitions(tree):
    n = len(tree)
    tree.validate(vocab_size=51)
    mask = tree.attention_mask()
    assert mask.shape == (n + 1, n + 1) and mask[:, 0].all()
    for i in range(n):
        anc = _ancestors_or_self(tree, i)
        assert {j for j in range(n) if mask[i + 1, j + 1]} == anc
        assert tree.depth[i] == len(anc)
        assert tree.path_to(i).tolist() == sorted(anc)  # parents-first: ancestors have smaller indices
    assert not mask[0, 1:].any()  # the root sees only itself (and the context)
    assert tree.position_offsets().tolist() == [0] + tree.depth.tolist()


def test_docstring_example():
    tree = DraftTree.from_arrays(tokens=[5, 6, 7, 8], parents=[-1, 0, 0, -1])
    assert tree.depth.tolist() == [1, 2, 2, 1]
    assert tree.position_offsets().tolist() == [0, 1, 2, 2, 1]
    assert tree.path_to(2).tolist() == [0, 2]


def test_chain_and_empty():
    assert DraftTree.chain([3, 4, 5]).parents.tolist() == [-1, 0, 1]
    assert len(DraftTree.empty()) == 0 and DraftTree.empty().attention_mask().tolist() == [[True]]
    empty = DraftTree.empty()  # one shared instance: nothing may write to it
    for array in (empty.tokens, empty.parents, empty.probs, empty.depth, empty.source):
        with pytest.raises(ValueError, match="read-only"):
            array[...] = 0


@pytest.mark.parametrize("parents", [[0], [-1, 1], [1, 0], [-2]], ids=["self", "self2", "cycle", "below-root"])
def test_not_a_tree_is_rejected(parents):
    with pytest.raises(InvalidTreeError, match="parent"):
        DraftTree.from_arrays(tokens=[1] * len(parents), parents=parents)


def test_validate_catches_hand_built_bad_trees():
    cycle = DraftTree(
        tokens=np.array([1, 2], np.int32), parents=np.array([1, 0], np.int32), probs=np.ones(2, np.float32),
        depth=np.array([2, 1], np.int32), source=np.zeros(2, np.int16),
    )
    with pytest.raises(InvalidTreeError):
        cycle.validate()
    bad_depth = DraftTree(
        tokens=np.array([1, 2], np.int32), parents=np.array([-1, 0], np.int32), probs=np.ones(2, np.float32),
        depth=np.array([1, 3], np.int32), source=np.zeros(2, np.int16),
    )
    with pytest.raises(InvalidTreeError, match="depth"):
        bad_depth.validate()
    with pytest.raises(InvalidTreeError, match="token ids"):
        DraftTree.chain([1, 99]).validate(vocab_size=50)


@st.composite
def hand_built_arrays(draw):
    """Tree arrays as a caller might build them without `from_arrays`: parents, depths and tokens each possibly off."""
    n = draw(st.integers(0, 10))
    parents = draw(st.lists(st.integers(-2, n), min_size=n, max_size=n))
    depth = draw(st.lists(st.integers(0, 4), min_size=n, max_size=n))
    tokens = draw(st.lists(st.integers(-1, 12), min_size=n, max_size=n))
    return parents, depth, tokens


@settings(max_examples=300, deadline=None)
@given(hand_built_arrays())
def test_validate_names_the_first_problem_of_any_arrays(arrays):
    parents, depth, tokens = arrays
    n = len(parents)
    tree = DraftTree(tokens=np.array(tokens, np.int32), parents=np.array(parents, np.int32),
                     probs=np.ones(n, np.float32), depth=np.array(depth, np.int32), source=np.zeros(n, np.int16))
    # the definition, checked in validate's order: every parent, then every depth, then every token id
    bad_parent = [i for i, p in enumerate(parents) if not -1 <= p < i]
    bad_depth = [] if bad_parent else [i for i, p in enumerate(parents) if depth[i] != (depth[p] if p >= 0 else 0) + 1]
    bad_token = [t for t in tokens if not 0 <= t < 10]
    if bad_parent:
        with pytest.raises(InvalidTreeError, match=f"node {bad_parent[0]} has parent"):
            tree.validate(10)
    elif bad_depth:
        with pytest.raises(InvalidTreeError, match=f"node {bad_depth[0]} has depth"):
            tree.validate(10)
    elif bad_token:
        with pytest.raises(InvalidTreeError, match="token ids must lie in"):
            tree.validate(10)
        tree.validate()  # no vocabulary: token ids are not checked
    else:
        tree.validate(10)


def test_best_path_maximises_expected_accepted_tokens():
    # root -> a(0.9) -> b(0.2);  root -> c(0.6) -> d(0.55) -> e(0.5)
    tree = DraftTree.from_arrays(tokens=[10, 11, 12, 13, 14], parents=[-1, 0, -1, 2, 3],
                                 probs=[0.9, 0.2, 0.6, 0.55, 0.5])
    path = tree.best_path()
    assert path.tokens.tolist() == [12, 13, 14] and path.parents.tolist() == [-1, 0, 1]
    assert tree.best_path(max_len=1).tokens.tolist() == [10]
    assert tree.best_path(max_len=2).tokens.tolist() == [12, 13]  # 0.6 + 0.55 > 0.9 + 0.2
    assert len(DraftTree.empty().best_path()) == 0 and len(tree.best_path(max_len=0)) == 0


def test_subtree_keeps_depths_and_refuses_an_orphan():
    tree = DraftTree.from_arrays(tokens=[5, 6, 7, 8, 9], parents=[-1, 0, 1, -1, 3])
    sub = tree.subtree(np.array([0, 1, 3]))
    sub.validate()
    assert sub.tokens.tolist() == [5, 6, 8] and sub.parents.tolist() == [-1, 0, -1] and sub.depth.tolist() == [1, 2, 1]
    with pytest.raises(InvalidTreeError, match="parent was not kept"):
        tree.subtree(np.array([0, 2]))  # node 2's parent (1) is missing


@settings(max_examples=100, deadline=None)
@given(trees())
def test_depth_first_order_is_preorder_with_the_first_child_chain_first(tree):
    order = tree.depth_first_order()
    n = len(tree)
    assert sorted(order.tolist()) == list(range(n))
    laid = tree.subtree(order)
    laid.validate()  # parents before children, depths carried over
    assert np.array_equal(laid.tokens, tree.tokens[order]) and np.array_equal(laid.depth, tree.depth[order])
    # preorder: every node's subtree is one contiguous run right after it
    ancestors = [_ancestors_or_self(laid, j) for j in range(n)]
    for i in range(n):
        inside = [j for j in range(n) if i in ancestors[j]]
        assert inside == list(range(i, i + len(inside)))
    # siblings keep their index order (most probable first), so the first-child chain is the prefix
    chain, node = [], -1
    while True:
        children = np.flatnonzero(tree.parents == node)
        if children.size == 0:
            break
        node = int(children[0])
        chain.append(node)
    assert order[: len(chain)].tolist() == chain
