"""DPLinearRegression / DPLogisticRegression: scikit-learn conventions, accuracy, SQL export."""

from __future__ import annotations

import duckdb
import numpy as np
import pytest
from sklearn.base import clone
from sklearn.model_selection import cross_val_score

from dpsql.models import dpsgd
from dpsql.models import sufficient_stats as ss
from dpsql.models.regression import (
    DPLinearRegression,
    DPLogisticRegression,
    RegressionModel,
    design,
    scale_to_lattice,
    unscale,
)
from dpsql.privacy.samplers import SeededNoise, ZeroNoise


def linear_data(n: int = 20_000, seed: int = 0):
    rng = np.random.default_rng(seed)
    X = np.column_stack([rng.uniform(0, 10, n), rng.integers(0, 2, n), rng.uniform(-5, 5, n)])
    y = 3.0 + 2.0 * X[:, 0] - 4.0 * X[:, 1] + 0.5 * X[:, 2] + rng.normal(0, 1, n)
    bounds = ([0, 0, -5], [10, 1, 5])
    return X, np.clip(y, -20, 40), bounds


def logistic_data(n: int = 20_000, seed: int = 1):
    rng = np.random.default_rng(seed)
    X = rng.integers(0, 2, (n, 6)).astype(float)
    logit = -1.0 + X @ np.array([2.0, -1.5, 1.0, 0.0, 0.5, -0.5])
    y = rng.random(n) < 1 / (1 + np.exp(-logit))
    return X, np.where(y, "yes", "no")


def ols(X, y):
    A = np.column_stack([np.ones(len(X)), X])
    return np.linalg.lstsq(A, y, rcond=None)[0]


# --- scaling ---------------------------------------------------------------------------------


def test_scaling_round_trip_and_lattice():
    lo, hi = np.array([0.0, -5.0]), np.array([10.0, 5.0])
    x = np.array([[0.0, -5.0], [10.0, 5.0], [5.0, 0.0], [20.0, np.nan]])
    z = scale_to_lattice(x, lo, hi)
    assert z.tolist() == [[-1, -1], [1, 1], [0, 0], [1, -1]]  # clipped; NaN -> lower bound
    assert np.all(np.abs(z * 1024 - np.rint(z * 1024)) == 0)
    w = np.array([0.5, 2.0, -1.0])  # scaled intercept, coefficients
    b0, bc = unscale(w, lo, hi, None)
    pts = np.array([[2.0, 1.0], [7.5, -3.0]])
    direct = design(pts, lo, hi) @ w
    assert np.allclose(b0[0] + pts @ bc[0], direct, atol=1e-3)


def test_unit_rows_bounds_each_unit():
    units = np.array([7, 7, 7, 3, 9, 9, 3, 7])
    rows = dpsgd.unit_rows(units, len(units), 2)
    assert rows.shape == (3, 2)
    kept = rows[rows >= 0]
    assert len(kept) == 6 and all(np.sum(units[kept] == u) <= 2 for u in (3, 7, 9))


# --- scikit-learn conventions --------------------------------------------------------------


def test_get_set_params_and_clone():
    est = DPLogisticRegression(epsilon=2.0, steps=50, random_state=3)
    assert est.get_params()["epsilon"] == 2.0
    assert est.set_params(epsilon=0.5) is est and est.epsilon == 0.5
    twin = clone(est)
    assert twin is not est and twin.get_params() == est.get_params()
    with pytest.raises(ValueError):
        est.set_params(nope=1)
    assert "DPLinearRegression(epsilon=1.0" in repr(DPLinearRegression())


def test_cross_val_score_runs():
    X, y = logistic_data(3000)
    scores = cross_val_score(
        DPLogisticRegression(epsilon=8, delta=1e-5, bounds=(0, 1), random_state=0), X, y, cv=3
    )
    assert len(scores) == 3 and np.all(scores > 0.6)
    X, y, bounds = linear_data(3000)
    est = DPLinearRegression(epsilon=8, delta=1e-5, bounds=bounds, label_bounds=(-20, 40))
    assert np.all(cross_val_score(clone(est).set_params(random_state=1), X, y, cv=3) > 0.5)


