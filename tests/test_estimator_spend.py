"""No silent defaults in the in-process estimators (issue 31, item 5).

- A regression fit without declared feature bounds (or label bounds) is refused, free: the
  message says what to pass, X is never read, no ledger is charged.
- ``ledger=`` charges a fit's cost in the ledger before the fit (a connection's analyst, a
  Service with ``analyst=``, or a LedgerAccount); a fit that does not fit the budget is
  refused and spends nothing; without a ledger one UnrecordedSpendWarning line says what was
  spent. The same for the rule-list estimator.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from conftest import exact_connect, fixture_policy
from sklearn.base import clone
from sklearn.model_selection import cross_val_score

from dpsql.errors import BudgetExhaustedError, PrivacyError, ProgrammingError
from dpsql.models.regression import (
    BoundsRequiredError,
    DPLinearRegression,
    DPLogisticRegression,
)
from dpsql.privacy.accounting import Budget, Cost
from dpsql.privacy.ledger import MemoryLedger
from dpsql.privacy.spend import LedgerAccount, UnrecordedSpendWarning
from dpsql.rulelist.estimator import DPGreedyRuleList


class Unreadable:
    """An X that fails the test if anything reads its values."""

    shape = (100, 2)

    def __array__(self, *args, **kwargs):
        raise AssertionError("X was read")


def raw_data(n: int = 4000, seed: int = 0):
    """Raw (unscaled) features: age in [18, 90], income in [0, 200000]."""
    rng = np.random.default_rng(seed)
    age = rng.uniform(18, 90, n)
    income = rng.uniform(0, 200_000, n)
    logit = -4.0 + 0.05 * age + 1e-5 * income
    y = rng.random(n) < 1 / (1 + np.exp(-logit))
    return np.column_stack([age, income]), y.astype(int)


def account(epsilon: float = 10.0, delta: float = 1e-5) -> LedgerAccount:
    return LedgerAccount(MemoryLedger(), "alice", "ds", Budget(epsilon, delta))


def no_spend(acct: LedgerAccount) -> bool:
    ledger = acct.ledger
    assert isinstance(ledger, MemoryLedger)
    return ledger.spent(acct.analyst, acct.dataset).is_zero and ledger.log == []


# --- bounds: declared, or refused with the fix ------------------------------------------------


@pytest.mark.parametrize(
    "est",
    [
        DPLogisticRegression(epsilon=1, delta=1e-6),
        DPLinearRegression(epsilon=1, delta=1e-6, label_bounds=(0, 1)),
        DPLinearRegression(epsilon=1, delta=1e-6, method="dpsgd", label_bounds=(0, 1)),
    ],
)
def test_fit_without_bounds_is_refused_free(est):
    acct = account()
    est.set_params(ledger=acct)
    with pytest.raises(BoundsRequiredError) as info:
        est.fit(Unreadable(), np.zeros(100))
    err = info.value
    assert isinstance(err, PrivacyError) and isinstance(err, ValueError)
    assert err.sqlstate == "42501" and err.construct == "bounds"
    assert "bounds are required" in err.message and "clip silently" in err.message
    assert "bounds=(lower, upper)" in err.hint and "not from the data" in err.hint
    assert no_spend(acct) and not hasattr(est, "coef_")


def test_linear_fit_without_label_bounds_is_refused_free():
    acct = account()
    est = DPLinearRegression(epsilon=1, delta=1e-6, bounds=(0, 1), ledger=acct)
    with pytest.raises(BoundsRequiredError) as info:
        est.fit(Unreadable(), np.zeros(100))
    assert info.value.construct == "label_bounds" and "label_bounds=(0, 5000)" in info.value.hint
    assert no_spend(acct)


def test_declared_bounds_fit_raw_features():
    """The issue's failure: raw features under a silent [0, 1] clip gave the majority class.
    With their public ranges declared, the fit learns the signal."""
    X, y = raw_data()
    est = DPLogisticRegression(
        epsilon=4, delta=1e-6, bounds=([18, 0], [90, 200_000]), random_state=0
    )
    with pytest.warns(UnrecordedSpendWarning):
        est.fit(X, y)
    majority = max(y.mean(), 1 - y.mean())
    assert est.score(X, y) > majority + 0.02
    assert est.coef_[0] > 0 and est.bounds_[1].tolist() == [90, 200_000]


# --- the ledger ---------------------------------------------------------------------------------


def _fit_logistic(**params):
    X, y = raw_data(2000)
    est = DPLogisticRegression(
        epsilon=1, delta=1e-6, steps=50, bounds=([18, 0], [90, 200_000]), random_state=0, **params
    )
    return est.fit(X, y)


def test_fit_charges_the_ledger_it_is_given():
    acct = account()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnrecordedSpendWarning)  # a recorded fit does not warn
        est = _fit_logistic(ledger=acct)
    ledger = acct.ledger
    assert isinstance(ledger, MemoryLedger)
    assert ledger.spent("alice", "ds") == est.cost_ == Cost(1, 1e-6)
    ((who, dataset, cost, text, _),) = ledger.log
    assert (who, dataset, cost) == ("alice", "ds", Cost(1, 1e-6))
    assert text.startswith("DPLogisticRegression.fit: DPLogisticRegression(epsilon=1")
    assert "ledger" not in text


def test_fit_over_budget_is_refused_and_spends_nothing():
    acct = account(epsilon=0.5)
    with pytest.raises(BudgetExhaustedError):
        _fit_logistic(ledger=acct)
    assert no_spend(acct)


def test_fit_without_a_ledger_warns_in_one_line():
    with pytest.warns(UnrecordedSpendWarning) as record:
        _fit_logistic()
    (w,) = [r for r in record if r.category is UnrecordedSpendWarning]
    text = str(w.message)
    assert "\n" not in text
    assert text.startswith("DPLogisticRegression.fit spent ε = 1, δ = 1e-06 that no ledger")
    assert "ledger=" in text
    assert w.filename == __file__  # points at the caller's fit, not at dpsql


def test_linear_sufficient_statistics_charge():
    acct = account()
    X, y = raw_data(1000)
    est = DPLinearRegression(
        epsilon=2, noise="laplace", bounds=([18, 0], [90, 200_000]), label_bounds=(0, 1),
        ledger=acct, random_state=0, intervals=False,
    ).fit(X, y)  # fmt: skip
    assert acct.ledger.spent("alice", "ds") == est.cost_ == Cost(2)


def test_connection_and_service_as_ledger():
    conn = exact_connect(fixture_policy(privacy={"budget_epsilon": 100}), analyst="bob")
    try:
        service = conn.service
        dataset = service.policy.dataset
        _fit_logistic(ledger=conn)
        assert service.ledger.spent("bob", dataset) == Cost(1, 1e-6)
        _fit_logistic(ledger=service, analyst="carol")
        assert service.ledger.spent("carol", dataset) == Cost(1, 1e-6)
        with pytest.raises(ProgrammingError, match="needs analyst="):
            _fit_logistic(ledger=service)
        assert LedgerAccount.of(conn).analyst == "bob"
    finally:
        conn.close()


def test_bad_ledger_arguments_are_refused_before_the_fit():
    with pytest.raises(ProgrammingError, match="no ledger= was given"):
        _fit_logistic(analyst="alice")
    with pytest.raises(ProgrammingError, match="ledger= must be"):
        _fit_logistic(ledger="ledger.sqlite")


def test_clone_and_cross_validation_charge_the_same_account():
    acct = account()
    est = DPLogisticRegression(
        epsilon=1, delta=1e-6, steps=50, bounds=([18, 0], [90, 200_000]), ledger=acct
    )
    assert clone(est).ledger is acct
    X, y = raw_data(1500)
    cross_val_score(est, X, y, cv=3)
    assert len(acct.ledger.log) == 3  # type: ignore[attr-defined]
    assert acct.ledger.spent("alice", "ds") == Cost(3, 3e-6)


# --- the rule-list estimator ---------------------------------------------------------------


def _rule_data(n: int = 600):
    rng = np.random.default_rng(2)
    X = rng.integers(0, 2, (n, 3))
    y = (X[:, 0] | X[:, 1]).astype(int)
    return X, y


def test_rule_list_charges_or_warns():
    X, y = _rule_data()
    acct = account()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnrecordedSpendWarning)
        est = DPGreedyRuleList(epsilon=1, delta=1e-6, max_length=2, random_state=0, ledger=acct)
        est.fit(X, y)
    assert acct.ledger.spent("alice", "ds") == est.cost_
    assert acct.ledger.log[0][3].startswith("DPGreedyRuleList.fit: DPGreedyRuleList(")  # type: ignore[attr-defined]
    with pytest.warns(UnrecordedSpendWarning, match="DPGreedyRuleList.fit spent ε = 1"):
        DPGreedyRuleList(epsilon=1, delta=1e-6, max_length=2, random_state=0).fit(X, y)
    back = DPGreedyRuleList.from_json(est.to_json())
    assert back.ledger is None  # where a fit was charged is not part of the model


def test_rule_list_over_budget_spends_nothing():
    X, y = _rule_data()
    acct = account(epsilon=0.5)
    est = DPGreedyRuleList(epsilon=1, delta=1e-6, max_length=2, random_state=0, ledger=acct)
    with pytest.raises(BudgetExhaustedError):
        est.fit(X, y)
    assert no_spend(acct) and not hasattr(est, "rule_list_")


def test_rule_list_that_spends_nothing_says_nothing():
    X, y = _rule_data()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnrecordedSpendWarning)
        DPGreedyRuleList(mechanism="none", max_length=2).fit(X, y)


# --- bounds="auto": DP bounds bought with a stated share of the fit's ε ----------------------


def test_auto_bounds_bins_are_public_and_signed():
    from dpsql.models import approx_bounds as ab

    x = np.array([0.0, 3.0, -3.0, 1e300, -1e300, np.nan, 2.0**-20])
    idx = ab.bin_index(x)
    assert idx[5] == -1 and idx[0] == idx[6] == ab.N_SIDE  # NaN: no bin; ~0: the zero bin
    assert (ab.LOWER_EDGES[idx[1]], ab.UPPER_EDGES[idx[1]]) == (2.0, 4.0)
    assert (ab.LOWER_EDGES[idx[2]], ab.UPPER_EDGES[idx[2]]) == (-4.0, -2.0)
    assert idx[3] == ab.N_BINS - 1 and idx[4] == 0  # beyond ±2^48: the outermost bins
    assert np.all(ab.LOWER_EDGES < ab.UPPER_EDGES)


def test_auto_bounds_histogram_moves_by_at_most_r_per_feature():
    """The sensitivity the noise is calibrated to: adding a unit of R rows changes each
    feature's bin counts by at most R in L1 (so R·d over the d features)."""
    from dpsql.models import approx_bounds as ab
    from dpsql.models import dpsgd

    rng = np.random.default_rng(4)
    X = rng.normal(0, 1e3, (300, 3))
    extra = np.array([[1e9, -1e-9, 5.0]] * 7)  # one unit with 7 rows; R = 3 of them count
    units = np.r_[np.arange(300), np.full(7, 999)]
    R = 3

    def hist(data, ids):
        rows = dpsgd.unit_rows(ids, len(data), R)
        kept = data[rows[rows >= 0]]
        return np.stack(
            [np.bincount(ab.bin_index(kept[:, j]), minlength=ab.N_BINS) for j in range(3)]
        )

    before = hist(X, np.arange(300))
    after = hist(np.vstack([X, extra]), units)
    assert np.abs(after - before).sum(axis=1).tolist() == [R, R, R]


