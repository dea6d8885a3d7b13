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
Steps that verify nothing still decay the sums: without evidence the maps drift back to the calibration. Where
speculation rarely pays (MT-Bench at cap 16 on the Zen 2: a probe every ~33 steps) that leaves a third of the last
probe's evidence for the next; decaying at a quarter of the rate on such steps, or not at all, ran at 1.001x and
1.000x over ten interleaved rounds (`benchmarks/results/zen2_oneoffs.txt` §7), so the forgetting stays simple.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from drafter.calibration import pav_kernel

_EDGES = np.array([0.0, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0])
DEPTH_BUCKET_STARTS = np.array([1, 2, 3, 4, 6])  # bucket i holds depths [starts[i], starts[i + 1])
# Pseudo-accepted tokens behind a bucket factor of 1. At 2, a bucket that missed a few times early was discounted
# before it had shown anything: replaying the committed CPU runs through `tools/simulate`, goodput then starved a
# chitchat request whose retrieved drafts beat their calibration (cap 4: 0.92x the best fixed policy); at 10, every
# replayed (set, cap) group was at 0.99x or above (20 and 40 gave the same within 2%).
_BUCKET_PRIOR = 10.0
N_BUCKETS = 2 * DEPTH_BUCKET_STARTS.size  # depth buckets of the request's own index (source 0), then of the rest


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
        return self._values(probs, depths, sources, None)

    def tree_values(self, probs: np.ndarray, depths: np.ndarray, parents: np.ndarray,
                    sources: np.ndarray | None = None) -> np.ndarray:
        """Recalibrated values of the nodes of trees laid end to end (`parents`: global indices, -1 for a root's
        child, every parent before its children), each capped at its parent's: a path's values never increase."""
        return self._values(probs, depths, sources, np.ascontiguousarray(parents, dtype=np.int64))

    def _values(self, probs, depths, sources, parents) -> np.ndarray:
        # one kernel call: the budget controller values every candidate node of the batch on every step
        probs = np.ascontiguousarray(probs, dtype=np.float64)
        depths = np.ascontiguousarray(depths, dtype=np.int64)
        sources = _as_sources(sources)
        _check_nodes(probs, depths, sources, parents=_NO_PARENTS if parents is None else parents)
        if not probs.size:
            return np.zeros(0)
        return recalibrated_values(probs, depths, sources, _NO_PARENTS if parents is None else parents, *self.maps())

    def maps(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The maps `recalibrated_values` reads, as they stand (refitted first if new steps were observed): the depth
        buckets' starts, the knots' probabilities, and each bucket's knot values. For a caller that values nodes
        inside its own kernel (the budget controller's `_goodput_curve`)."""
        if self._stale:
            self._refit()
        return DEPTH_BUCKET_STARTS, self._knots_x, self._knots_y

    @property
    def ratios(self) -> np.ndarray:
        """Realized / predicted acceptance per [bucket, probability bin]. A cell shrinks toward its bin's ratio
        over every bucket times its bucket's factor (its realized over what the bins' ratios expect of it),
        each of those toward 1: a deep bucket sees too few nodes per bin to be read alone."""
        return _shrunk_ratios(self._predicted, self._realized, self._prior, _BUCKET_PRIOR)

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
        depths, sources = np.ascontiguousarray(depths, dtype=np.int64), _as_sources(sources)
        _check_nodes(probs, depths, sources)
        _decay_and_add(self._predicted, self._realized, self._nodes, self.decay, probs, depths, sources, accepted,
                       DEPTH_BUCKET_STARTS, _EDGES)
        self._stale = True

    def _refit(self) -> None:
        """Each bucket's map from the current sums: fitted when next used, not after every step (a controller that
        drafts nothing for a while observes many steps and reads no map)."""
        _fit_knots(self.centers, self.ratios, self._nodes, self.prior_nodes, self._knots_y)
        self._stale = False


_NO_PARENTS = np.zeros(0, np.int64)


def _as_sources(sources: np.ndarray | None) -> np.ndarray:
    """Node sources for the kernels; empty (None given): every node is the request's own."""
    return np.zeros(0, np.int64) if sources is None else np.ascontiguousarray(sources, dtype=np.int64)


def _check_nodes(probs: np.ndarray, depths: np.ndarray, sources: np.ndarray, parents: np.ndarray = _NO_PARENTS):
    """The kernels index these arrays per node without bounds checks: one 1-D length for all (empty sources and
    parents: none given). `recalibrated_values` checks, in its own loop, that every parent comes before its child."""
    n = probs.shape[0] if probs.ndim == 1 else -1
    mismatched = [a for a in (sources, parents) if a.size and a.shape != (n,)]
    if n < 0 or depths.shape != (n,) or mismatched:
        raise ValueError(f"per-node arrays must be 1-D and of one length: probs {probs.shape}, depths {depths.shape}, "
                         f"sources {sources.shape}, parents {parents.shape}")


@nb.njit(cache=True)
def _bucket(depth, source, bucket_starts):
    """Cell row of a node: its depth bucket, offset for a node retrieved from elsewhere than the request's own index
    (datastores, output history: source > 0)."""
    bucket = 0
    while bucket + 1 < bucket_starts.size and bucket_starts[bucket + 1] <= depth:
        bucket += 1
    return bucket + bucket_starts.size if source > 0 else bucket


@nb.njit(cache=True)
def _shrunk_ratios(predicted, realized, prior, bucket_prior):
    """`OnlineRecalibration.ratios` from its sums (one kernel: as array ops it cost ~35 us, on every step that
    follows a speculating one)."""
    buckets, bins = predicted.shape
    by_bin = np.empty(bins)  # each bin's ratio over every bucket, shrunk toward 1 by the bin's prior
    for j in range(bins):
        realized_sum, predicted_sum = 0.0, 0.0
        for i in range(buckets):
            realized_sum += realized[i, j]
            predicted_sum += predicted[i, j]
        by_bin[j] = (realized_sum + prior[j]) / (predicted_sum + prior[j])
    out = np.empty((buckets, bins))
    for i in range(buckets):
        expected, realized_sum = 0.0, 0.0  # what the bins' ratios expect of the bucket, and what it realized
        for j in range(bins):
            expected += predicted[i, j] * by_bin[j]
            realized_sum += realized[i, j]
        bucket_factor = (realized_sum + bucket_prior) / (expected + bucket_prior)
        for j in range(bins):
            out[i, j] = (realized[i, j] + prior[j] * by_bin[j] * bucket_factor) / (predicted[i, j] + prior[j])
    return out


@nb.njit(cache=True)
def _fit_knots(centers, ratios, nodes, prior_nodes, knots_y) -> None:
    """Each bucket's knots in place: 0, its bins' corrected rates at their centres (made non-decreasing, each bin
    weighted by its evidence), and at 1.0 the top bin's ratio."""
    for bucket in range(ratios.shape[0]):
        rates = pav_kernel(np.minimum(centers * ratios[bucket], 1.0), nodes[bucket] + prior_nodes)
        knots_y[bucket, 0] = 0.0
        for j in range(rates.shape[0]):  # not a slice assignment: that compiles numba's shape-mismatch message (~3 s)
            knots_y[bucket, 1 + j] = rates[j]
        knots_y[bucket, -1] = min(max(ratios[bucket, -1], rates[-1]), 1.0)


@nb.njit(cache=True)
def _decay_and_add(predicted, realized, nodes, decay, probs, depths, sources, accepted, bucket_starts, edges) -> None:
    """Decay every cell's sums, then add one step's nodes, each to its [bucket, probability bin] cell."""
    n_bins = edges.size - 1
    step_predicted = np.zeros(predicted.shape)
    step_realized = np.zeros(predicted.shape)
    step_nodes = np.zeros(predicted.shape)
    for i in range(probs.size):
        bucket = _bucket(depths[i], sources[i] if sources.size else 0, bucket_starts)
        edge = 0
        while edge + 1 < edges.size and edges[edge + 1] <= probs[i]:
            edge += 1
        cell = min(edge, n_bins - 1)
        step_predicted[bucket, cell] += probs[i]
        step_realized[bucket, cell] += accepted[i]
        step_nodes[bucket, cell] += 1.0
    for bucket in range(predicted.shape[0]):
        for cell in range(n_bins):
            predicted[bucket, cell] = predicted[bucket, cell] * decay + step_predicted[bucket, cell]
            realized[bucket, cell] = realized[bucket, cell] * decay + step_realized[bucket, cell]
            nodes[bucket, cell] = nodes[bucket, cell] * decay + step_nodes[bucket, cell]


@nb.njit(cache=True)
def recalibrated_values(probs, depths, sources, parents, bucket_starts, knots_x, knots_y) -> np.ndarray:
    """Each node's value on its bucket's map (`_bucket`; empty `sources`: every node the request's own), capped
    at its parent's value where `parents` is not empty (global indices, parents first: a parent at or after its
    child would read a value not yet written, so it is refused)."""
    out = np.empty(probs.size)
    for i in range(probs.size):
        if parents.size and parents[i] >= i:
            raise ValueError("every node's parent must come before it (parents[i] < i, -1 for the root's children)")
        bucket = _bucket(depths[i], sources[i] if sources.size else 0, bucket_starts)
        out[i] = np.interp(probs[i], knots_x, knots_y[bucket])
        if parents.size and parents[i] >= 0 and out[parents[i]] < out[i]:
            out[i] = out[parents[i]]
    return out
