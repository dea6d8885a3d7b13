"""Calibration: from a node's raw fusion score to the probability that the verifier accepts its whole path.

Vocabulary
    raw score     the SSSD pseudo-probability a node got during fusion (conditional frequencies, input scores
                  scaled and damped). Ordered, but not a probability: input scores are overconfident, deep datastore
                  nodes are underconfident.
    key           (source, depth, bucket): source id (SOURCE_INPUT or SOURCE_DATASTORE + k), depth in the tree
                  (1 = child of the root) and the match-length bucket (the length of the suffix that matched,
                  capped at `max_bucket`).
    curve         a monotone piecewise-linear map raw score -> probability: knots (x ascending, y non-decreasing),
                  clamped to y[0] / y[-1] outside the knots.
    fallback      a key without enough data uses (source, depth, any bucket), then (source, any depth, any bucket),
                  then the identity. "any" is stored as 0 (depths and buckets start at 1).

Fitting (`CalibrationMap.fit`): per key, the records are cut into `n_bins` score quantile bins; each bin gives
(mean score, acceptance rate, weight), and the pool-adjacent-violators algorithm makes the rates non-decreasing.

Worked example: input nodes at depth 1 after a 4-token match with raw score 0.6 were accepted 45% of the time
-> the curve for key (0, 1, 4) passes through (0.6, 0.45), and a node scored 0.6 gets probs = 0.45 in its tree.

Saved as JSON (`to_json` / `from_json`); the drafter loads `<datastore_dir>/calibration.json` by default.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numba as nb
import numpy as np

CALIBRATION_FILE = "calibration.json"
_FORMAT = "retrospec-calibration-v1"


@dataclass(frozen=True, eq=False)
class Curve:
    x: np.ndarray  # float64 [k] strictly ascending raw scores
    y: np.ndarray  # float64 [k] non-decreasing probabilities in [0, 1]
    n: int = 0  # records it was fitted on

    def __post_init__(self):
        if self.x.ndim != 1 or self.x.shape != self.y.shape or self.x.size == 0:
            raise ValueError("a calibration curve needs 1-D x and y knots of the same non-zero length")
        if np.any(np.diff(self.x) <= 0) or np.any(np.diff(self.y) < 0):
            raise ValueError("calibration knots must have strictly ascending x and non-decreasing y")
        if self.y.min() < 0 or self.y.max() > 1:
            raise ValueError("calibration probabilities must lie in [0, 1]")

    def __call__(self, score: np.ndarray) -> np.ndarray:
        return np.interp(score, self.x, self.y)


def pav(y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Weighted isotonic (non-decreasing) regression by pool-adjacent-violators."""
    return pav_kernel(np.ascontiguousarray(y, dtype=np.float64), np.ascontiguousarray(w, dtype=np.float64))