def test_label_bounds_required_and_two_classes():
    X, y, _ = linear_data(100)
    with pytest.raises(ValueError, match="label_bounds"):
        DPLinearRegression().fit(X, y)
    with pytest.raises(ValueError, match="two classes"):
        DPLogisticRegression(bounds=(0, 10)).fit(X[:, :1], np.zeros(100))


# --- accuracy --------------------------------------------------------------------------------


def test_sufficient_statistics_recover_ols_without_noise():
    X, y, bounds = linear_data(5000)
    lo, hi = np.array(bounds[0], float), np.array(bounds[1], float)
    Z = design(X, lo, hi)
    ys = scale_to_lattice(y[:, None], -20.0, 40.0)[:, 0]
    plan = ss.plan_sufficient_stats(1.0, 1e-6, 3)
    released = ss.noisy_statistics(plan, Z, ys, ZeroNoise())
    assert np.allclose(released, ss.exact_statistics(Z, ys))  # exact on the lattice
    xtx, xty, _ = ss.unpack(plan, released)
    b0, bc = unscale(ss.ridge_solve(xtx, xty, 0.0), lo, hi, (-20.0, 40.0))
    assert np.allclose([b0[0], *bc[0]], ols(X, y), atol=0.05)


@pytest.mark.parametrize("method", ["sufficient_stats", "dpsgd"])
def test_linear_close_to_ols_at_large_epsilon(method):
    X, y, bounds = linear_data()
    est = DPLinearRegression(
        epsilon=8, delta=1e-6, method=method, bounds=bounds, label_bounds=(-20, 40), random_state=2
    ).fit(X, y)
    exact = ols(X, y)
    assert est.score(X, y) > 0.95 * (
        1 - np.var(y - np.column_stack([np.ones(len(X)), X]) @ exact) / np.var(y)
    )
    assert est.cost_.epsilon == pytest.approx(8) and est.cost_.delta == pytest.approx(1e-6)
    if method == "sufficient_stats":
        lo, hi = est.coef_interval_[:, 0], est.coef_interval_[:, 1]
        assert np.all(lo <= hi) and np.all(lo < est.coef_ + 1e-9)
        assert est.intercept_interval_[0] <= est.intercept_ <= est.intercept_interval_[1]


def test_bootstrap_intervals_cover_the_truth_mostly():
    X, y, bounds = linear_data(20_000, seed=5)
    truth = np.array([2.0, -4.0, 0.5])
    covered = 0
    for seed in range(10):
        est = DPLinearRegression(
            epsilon=1, delta=1e-6, bounds=bounds, label_bounds=(-20, 40), random_state=seed
        ).fit(X, y)
        inside = (est.coef_interval_[:, 0] <= truth) & (truth <= est.coef_interval_[:, 1])
        covered += int(inside.sum())
    assert covered >= 24  # of 30 (nominal 95%)


def test_logistic_close_to_non_private():
    X, y = logistic_data()
    est = DPLogisticRegression(epsilon=1, delta=1e-6, bounds=(0, 1), random_state=4).fit(X, y)
    assert set(est.classes_) == {"no", "yes"}
    proba = est.predict_proba(X)
    assert proba.shape == (len(X), 2) and np.allclose(proba.sum(axis=1), 1)
    from sklearn.linear_model import LogisticRegression

    ref = LogisticRegression().fit(X, y).score(X, y)
    assert est.score(X, y) >= ref - 0.02
    assert est.mechanism_.noise_multiplier > 0 and est.mechanism_.accounted_epsilon <= 0.98 + 1e-9


def test_hundred_thousand_rows_fit():
    """The design of a fit at 100k rows; the bench times it (no timing assertion here)."""
    X, y = logistic_data(100_000)
    est = DPLogisticRegression(epsilon=1, delta=1e-6, bounds=(0, 1), random_state=0).fit(X, y)
    assert est.score(X, y) > 0.6


def test_groups_bound_rows_per_unit():
    X, y, bounds = linear_data(600)
    groups = np.repeat(np.arange(100), 6)
    est = DPLinearRegression(
        epsilon=4, delta=1e-6, bounds=bounds, label_bounds=(-20, 40), rows_per_unit=2,
        random_state=0, intervals=False,
    ).fit(X, y, groups=groups)  # fmt: skip
    assert est.mechanism_.rows_per_unit == 2 and est.coef_interval_ is None


