"""orchestrator.acceptance.accept against a brute-force reference (enumerate every root path)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from drafter.tree import DraftTree
from orchestrator.acceptance import accept


def _brute_force(tree: DraftTree, target: np.ndarray) -> tuple[list[int], int]:
    """Enumerate every root path; keep the one where each node is its parent's FIRST child carrying the target's
    token and no child of the last node carries it (first, not longest: see `accept` on why that stays lossless)."""
    n = len(tree)

    def first_match(parent: int) -> int | None:
        kids = [j for j in range(n) if tree.parents[j] == parent and tree.tokens[j] == target[parent + 1]]
        return kids[0] if kids else None

    candidates = [[]] + [tree.path_to(i).tolist() for i in range(n)]
    found = []
    for path in candidates:
        parents = [-1] + path[:-1]
        if all(first_match(p) == node for p, node in zip(parents, path)) and first_match(path[-1] if path else -1) is None:
            found.append(path)
    assert len(found) == 1, found
    last = found[0][-1] if found[0] else -1
    return found[0], int(target[last + 1])


@st.composite
def trees_and_targets(draw):
    n = draw(st.integers(0, 12))
    parents = [draw(st.integers(-1, i - 1)) for i in range(n)]
    tokens = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))  # tiny vocab: many matches and duplicates
    target = draw(st.lists(st.integers(0, 3), min_size=n + 1, max_size=n + 1))
    return DraftTree.from_arrays(tokens=tokens, parents=parents), np.asarray(target)


@settings(max_examples=300, deadline=None)
@given(trees_and_targets())
def test_accept_matches_brute_force(case):
    tree, target = case
    acc = accept(tree, target)
    path, bonus = _brute_force(tree, target)
    assert acc.accepted_nodes.tolist() == path
    assert acc.bonus_token == bonus
    assert acc.new_tokens.tolist() == tree.tokens[path].tolist() + [bonus]
    assert acc.new_tokens.dtype == np.int32 and acc.accepted_nodes.dtype == np.int32
    assert tree.accepted_path(target).tolist() == path  # the walk engines use for per-token data: the same nodes


def test_docstring_example():
    cat, sat, ran, dog, dot = 10, 11, 12, 13, 14
    tree = DraftTree.from_arrays(tokens=[cat, sat, ran, dog], parents=[-1, 0, 0, -1])
    acc = accept(tree, [cat, ran, dot, dot, dot])
    assert acc.accepted_nodes.tolist() == [0, 2]
    assert acc.bonus_token == dot and acc.new_tokens.tolist() == [cat, ran, dot]


def test_empty_tree_gives_only_the_bonus():
    acc = accept(DraftTree.empty(), [7])
    assert acc.num_accepted == 0 and acc.new_tokens.tolist() == [7]


def test_wrong_target_length_is_rejected():
    with pytest.raises(ValueError, match="needs 3"):
        accept(DraftTree.chain([1, 2]), [1, 2])
    with pytest.raises(ValueError, match="needs 3"):  # the compiled walk reads without bounds checks: never short
        DraftTree.chain([1, 2]).accepted_path(np.array([1, 2]))
