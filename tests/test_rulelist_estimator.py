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


def test_reordered_frames_are_realigned_and_wrong_columns_refused():
    X, y = _frame()
    est = DPGreedyRuleList(mechanism="monotone_em", random_state=3).fit(X, y)
    shuffled = X[list(reversed(NAMES))]
    assert np.array_equal(est.predict(shuffled), est.predict(X))
    assert np.allclose(est.predict_proba(shuffled), est.predict_proba(X))
    with pytest.raises(DataError, match="missing: x5") as info:
        est.predict(X.drop(columns=["x5"]).assign(other=0))
    assert isinstance(info.value, ValueError) and info.value.sqlstate == "22023"


def test_not_fitted_error_is_sklearns():
    sklearn_exceptions = pytest.importorskip("sklearn.exceptions")
    for method in ("predict", "predict_proba", "to_sql_case", "to_markdown", "to_json"):
        with pytest.raises(sklearn_exceptions.NotFittedError):
            arg = () if method.startswith("to_") else (np.zeros((2, 6)),)
            getattr(DPGreedyRuleList(), method)(*arg)


def test_sample_weight_counts_like_repeated_rows():
    X, y = synthetic(1200, seed=5)
    keys, counts = np.unique(np.column_stack([X, y]), axis=0, return_counts=True)
    kw = {"mechanism": "smooth_laplace", "random_state": 4, "delta": 1e-6}
    by_rows = DPGreedyRuleList(**kw).fit(X, y)
    by_weight = DPGreedyRuleList(**kw).fit(keys[:, :-1], keys[:, -1], sample_weight=counts)
    assert by_rows.rule_list_ == by_weight.rule_list_
    with pytest.raises(DataError, match="whole numbers"):
        DPGreedyRuleList(**kw).fit(X, y, sample_weight=np.full(len(y), 0.5))


def test_binarizer_with_public_cut_points_makes_numeric_frames_work():
    from dpsql.rulelist.estimator import DPBinarizer

    rng = np.random.default_rng(0)
    age = rng.integers(18, 90, 3000).astype(float)
    income = rng.normal(50, 20, 3000)
    frame = pd.DataFrame({"age": age, "income": income})
    y = ((age >= 40) & (income >= 60)).astype(int)
    b = DPBinarizer({"age": [30, 40, 60], "income": [40, 60]}).fit(frame)
    assert list(b.get_feature_names_out()) == [
        "age >= 30",
        "age >= 40",
        "age >= 60",
        "income >= 40",
        "income >= 60",
    ]
    assert b.transform(frame.iloc[:3]).tolist() == [
        [int(a >= 30), int(a >= 40), int(a >= 60), int(i >= 40), int(i >= 60)]
        for a, i in zip(age[:3], income[:3], strict=True)
    ]
    est = DPGreedyRuleList(
        mechanism="monotone_em",
        epsilon=2.0,
        random_state=1,
        cut_points={"age": [30, 40, 60], "income": [40, 60]},
    ).fit(frame, y)
    assert est.score(frame, y) > 0.9  # tolerance: y is one conjunction of two cuts
    con = duckdb.connect()
    con.register("people", frame)
    got = [r[0] for r in con.sql(f"SELECT {est.to_sql_case()} FROM people").fetchall()]
    assert got == list(est.predict(frame))  # the SQL reads the raw numeric columns
    back = DPGreedyRuleList.from_json(est.to_json())
    assert np.array_equal(back.predict(frame), est.predict(frame))
    with pytest.raises(DataError, match="0/1"):
        DPGreedyRuleList().fit(frame, y)  # numbers without cut points: refused, not guessed


def test_markdown_and_html_rendering():
    X, y = _frame()
    est = DPGreedyRuleList(mechanism="monotone_em", random_state=2).fit(X, y)
    md = est.to_markdown().splitlines()
    assert md[0].startswith("| # | if | then | noisy support")
    assert len(md) == 2 + len(est.rule_list_.rules) and "else" in md[-1]
    html = est.to_html()
    assert html.count("<tr>") == 1 + len(est.rule_list_.rules) and "width:" in html
    assert 'odd"name' not in html or "&quot;" in html


#: scikit-learn checks that apply to a binary classifier with public cut points; all pass.
#: Not applicable: check_array_api_input (skipped without SCIPY_ARRAY_API).
def test_sklearn_check_estimator():
    pytest.importorskip("sklearn")
    import warnings

    from sklearn.utils.estimator_checks import check_estimator

    est = DPGreedyRuleList(random_state=0, cut_points=[0.0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = check_estimator(est, on_fail=None)
    failed = [r["check_name"] for r in results if r["status"] == "failed"]
    passed = {r["check_name"] for r in results if r["status"] == "passed"}
    assert failed == []
    assert (
        len(passed) >= 50
        and {
            "check_estimators_unfitted",
            "check_classifiers_train",
            "check_fit_idempotent",
            "check_n_features_in_after_fitting",
            "check_estimators_pickle",
            "check_sample_weight_equivalence_on_dense_data",
        }
        <= passed
    )
