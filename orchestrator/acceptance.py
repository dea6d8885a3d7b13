"""Lossless acceptance: which draft nodes the target agrees with, and the bonus token.

Walk the tree from the root: at the current position the target chose `target_tokens[pos]`; if a child of the
current node carries that token, accept it and move there; otherwise stop. The target's token at the last accepted
position is the bonus token (always produced, so a step yields accepted + 1 tokens). With greedy targets this
reproduces plain greedy decoding exactly; with sampled targets each position's token is a draw from the target, so
the output keeps the target's distribution.

Example: tree tokens [cat, sat, ran, dog], parents [-1, 0, 0, -1]; target_tokens (root, then per node)
[cat, ran, ., ., .]:
    root: target says "cat"  -> node 0 (cat) accepted
    node 0: target says "ran" -> node 2 (ran) accepted
    node 2: target says "."   -> no child; bonus "."
    accepted_nodes [0, 2], bonus ".", new_tokens [cat, ran, .]
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from drafter.tree import DraftTree, accept_walk


@dataclass(frozen=True)
class Acceptance:
    accepted_nodes: np.ndarray  # int32 [a]: root-to-leaf path of accepted node indices
    bonus_token: int  # target token at the last accepted position (the next root)
    new_tokens: np.ndarray  # int32 [a + 1]: accepted tokens then the bonus token

    @property
    def num_accepted(self) -> int:
        return int(self.accepted_nodes.shape[0])


def accept(tree: DraftTree, target_tokens) -> Acceptance:
    """Longest root path whose tokens equal the target's choices, plus the bonus token (see module docstring)."""
    target = np.asarray(target_tokens).reshape(-1)
    n = len(tree)
    if target.shape[0] != n + 1:
        raise ValueError(f"target_tokens has {target.shape[0]} entries; a tree of {n} nodes needs {n + 1} (root + nodes)")
    accepted, new_tokens = accept_walk(tree.parents, tree.tokens, np.asarray(target, dtype=np.int64))
    return Acceptance(accepted_nodes=accepted, bonus_token=int(new_tokens[-1]), new_tokens=new_tokens)
