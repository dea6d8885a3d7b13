"""Online recalibration of draft-node probabilities from what verification realized.

The drafter's calibration (`drafter/calibration.py`) maps its scores to path-acceptance probabilities on offline
trajectories. Served traffic drifts from those, and not uniformly:
- by probability: on HumanEval at cap 4, nodes calibrated at 0.6-0.7 were accepted 49% of the time while those at
  0.1-0.3 were on target. One realized/predicted ratio over the chosen nodes (0.7-0.8 there) also shrinks the
  low-probability nodes at the margin, which decide how far speculation goes;
- by depth: a path probability multiplies its edges' calibrated probabilities as if they were independent, and the
  errors compound along the path. On MT-Bench at cap 4, nodes calibrated near 0.4 were accepted 36% of the time at
  depth 1 and 24% at depths 5-7. One map for every depth under-valued the shallow nodes (the wide trees that
  `fixed:4` sends and that paid there) and over-valued the deep chains the controller sent instead.

- by source: the request's own index (prompt + output so far) and retrieval (datastores, the output history of other
  requests) drift apart. On chitchat at cap 4, datastore nodes calibrated at 0.14 were accepted 25% of the time
  while the own-index nodes of the same bins were on target; a request whose drafts came mostly from the
  datastore got one node per step where `fixed:4` got τ 2.3 from four.

So nodes are binned by calibrated probability within a bucket: depth bucket (1, 2, 3, 4-5, 6+) × source (own index,
retrieved). Each cell keeps exponentially
decayed sums of predicted and realized acceptance. Deep buckets see few nodes per bin (at cap 4, about one per step
over all deep bins), so a cell is not read alone: its ratio shrinks, with the weight of `prior_nodes` nodes, toward
the product of its bin's ratio over every bucket and its bucket's factor, which themselves start at 1 (trusting
the calibration). A bucket's map interpolates its bins' corrected rates between their centres. Those rates are made
non-decreasing by pooling adjacent violators weighted by each bin's evidence (an over-confident bin with hundreds of
nodes is not lifted to its empty neighbour's prior). Buckets are not ordered against each other: on the
prompt-grounded set, long chains copied from the prompt are accepted at their calibrated rate while depth-1 guesses
at the same probability miss more. A deep child can thus map above its parent; `tree_values` caps every node at its
parent's value, so that ranking a tree's nodes by value keeps each node's ancestors ahead of it (ties go to the
lower, parents-first, index) and any prefix of the ranking is a tree.
Steps that verify nothing still decay the sums: without evidence the maps drift back to the calibration.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from drafter.calibration import pav

_EDGES = np.array([0.0, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0])
DEPTH_BUCKET_STARTS = np.array([1, 2, 3, 4, 6])  # bucket i holds depths [starts[i], starts[i + 1])
# Pseudo-accepted tokens behind a bucket factor of 1. At 2, a bucket that missed a few times early was discounted
# before it had shown anything: replaying the committed CPU runs through `tools/simulate`, goodput then starved a
# chitchat request whose retrieved drafts beat their calibration (cap 4: 0.92x the best fixed policy); at 10, every
# replayed (set, cap) group was at 0.99x or above (20 and 40 gave the same within 2%).
_BUCKET_PRIOR = 10.0
N_BUCKETS = 2 * DEPTH_BUCKET_STARTS.size  # depth buckets of the request's own index (source 0), then of the rest


def depth_bucket(depths: np.ndarray) -> np.ndarray:
    return np.clip(np.searchsorted(DEPTH_BUCKET_STARTS, depths, side="right") - 1, 0, DEPTH_BUCKET_STARTS.size - 1)


def node_bucket(depths: np.ndarray, sources: np.ndarray | None = None) -> np.ndarray:
    """Cell row of each node: its depth bucket, offset for nodes retrieved from elsewhere than the request's own
    index (datastores, output history). None: every node counts as the request's own."""
    buckets = depth_bucket(np.asarray(depths))
    if sources is None:
        return buckets
    return buckets + DEPTH_BUCKET_STARTS.size * (np.asarray(sources) > 0)