def test_auto_bounds_fit_charges_the_whole_epsilon_once():
    X, y = raw_data()
    acct = account()
    est = DPLogisticRegression(
        epsilon=4, delta=1e-6, bounds="auto", ledger=acct, random_state=0
    ).fit(X, y)
    lo, hi = est.bounds_
    assert lo[0] <= 18 and hi[0] >= 90 and lo[1] >= 0 and hi[1] >= 200_000  # powers of two
    assert est.bounds_cost_.epsilon == pytest.approx(0.4)
    assert est.mechanism_.config.epsilon == pytest.approx(3.6)
    assert est.cost_ == Cost(4, 1e-6) == acct.ledger.spent("alice", "ds")
    assert len(acct.ledger.log) == 1  # type: ignore[attr-defined]
    majority = max(y.mean(), 1 - y.mean())
    assert est.score(X, y) > majority + 0.02
    assert est.model(["age", "income"]).upper == tuple(hi)  # released with the model


def test_auto_bounds_linear_sufficient_statistics():
    rng = np.random.default_rng(7)
    X = np.column_stack([rng.uniform(0, 1000, 5000), rng.uniform(-50, 50, 5000)])
    y = 2.0 + 0.01 * X[:, 0] - 0.05 * X[:, 1] + rng.normal(0, 0.5, 5000)
    acct = account(epsilon=20)
    est = DPLinearRegression(
        epsilon=8, delta=1e-6, bounds="auto", label_bounds=(-10, 30), ledger=acct,
        random_state=1, intervals=False,
    ).fit(X, y)  # fmt: skip
    assert est.cost_ == Cost(8, 1e-6) == acct.ledger.spent("alice", "ds")
    assert est.score(X, y) > 0.8
