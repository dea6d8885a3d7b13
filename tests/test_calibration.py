"""CalibrationMap: isotonic fit recovers a known monotone relationship; JSON roundtrip; identity; fallbacks."""

from __future__ import annotations

import numpy as np
import pytest

from drafter.calibration import CalibrationMap, Curve, fit_curve, pav


def true_p(s):
    return 0.1 + 0.7 * s**2  # a known monotone score -> acceptance relation


def synthetic(n, rng, *, source=0, depth=1, match_len=4):
    s = rng.uniform(0, 1, n)
    acc = rng.uniform(0, 1, n) < true_p(s)
    return {
        "source": np.full(n, source), "depth": np.full(n, depth), "match_len": np.full(n, match_len),
        "score": s, "accepted": acc,
    }


def test_fit_recovers_known_monotone_relationship():
    rng = np.random.default_rng(1)
    cal = CalibrationMap.fit(synthetic(40000, rng), n_bins=20)
    grid = np.linspace(0.05, 0.95, 19)
    got = cal.apply(source=np.zeros(19), depth=np.ones(19), match_len=np.full(19, 4), score=grid)
    # 2000 draws per bin -> std of a bin rate <= 0.011; the linear interpolation error of 0.7 s^2 over 1/20 bins
    # is <= 0.7 * 0.05^2 / 8 ~ 0.0002
    assert np.max(np.abs(got - true_p(grid))) < 0.05
    assert np.all(np.diff(got) >= 0)


def test_pav_is_the_weighted_isotonic_projection():
    y = np.array([0.5, 0.2, 0.3, 0.9])
    w = np.array([1.0, 1.0, 2.0, 1.0])
    out = pav(y, w)
    assert np.all(np.diff(out) >= 0)
    pooled = (0.5 + 0.2 + 2 * 0.3) / 4  # the first three violate monotonicity and pool to their weighted mean
    np.testing.assert_allclose(out, [pooled, pooled, pooled, 0.9])


def test_monotone_even_for_adversarial_data():
    rng = np.random.default_rng(2)
    s = rng.uniform(0, 1, 5000)
    acc = rng.uniform(0, 1, 5000) < (1 - s)  # decreasing truth: the fit must stay monotone (flat)
    c = fit_curve(s, acc, n_bins=20)
    assert np.all(np.diff(c.y) >= 0) and np.all(np.diff(c.x) > 0)


def test_identity_default_and_clipping():
    cal = CalibrationMap.identity()
    assert cal.is_identity
    s = np.array([-0.1, 0.0, 0.3, 1.0, 1.5])
    got = cal.apply(source=np.zeros(5), depth=np.ones(5), match_len=np.ones(5), score=s)
    np.testing.assert_allclose(got, np.clip(s, 0, 1).astype(np.float32))


def test_fallback_levels():
    rng = np.random.default_rng(3)
    rec = synthetic(3000, rng, source=1, depth=2, match_len=3)
    cal = CalibrationMap.fit(rec, min_count=1000)
    assert {(1, 2, 3), (1, 2, 0), (1, 0, 0)} <= set(cal.curves)
    assert cal.resolve(1, 5, 1) is cal.curves[(1, 0, 0)]  # unseen depth: per-source curve
    assert cal.resolve(1, 2, 1) is cal.curves[(1, 2, 0)]  # unseen bucket: per-depth curve
    assert cal.resolve(0, 1, 1) is None  # unseen source: identity
    few = CalibrationMap.fit(synthetic(50, rng), min_count=200)
    assert few.is_identity


def test_json_roundtrip(tmp_path):
    rng = np.random.default_rng(4)
    recs = [synthetic(2000, rng, source=s, depth=d) for s in (0, 1) for d in (1, 2)]
    rec = {k: np.concatenate([r[k] for r in recs]) for k in recs[0]}
    cal = CalibrationMap.fit(rec)
    cal.to_json(tmp_path / "calibration.json")
    back = CalibrationMap.for_datastore(tmp_path)
    assert set(back.curves) == set(cal.curves)
    s = rng.uniform(0, 1, 500)
    kw = dict(source=rng.integers(0, 2, 500), depth=rng.integers(1, 4, 500), match_len=rng.integers(1, 5, 500))
    np.testing.assert_array_equal(back.apply(score=s, **kw), cal.apply(score=s, **kw))
    assert CalibrationMap.for_datastore(tmp_path / "nowhere").is_identity


def test_tables_match_apply():
    rng = np.random.default_rng(5)
    cal = CalibrationMap.fit(synthetic(5000, rng, source=1, depth=1, match_len=2))
    lookup, kx, ky, kn = cal.tables(3)
    assert lookup.shape == (3, cal.max_depth, cal.max_bucket)
    ci = lookup[1, 0, 1]
    c = cal.resolve(1, 1, 2)
    np.testing.assert_array_equal(kx[ci, : kn[ci]], c.x)
    assert lookup[0, 0, 0] == -1


def test_bad_input(tmp_path):
    with pytest.raises(ValueError, match="lack"):
        CalibrationMap.fit({"score": np.zeros(3)})
    with pytest.raises(ValueError, match="ascending"):
        Curve(x=np.array([0.5, 0.2]), y=np.array([0.1, 0.2]))
    (tmp_path / "calibration.json").write_text("{\"format\": \"other\"}")
    with pytest.raises(ValueError, match="not a retrospec calibration file"):
        CalibrationMap.for_datastore(tmp_path)