class OnlineRecalibration:
    def __init__(self, *, decay: float = 0.97, prior_nodes: float = 8.0) -> None:
        if not 0.0 < decay <= 1.0 or prior_nodes <= 0:
            raise ValueError(f"decay must be in (0, 1] and prior_nodes > 0 (got {decay}, {prior_nodes})")
        self.decay = decay
        self.centers = (_EDGES[:-1] + _EDGES[1:]) / 2
        self.prior_nodes = prior_nodes
        shape = (N_BUCKETS, self.centers.size)
        self._prior = prior_nodes * self.centers  # a bin's pseudo-predictions (as many realized as predicted)
        self._predicted = np.zeros(shape)
        self._realized = np.zeros(shape)
        self._nodes = np.zeros(shape)
        self._knots_x = np.concatenate([[0.0], self.centers, [1.0]])
        self._knots_y = np.tile(self._knots_x, (shape[0], 1))
        self._stale = False  # the sums changed since the maps were last fitted (`_refit`, on the next use)

    def __call__(self, probs: np.ndarray, depths: np.ndarray, sources: np.ndarray | None = None) -> np.ndarray:
        """Expected acceptance of nodes with these calibrated path probabilities, depths and sources, as recently
        realized."""
        probs = np.asarray(probs, dtype=np.float64)
        buckets = node_bucket(depths, sources)
        out = np.empty_like(probs)
        if self._stale and probs.size:
            self._refit()
        for bucket in np.unique(buckets):
            mask = buckets == bucket
            out[mask] = np.interp(probs[mask], self._knots_x, self._knots_y[bucket])
        return out

    def tree_values(self, probs: np.ndarray, depths: np.ndarray, parents: np.ndarray,
                    sources: np.ndarray | None = None) -> np.ndarray:
        """Recalibrated values of the nodes of trees laid end to end (`parents`: global indices, -1 for a root's
        child, every parent before its children), each capped at its parent's: a path's values never increase."""
        values = self(probs, depths, sources)
        _cap_at_parents(values, np.asarray(parents, dtype=np.int64))
        return values

    @property
    def ratios(self) -> np.ndarray:
        """Realized / predicted acceptance per [bucket, probability bin]. A cell shrinks toward its bin's ratio
        over every bucket times its bucket's factor (its realized over what the bins' ratios expect of it),
        each of those toward 1: a deep bucket sees too few nodes per bin to be read alone."""
        by_bin = (self._realized.sum(axis=0) + self._prior) / (self._predicted.sum(axis=0) + self._prior)
        expected = self._predicted @ by_bin
        bucket_factor = (self._realized.sum(axis=1) + _BUCKET_PRIOR) / (expected + _BUCKET_PRIOR)
        return ((self._realized + self._prior * by_bin * bucket_factor[:, None])
                / (self._predicted + self._prior))

    @property
    def scale(self) -> float:
        """Realized / predicted acceptance over every cell, with one prior per probability bin: one number for
        reports."""
        prior = self._prior.sum()
        return float((self._realized.sum() + prior) / (self._predicted.sum() + prior))

    def observe(self, probs: np.ndarray, depths: np.ndarray, accepted: np.ndarray,
                sources: np.ndarray | None = None) -> None:
        """One step's verified nodes: their calibrated probabilities, depths, (sources,) and whether each was
        accepted (1/0)."""
        probs = np.asarray(probs, dtype=np.float64)
        depths = np.asarray(depths)
        accepted = np.asarray(accepted, dtype=np.float64)
        if not probs.shape == depths.shape == accepted.shape:
            raise ValueError(f"probs {probs.shape}, depths {depths.shape} and accepted {accepted.shape} must have "
                             "the same shape")
        self._predicted *= self.decay
        self._realized *= self.decay
        self._nodes *= self.decay
        if probs.size:
            n = self.centers.size
            bins = np.clip(np.searchsorted(_EDGES, probs, side="right") - 1, 0, n - 1)
            cells = node_bucket(depths, sources) * n + bins
            size = self._nodes.size
            self._predicted += np.bincount(cells, weights=probs, minlength=size).reshape(self._nodes.shape)
            self._realized += np.bincount(cells, weights=accepted, minlength=size).reshape(self._nodes.shape)
            self._nodes += np.bincount(cells, minlength=size).reshape(self._nodes.shape)
        self._stale = True

    def _refit(self) -> None:
        """Each bucket's map from the current sums: fitted when next used, not after every step (a controller that
        drafts nothing for a while observes many steps and reads no map)."""
        ratios = self.ratios
        for bucket in range(ratios.shape[0]):
            rates = pav(np.minimum(self.centers * ratios[bucket], 1.0), self._nodes[bucket] + self.prior_nodes)
            top = float(np.clip(ratios[bucket, -1], rates[-1], 1.0))  # a calibrated 1.0 scaled by the top bin's ratio
            self._knots_y[bucket] = np.concatenate([[0.0], rates, [top]])
        self._stale = False


@nb.njit(cache=True)
def _cap_at_parents(values: np.ndarray, parents: np.ndarray) -> None:
    for i in range(values.shape[0]):
        if parents[i] >= 0 and values[parents[i]] < values[i]:
            values[i] = values[parents[i]]
