"""DPGreedyRuleList: scikit-learn conventions, JSON, SQL CASE in DuckDB, refusals."""

from __future__ import annotations

import duckdb
import numpy as np
import pytest

from dpsql.errors import DataError, ProgrammingError
from dpsql.rulelist import DPGreedyRuleList
from dpsql.rulelist.estimator import NotFittedError


def synthetic(n: int = 3000, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """6 binary features; y = (x0 and not x1) or x2, 10% flipped (as test_rulelist_learner;
    copied: an installed package named ``tests`` can shadow this directory)."""
    rng = np.random.default_rng(seed)
    X = (rng.random((n, 6)) < 0.4).astype(np.uint8)
    y = ((X[:, 0] & (1 - X[:, 1])) | X[:, 2]).astype(np.int8)
    flip = rng.random(n) < 0.1
    return X, np.where(flip, 1 - y, y)


pd = pytest.importorskip("pandas")

NAMES = ["Prior-Crimes>3", "age low", 'odd"name', "x3", "x4", "x5"]


def _frame(n=1500, seed=0):
    X, y = synthetic(n, seed)
    return pd.DataFrame(X, columns=NAMES), np.where(y == 1, ">50K", "<=50K")


def test_params_protocol():
    est = DPGreedyRuleList(epsilon=0.5, mechanism="monotone_em")
    params = est.get_params()
    assert params["epsilon"] == 0.5 and params["max_length"] == 5 and params["max_card"] == 2
    assert set(params) >= {"delta", "min_support", "confidence", "random_state"}
    assert est.set_params(max_length=3) is est and est.max_length == 3
    clone = DPGreedyRuleList(**est.get_params())
    assert clone.get_params() == est.get_params()
    with pytest.raises(ProgrammingError, match="unknown parameter"):
        est.set_params(depth=3)
    with pytest.raises(NotFittedError):
        est.predict(np.zeros((2, 6)))


def test_fit_predict_on_dataframe_with_string_labels():
    X, y = _frame()
    est = DPGreedyRuleList(mechanism="monotone_em", random_state=1)
    assert est.fit(X, y) is est
    assert list(est.classes_) == ["<=50K", ">50K"]
    assert list(est.feature_names_in_) == NAMES
    pred = est.predict(X)
    assert set(pred) <= {"<=50K", ">50K"}
    proba = est.predict_proba(X)
    assert proba.shape == (len(X), 2) and np.allclose(proba.sum(axis=1), 1.0)
    assert 0.0 <= est.score(X, y) <= 1.0
    assert est.cost_.epsilon == 1.0 and est.cost_.delta == 0.0
    text = str(est)
    assert text.startswith("if [") and "else then" in text


def test_json_round_trip():
    X, y = _frame()
    est = DPGreedyRuleList(mechanism="monotone_em", random_state=2).fit(X, y)
    back = DPGreedyRuleList.from_json(est.to_json())
    assert back.get_params() == est.get_params()
    assert back.rule_list_ == est.rule_list_
    assert str(back) == str(est)
    assert np.array_equal(back.predict(X), est.predict(X))
    assert np.allclose(back.predict_proba(X), est.predict_proba(X))


@pytest.mark.parametrize("mechanism", ["none", "monotone_em", "exponential"])
def test_sql_case_scores_rows_like_predict(mechanism):
    X, y = _frame(800, seed=4)
    est = DPGreedyRuleList(mechanism=mechanism, random_state=0, max_length=6).fit(X, y)
    con = duckdb.connect()
    con.register("people", X)
    got = [r[0] for r in con.sql(f"SELECT {est.to_sql_case()} FROM people").fetchall()]
    assert got == list(est.predict(X))


def test_numpy_input_with_feature_names_and_01_labels():
    X, y = synthetic(600)
    est = DPGreedyRuleList(mechanism="none", max_length=3).fit(X, y, feature_names=list("abcdef"))
    assert list(est.classes_) == [0, 1]
    assert "[" in str(est) and est.cost_.is_zero
    assert '"a"' in est.to_sql_case() or '"c"' in est.to_sql_case()


def test_refusals():
    X, y = synthetic(200)
    with pytest.raises(DataError, match="exactly two classes"):
        DPGreedyRuleList().fit(X, np.arange(200) % 3)
    with pytest.raises(DataError, match="0/1"):
        DPGreedyRuleList().fit(X * 2, y)
    with pytest.raises(ProgrammingError, match="candidates"):
        DPGreedyRuleList(candidates="magic").fit(X, y)
    with pytest.raises(ProgrammingError, match="max_length"):
        DPGreedyRuleList(max_length=0).fit(X, y)
    est = DPGreedyRuleList(mechanism="none").fit(X, y)
    with pytest.raises(DataError, match="features"):
        est.predict(X[:, :3])


def test_cross_val_score():
    sklearn = pytest.importorskip("sklearn")
    from sklearn.base import clone, is_classifier
    from sklearn.model_selection import cross_val_score

    X, y = synthetic(1500)
    est = DPGreedyRuleList(mechanism="monotone_em", random_state=0, max_length=4)
    assert is_classifier(est)
    assert clone(est).get_params() == est.get_params()
    scores = cross_val_score(est, X, y, cv=3)
    assert scores.shape == (3,) and np.all(scores > 0.7)  # non-private ≈ 0.9 on this data
    assert sklearn.__version__