@nb.njit(cache=True)
def pav_kernel(y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """`pav` on contiguous float64 arrays, callable from other kernels (the online recalibration refits ten of these
    per step, `orchestrator.recalibration._fit_knots`)."""
    # a stack of pooled blocks (value, weight, size)
    n = y.shape[0]
    vals, wts, sizes = np.empty(n), np.empty(n), np.empty(n, np.int64)
    top = 0
    for i in range(n):
        vals[top], wts[top], sizes[top] = y[i], w[i], 1
        top += 1
        while top > 1 and vals[top - 2] > vals[top - 1]:
            w2 = wts[top - 2] + wts[top - 1]
            vals[top - 2] = (vals[top - 2] * wts[top - 2] + vals[top - 1] * wts[top - 1]) / w2
            wts[top - 2] = w2
            sizes[top - 2] += sizes[top - 1]
            top -= 1
    out = np.empty(n)
    k = 0
    for b in range(top):
        for _ in range(sizes[b]):
            out[k] = vals[b]
            k += 1
    return out


def fit_curve(score: np.ndarray, accepted: np.ndarray, *, n_bins: int = 20) -> Curve:
    """Isotonic fit of P(accepted | score) on `n_bins` quantile bins of the score."""
    score = np.asarray(score, np.float64)
    accepted = np.asarray(accepted, np.float64)
    order = np.argsort(score, kind="stable")
    s, a = score[order], accepted[order]
    edges = np.unique(np.quantile(s, np.linspace(0, 1, n_bins + 1)[1:-1]))
    bin_of = np.searchsorted(edges, s, side="right")
    w = np.bincount(bin_of, minlength=edges.size + 1).astype(np.float64)
    keep = w > 0
    xs = np.bincount(bin_of, weights=s, minlength=edges.size + 1)[keep] / w[keep]
    ys = np.bincount(bin_of, weights=a, minlength=edges.size + 1)[keep] / w[keep]
    w = w[keep]
    ys = pav(ys, w)
    # Equal mean scores can only come from ties collapsing two bins: merge them (x must be strictly ascending).
    ux, inv = np.unique(xs, return_inverse=True)
    uy = np.bincount(inv, weights=ys * w) / np.bincount(inv, weights=w)
    return Curve(x=ux, y=np.clip(np.maximum.accumulate(uy), 0.0, 1.0), n=int(score.size))


class CalibrationMap:
    """Monotone maps raw score -> path-acceptance probability, one per (source, depth, match-length bucket).

    Example:
        cal = CalibrationMap.fit({"source": src, "depth": d, "match_len": m, "score": s, "accepted": acc})
        probs = cal.apply(source=src, depth=d, match_len=m, score=s)
        cal.to_json(ds_dir / "calibration.json"); CalibrationMap.from_json(ds_dir / "calibration.json")
    """

    def __init__(self, curves: Mapping[tuple[int, int, int], Curve] | None = None, *, max_bucket: int = 4,
                 max_depth: int = 32):
        if max_bucket < 1 or max_depth < 1:
            raise ValueError("max_bucket and max_depth must be >= 1")
        self.curves: dict[tuple[int, int, int], Curve] = dict(curves or {})
        self.max_bucket = max_bucket
        self.max_depth = max_depth

    @classmethod
    def identity(cls) -> "CalibrationMap":
        """No curves: every probability equals the raw score (SSSD's behaviour)."""
        return cls()

    @property
    def is_identity(self) -> bool:
        return not self.curves

    # ---- fitting ---------------------------------------------------------------------------------------------
    @classmethod
    def fit(cls, records: Mapping[str, np.ndarray], *, n_bins: int = 20, min_count: int = 200, max_bucket: int = 4,
            max_depth: int = 32) -> "CalibrationMap":
        """Fit from logged nodes: arrays `source, depth, match_len, score, accepted` (accepted = node on the accepted
        path). Keys with fewer than `min_count` records are left to the fallback levels."""
        missing = {"source", "depth", "match_len", "score", "accepted"} - set(records)
        if missing:
            raise ValueError(f"calibration records lack {sorted(missing)}; log them from DraftResult")
        src = np.asarray(records["source"], np.int64)
        dep = np.minimum(np.asarray(records["depth"], np.int64), max_depth)
        buc = np.clip(np.asarray(records["match_len"], np.int64), 1, max_bucket)
        score = np.asarray(records["score"], np.float64)
        acc = np.asarray(records["accepted"]).astype(np.float64)
        if not (src.shape == dep.shape == buc.shape == score.shape == acc.shape) or src.ndim != 1:
            raise ValueError("calibration record arrays must be 1-D and of equal length")
        if np.any(dep < 1):
            raise ValueError("calibration records need depth >= 1")
        curves: dict[tuple[int, int, int], Curve] = {}
        levels = [(src, dep, buc), (src, dep, np.zeros_like(buc)), (src, np.zeros_like(dep), np.zeros_like(buc))]
        for a, b, c in levels:
            keys = np.stack([a, b, c], axis=1)
            uniq, inv = np.unique(keys, axis=0, return_inverse=True)
            inv = inv.reshape(-1)
            for i, key in enumerate(map(tuple, uniq.tolist())):
                sel = inv == i
                if sel.sum() >= min_count:
                    curves[key] = fit_curve(score[sel], acc[sel], n_bins=n_bins)
        return cls(curves, max_bucket=max_bucket, max_depth=max_depth)

    # ---- application -----------------------------------------------------------------------------------------
    def resolve(self, source: int, depth: int, match_len: int) -> Curve | None:
        d = min(int(depth), self.max_depth)
        b = min(max(int(match_len), 1), self.max_bucket)
        for key in ((source, d, b), (source, d, 0), (source, 0, 0)):
            if key in self.curves:
                return self.curves[key]
        return None

    def apply(self, *, source, depth, match_len, score) -> np.ndarray:
        """Vectorised: calibrated probability of each node (float32), identity where no curve applies."""
        src = np.asarray(source, np.int64)
        dep = np.asarray(depth, np.int64)
        ml = np.asarray(match_len, np.int64)
        score = np.asarray(score, np.float64)
        out = np.clip(score, 0.0, 1.0)
        if self.curves and score.size:
            keys = np.stack([src, np.minimum(dep, self.max_depth), np.clip(ml, 1, self.max_bucket)], axis=1)
            uniq, inv = np.unique(keys, axis=0, return_inverse=True)
            inv = inv.reshape(-1)
            for i, (s, d, b) in enumerate(uniq.tolist()):
                curve = self.resolve(s, d, b)
                if curve is not None:
                    sel = inv == i
                    out[sel] = curve(score[sel])
        return out.astype(np.float32)

    def tables(self, n_sources: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Dense form for the fusion kernel: lookup int32 [n_sources, max_depth, max_bucket] (curve index or -1 for
        identity), knots_x / knots_y float64 [n_curves, k], n_knots int32 [n_curves]."""
        curves = list(self.curves.values())
        index = {id(c): i for i, c in enumerate(curves)}
        lookup = np.full((max(n_sources, 1), self.max_depth, self.max_bucket), -1, np.int32)
        for s in range(n_sources):
            for d in range(1, self.max_depth + 1):
                for b in range(1, self.max_bucket + 1):
                    c = self.resolve(s, d, b)
                    if c is not None:
                        lookup[s, d - 1, b - 1] = index[id(c)]
        k = max([c.x.size for c in curves], default=1)
        xs = np.zeros((max(len(curves), 1), k), np.float64)
        ys = np.zeros_like(xs)
        ns = np.zeros(max(len(curves), 1), np.int32)
        for i, c in enumerate(curves):
            xs[i, : c.x.size], ys[i, : c.x.size], ns[i] = c.x, c.y, c.x.size
        return lookup, xs, ys, ns

    # ---- persistence -----------------------------------------------------------------------------------------
    def to_json(self, path) -> None:
        doc = {
            "format": _FORMAT,
            "max_bucket": self.max_bucket,
            "max_depth": self.max_depth,
            "curves": [
                {"source": s, "depth": d, "bucket": b, "n": c.n, "x": c.x.tolist(), "y": c.y.tolist()}
                for (s, d, b), c in sorted(self.curves.items())
            ],
        }
        Path(path).write_text(json.dumps(doc, indent=1))

    @classmethod
    def from_json(cls, path) -> "CalibrationMap":
        try:
            doc = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read calibration file {path}: {e}") from e
        if doc.get("format") != _FORMAT:
            raise ValueError(f"{path} is not a retrospec calibration file (format {doc.get('format')!r})")
        curves = {
            (int(c["source"]), int(c["depth"]), int(c["bucket"])): Curve(
                x=np.asarray(c["x"], np.float64), y=np.asarray(c["y"], np.float64), n=int(c.get("n", 0))
            )
            for c in doc["curves"]
        }
        return cls(curves, max_bucket=int(doc["max_bucket"]), max_depth=int(doc["max_depth"]))

    @classmethod
    def for_datastore(cls, datastore_dir) -> "CalibrationMap":
        """`<datastore_dir>/calibration.json` when present, else the identity."""
        path = Path(datastore_dir) / CALIBRATION_FILE
        return cls.from_json(path) if path.is_file() else cls.identity()