# --- the released model, in Python and in SQL --------------------------------------------


def test_model_sql_matches_python_predictions():
    X, y, bounds = linear_data(2000)
    est = DPLinearRegression(
        epsilon=4, delta=1e-6, bounds=bounds, label_bounds=(-20, 40), random_state=0
    ).fit(X, y)
    model = RegressionModel.from_dict(est.model(["a", "b", "c"]).to_dict())
    con = duckdb.connect()
    pts = np.array([[1.0, 0.0, 2.0], [20.0, 1.0, -9.0]])  # the second is outside the bounds
    con.execute(
        "CREATE TABLE t AS SELECT * FROM (VALUES (1.0, 0, 2.0), (20.0, 1, -9.0)) v(a, b, c)"
    )
    got = [r[0] for r in con.execute(f"SELECT {model.predict_sql()} FROM t").fetchall()]
    assert np.allclose(got, est.predict(pts))

    Xl, yl = logistic_data(2000)
    clf = DPLogisticRegression(epsilon=4, delta=1e-6, bounds=(0, 1), random_state=0).fit(Xl, yl)
    m = clf.model([f"x{i}" for i in range(6)])
    assert m.positive == "yes"
    cols = ", ".join(f"{v} AS x{i}" for i, v in enumerate(Xl[0]))
    (p,) = con.execute(f"SELECT {m.predict_sql()} FROM (SELECT {cols})").fetchone()
    assert p == pytest.approx(clf.predict_proba(Xl[:1])[0, 1])


def old_predict_sql(m: RegressionModel) -> str:
    """RegressionModel.predict_sql as written before it built a tree (the reference)."""
    terms = [repr(float(m.intercept))]
    for sql, lo, hi, c in zip(m.feature_sql, m.lower, m.upper, m.coefficients, strict=True):
        lo, hi = float(lo), float(hi)
        clamped = f"LEAST(GREATEST(COALESCE(CAST({sql} AS DOUBLE), {lo!r}), {lo!r}), {hi!r})"
        terms.append(f"({float(c)!r}) * {clamped}")
    linear = " + ".join(terms)
    return f"1.0 / (1.0 + EXP(-({linear})))" if m.kind == "logistic_regression" else linear


def test_the_predictor_is_the_tree_of_the_text_it_parsed_before():
    """predictor() builds the tree (only the stored features' text is parsed): the very tree
    the old text parsed to, on models with negative, tiny and huge numbers and both kinds."""
    import random

    import sqlglot

    from dpsql.models.regression import predictor

    rng = random.Random(7)
    features = ['"age"', 'CASE WHEN "smoker" IS TRUE THEN 1 ELSE 0 END', "\"d\" = 'a''b'"]
    for _ in range(60):
        k = rng.randint(0, 3)
        lower = [rng.choice([0.0, -5.5, 1e-3, -1e20, -0.0, -1e-7]) for _ in range(k)]
        model = RegressionModel(
            rng.choice(["linear_regression", "logistic_regression"]),
            tuple(f"f{i}" for i in range(k)),
            tuple(rng.choice(features) for _ in range(k)),
            tuple(lower),
            tuple(lo + rng.choice([1.0, 3.25, 1e10]) for lo in lower),
            tuple(rng.uniform(-3, 3) * rng.choice([1, 1e-9, 1e12]) for _ in range(k)),
            rng.uniform(-5, 5) * rng.choice([1, 1e-12]),
            "y",
            None,
        )
        expected = sqlglot.parse_one(old_predict_sql(model), read="duckdb")
        assert predictor(model.to_dict()) == expected
        assert model.predict_sql() == expected.sql(dialect="duckdb")


def test_sampler_is_poisson():
    src = SeededNoise(0)
    sizes = [len(dpsgd.poisson_sample(src, 10_000, 0.01)) for _ in range(200)]
    assert np.mean(sizes) == pytest.approx(100, rel=0.05)
    assert np.var(sizes) == pytest.approx(99, rel=0.3)
    picked = dpsgd.poisson_sample(src, 50, 0.5)
    assert np.all(np.diff(picked) > 0) and picked.max(initial=0) < 50
