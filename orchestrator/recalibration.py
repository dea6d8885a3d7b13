"""Online recalibration of draft-node probabilities from what verification realized.

The drafter's calibration (`drafter/calibration.py`) maps its scores to path-acceptance probabilities on offline
trajectories. Served traffic drifts from those, and not uniformly: on HumanEval at cap 4, nodes calibrated at
0.6-0.7 were accepted 49% of the time while those at 0.1-0.3 were on target. The goodput allocation draws most of
its nodes from the high end, so one realized/predicted ratio over the chosen nodes (0.7-0.8 there) also shrinks
the low-probability nodes at the margin, which decide how far speculation goes, and the controller sent 1.6
nodes per request where 4 paid.

So nodes are binned by calibrated probability. Each bin keeps exponentially decayed sums of predicted and realized
acceptance, on top of a prior of `prior_nodes` nodes that trusts the calibration; the map interpolates the bins'
corrected rates between their centres. Those rates are made non-decreasing by pooling adjacent violators weighted by
each bin's evidence (an over-confident bin with hundreds of nodes is not lifted to its empty neighbour's prior), so
a tree whose probabilities never increase along a path keeps that order (and `prune_tree`'s prefixes stay trees).
Steps that verify nothing still decay the sums: without evidence the map drifts back to the calibration.
"""

from __future__ import annotations

import numpy as np

from drafter.calibration import pav

_EDGES = np.array([0.0, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0])


class OnlineRecalibration:
    def __init__(self, *, decay: float = 0.97, prior_nodes: float = 8.0) -> None:
        if not 0.0 < decay <= 1.0 or prior_nodes <= 0:
            raise ValueError(f"decay must be in (0, 1] and prior_nodes > 0 (got {decay}, {prior_nodes})")
        self.decay = decay
        self.centers = (_EDGES[:-1] + _EDGES[1:]) / 2
        self.prior_nodes = prior_nodes
        self._prior = prior_nodes * self.centers  # pseudo-acceptances: as many realized as predicted
        self._predicted = np.zeros(self.centers.shape[0])
        self._realized = np.zeros(self.centers.shape[0])
        self._nodes = np.zeros(self.centers.shape[0])
        self._knots_x = np.concatenate([[0.0], self.centers, [1.0]])
        self._knots_y = self._knots_x.copy()

    def __call__(self, probs: np.ndarray) -> np.ndarray:
        """Expected acceptance of nodes with these calibrated path probabilities, as recently realized."""
        return np.interp(probs, self._knots_x, self._knots_y)

    @property
    def ratios(self) -> np.ndarray:
        """Realized / predicted acceptance per bin (1 where there is no evidence)."""
        return (self._realized + self._prior) / (self._predicted + self._prior)

    @property
    def scale(self) -> float:
        """Realized / predicted acceptance over every bin: one number for reports."""
        return float((self._realized.sum() + self._prior.sum()) / (self._predicted.sum() + self._prior.sum()))

    def observe(self, probs: np.ndarray, accepted: np.ndarray) -> None:
        """One step's verified nodes: their calibrated probabilities and whether each was accepted (1/0)."""
        probs = np.asarray(probs, dtype=np.float64)
        accepted = np.asarray(accepted, dtype=np.float64)
        if probs.shape != accepted.shape:
            raise ValueError(f"probs {probs.shape} and accepted {accepted.shape} must have the same shape")
        self._predicted *= self.decay
        self._realized *= self.decay
        self._nodes *= self.decay
        if probs.size:
            n = self.centers.shape[0]
            bins = np.clip(np.searchsorted(_EDGES, probs, side="right") - 1, 0, n - 1)
            self._predicted += np.bincount(bins, weights=probs, minlength=n)
            self._realized += np.bincount(bins, weights=accepted, minlength=n)
            self._nodes += np.bincount(bins, minlength=n)
        ratios = self.ratios
        rates = pav(np.minimum(self.centers * ratios, 1.0), self._nodes + self.prior_nodes)
        top = float(np.clip(ratios[-1], rates[-1], 1.0))  # a calibrated 1.0 scaled by the top bin's ratio
        self._knots_y = np.concatenate([[0.0], rates, [top]])

