"""Bounded work after the charge, free refusals before it (issue 25, items 2-4).

Invariant 2 of the privacy boundary (DESIGN.md): once the cost is reserved, nothing may fail
or run for a time that depends on ε; what the text and the policy decide is refused free.
One test per loop that runs after the charge, at the smallest ε each construct accepts
(1e-12 and below: the policy puts no floor under ε). Bounds are asserted on step counters
(tail evaluations, rule positions, table builds), never on wall time. Refusals check the
message, that the engine was not called and that nothing was spent; the cancel tests check
that a cancel arriving while Python works after the read reaches that work.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from conftest import fixture_policy

import dpsql
from dpsql.boundary import CANCELLED_AFTER_READ, FAILED_AFTER_READ, ChargedFailure
from dpsql.dbapi import connect_service
from dpsql.engine.api import QueryHandle, cancel_check
from dpsql.privacy import mechanisms, partition, quantiles
from dpsql.privacy.ledger import MemoryLedger
from dpsql.privacy.mechanisms import Laplace
from dpsql.privacy.release import _approximate_noise
from dpsql.privacy.samplers import SeededNoise, ZeroNoise, check_laplace_drawable
from dpsql.rulelist import learner
from dpsql.rulelist.candidates import Feature, Literal, Patterns
from dpsql.rulelist.learner import BudgetPlan, LearnerParams, check_drawable, learn_patterns
from dpsql.rulelist.model import count_margin

RULE_LIST = "SELECT * FROM dp_rule_list('visits', label => 'readmitted', epsilon => {eps})"
TINY = ("1e-12", "1e-300", "5e-324")  # 5e-324: the smallest positive double


class Spy:
    """Counts every engine read (compiled queries and rule-list / regression matrices) and
    can interrupt the connection's handle right after a read, as a cancel arriving while the
    Python work after the charge runs."""

    def __init__(self, service: dpsql.Service) -> None:
        self.engine = service.engine
        self.reads = 0
        self.cancel_after_read: dpsql.Connection | None = None
        execute, fetch = self.engine.execute, self.engine.fetch_matrix

        def spied_execute(compiled, handle=None):
            return self._after(execute(compiled, handle))

        def spied_fetch(query, handle=None):
            return self._after(fetch(query, handle))

        self.engine.execute = spied_execute  # type: ignore[method-assign]
        self.engine.fetch_matrix = spied_fetch  # type: ignore[method-assign]

    def _after(self, result):
        self.reads += 1
        if self.cancel_after_read is not None:
            self.cancel_after_read.interrupt()
        return result


@pytest.fixture()
def fresh():
    policy = fixture_policy(privacy={"budget_epsilon": 1e9, "budget_delta": 0.5})
    service = dpsql.Service(policy, ledger=MemoryLedger(), noise=SeededNoise(7), cache=False)
    spy = Spy(service)
    conn = connect_service(service, "mallory")
    yield service, spy, conn
    conn.close()
    service.close()


def _spent(service: dpsql.Service) -> Fraction:
    return service.ledger.spent("mallory", service.policy.dataset).exact_epsilon


def _run(conn: dpsql.Connection, sql: str, epsilon: str | None = None) -> list:
    cur = conn.cursor()
    if epsilon is not None:
        cur.execute(f"SET epsilon = {epsilon}")
    cur.execute(sql)
    return cur.fetchall()


def _refused(fresh, sql: str, epsilon: str | None = None) -> dpsql.Error:
    service, spy, conn = fresh
    with pytest.raises(dpsql.Error) as info:
        _run(conn, sql, epsilon)
    assert not isinstance(info.value, ChargedFailure), info.value.message
    assert spy.reads == 0, "a refusal must not read data"
    assert _spent(service) == 0, "a refusal must not spend budget"
    assert info.value.hint, "a refusal says what to do"
    return info.value


class Counter:
    def __init__(self, wrapped) -> None:
        self.wrapped, self.calls = wrapped, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.wrapped(*args, **kwargs)


def count_method(monkeypatch, cls, name: str) -> Counter:
    """Count the calls of a method (a plain function, so it still binds ``self``)."""
    counter = Counter(getattr(cls, name))

    def method(self, *args, **kwargs):
        return counter(self, *args, **kwargs)

    monkeypatch.setattr(cls, name, method)
    return counter


# --- rule lists: the count margin (the hour-long loop of issue 25) ---------------------------


@pytest.mark.parametrize("scale", [0.3, 1.0, 37.5, 1e4, 9e8, 9e12, 1.5e16])
def test_count_margin_is_a_galloping_search_not_unit_steps(monkeypatch, scale):
    tail = Counter(mechanisms.discrete_laplace_tail)
    monkeypatch.setattr(mechanisms, "discrete_laplace_tail", tail)
    t = count_margin(scale, 0.05)
    # the definition: P(|Z| > t) <= α/2, and t is the smallest such
    assert 2 * tail.wrapped(scale, t + 1) <= 0.025
    assert t == 0 or 2 * tail.wrapped(scale, t) > 0.025
    # O(log) of the guess's error (<= 1 step away here), whatever the scale
    assert tail.calls <= 2 * 64 + 4


def test_rule_list_at_epsilon_1e_12_answers_with_bounded_steps(fresh, monkeypatch):
    """dp_rule_list(epsilon => 1e-8) ran for about an hour after the charge; at 1e-12 it
    would have run for days. Now: at most max_length - 1 positions, O(log) margin steps."""
    service, spy, conn = fresh
    tail = Counter(mechanisms.discrete_laplace_tail)
    monkeypatch.setattr(mechanisms, "discrete_laplace_tail", tail)
    counts = count_method(monkeypatch, learner.RuleCounter, "counts")
    rows = _run(conn, RULE_LIST.format(eps="1e-12"))
    assert 1 <= len(rows) <= 5 and rows[-1][6] is True  # ends with the default rule
    assert spy.reads == 1 and _spent(service) == Fraction(1, 10**12)
    assert counts.calls <= 5 - 1  # max_length - 1 rule positions
    assert tail.calls <= len(rows) * (2 * 64 + 4)  # one margin search per released rule


@pytest.mark.parametrize("epsilon", ["1e-16", "1e-300", "5e-324"])
def test_rule_list_epsilon_too_small_to_draw_is_refused_free(fresh, epsilon):
    error = _refused(fresh, RULE_LIST.format(eps=epsilon))
    assert error.sqlstate == "22023" and error.construct == "epsilon"
    assert "is too small for dp_rule_list" in error.message
    assert "raise epsilon" in error.hint


@pytest.mark.parametrize(
    "mechanism", ["smooth_laplace", "smooth_cauchy", "global_laplace", "global_gaussian"]
)
def test_every_rule_list_mechanism_is_checked_drawable_before_the_charge(mechanism):
    ok = LearnerParams(epsilon=1e-9, delta=1e-6, max_length=3, mechanism=mechanism)
    check_drawable(ok, learner.plan_budget(ok))
    for eps in (5e-324, 1e-300, 1e-17):
        bad = LearnerParams(epsilon=eps, delta=1e-6, max_length=3, mechanism=mechanism)
        with pytest.raises(ValueError):
            check_drawable(bad, learner.plan_budget(bad))
    zero = BudgetPlan(0.0, 1e-6, 3, learner.plan_budget(ok).cost)
    with pytest.raises(ValueError):
        check_drawable(ok, zero)


def test_learner_checks_for_cancel_once_per_rule_position():
    features = tuple(Feature(f"f{j}", f"f{j} = 1", f"not f{j}", f"f{j} = 0") for j in range(3))
    candidates = [(Literal(j, True),) for j in range(3)]
    X = np.array([[1, 0, 0], [0, 1, 0], [0, 0, 1], [1, 1, 0]] * 50, dtype=np.int8)
    y = np.array([1, 0, 1, 0] * 50, dtype=np.int8)
    calls = Counter(lambda: None)
    params = LearnerParams(epsilon=1e-12, max_length=100, mechanism="monotone_em")
    learn_patterns(
        Patterns.from_rows(X, y, None), features, candidates, params, SeededNoise(1), check=calls
    )
    # min(max_length - 1, candidates) positions at most: one check each
    assert 1 <= calls.calls <= len(candidates)


def test_a_cancel_reaches_rule_list_learning_after_the_read(fresh, monkeypatch):
    service, spy, conn = fresh
    counts = count_method(monkeypatch, learner.RuleCounter, "counts")
    spy.cancel_after_read = conn
    with pytest.raises(ChargedFailure) as info:
        _run(conn, RULE_LIST.format(eps="1e-12"))
    assert info.value.sqlstate == "57014"
    assert info.value.message == CANCELLED_AFTER_READ
    assert spy.reads == 1 and _spent(service) == Fraction(1, 10**12)  # read, so charged
    assert counts.calls == 0, "learning stopped at its first position"


def test_a_cancel_reaches_regression_fitting_after_the_read(fresh, monkeypatch):
    from dpsql.models import dpsgd

    _, spy, conn = fresh
    steps = Counter(dpsgd.poisson_sample)
    monkeypatch.setattr(dpsgd, "poisson_sample", steps)
    spy.cancel_after_read = conn
    sql = (
        "SELECT * FROM dp_logistic_regression('visits', label => 'readmitted', "
        "features => 'age', delta => 1e-6, epsilon => 1.0, steps => 100000)"
    )
    with pytest.raises(ChargedFailure) as info:
        _run(conn, sql)
    assert info.value.sqlstate == "57014" and info.value.message == CANCELLED_AFTER_READ
    assert steps.calls == 0, "DP-SGD stopped before its first of 100000 steps"


# --- quantiles --------------------------------------------------------------------------------


def test_a_long_quantile_level_is_released_exactly_not_failed(fresh):
    """QUANTILE_CONT(x, 1e-20): its denominator 10^20 overflowed int64 after the charge."""
    _, spy, conn = fresh
    for level in ("1e-20", "0.123456789012", "1e-300"):
        (row,) = _run(conn, f"SELECT QUANTILE_CONT(age, {level}) FROM visits")
        assert 0 <= row[0] <= 100
    assert spy.reads >= 3


def test_rank_distances_never_wrap_around():
    """A 12-digit level times ten million values exceeds int64: numpy used to wrap silently
    (a wrong EM distribution); the arithmetic now switches to Python integers."""
    counts = np.zeros(8, dtype=np.int64)
    counts[[1, 6]] = 5_000_000
    for q in (Fraction(123456789012, 10**12), Fraction(1, 10**20)):
        d, den = quantiles.distances(counts, q * int(counts.sum()))
        n, below = int(counts.sum()), 0
        for b, c in enumerate(counts.tolist()):
            lo, hi = below * den, (below + int(c)) * den
            tau = q * n * den
            assert int(d[b]) == max(lo - tau, tau - hi, 0)
            below += int(c)
        s, den_s = quantiles.cdf_distances(counts, q)
        assert den_s == q.denominator and all(int(v) >= 0 for v in s)


@pytest.mark.parametrize("epsilon", [1e-12, 2.0**-40, 1e-300, 1e-320])
def test_the_exponential_mechanism_runs_at_any_positive_epsilon(epsilon):
    """ε below 2^-32 per EM made it refuse after the charge; ε' keeps 32 significant bits."""
    below = quantiles._epsilon_below(epsilon)
    assert 0 < below <= Fraction(epsilon)
    assert Fraction(epsilon) - below <= Fraction(epsilon) * Fraction(1, 2**31)
    grid = quantiles.Grid(0.0, 100.0, 64)
    quantiles.check_drawable(grid, epsilon, [1, 3])
    counts = np.arange(64, dtype=np.int64)
    em = quantiles.ExponentialQuantile(grid, epsilon)
    assert 0 <= em.release(counts, quantiles.target("quantile", 0.5), SeededNoise(3)).bin < 64
    joint = quantiles.JointQuantiles(grid, epsilon)
    assert len(joint.release(counts, [0.25, 0.5, 0.75], SeededNoise(3))) == 3


def test_an_epsilon_that_underflows_to_zero_per_level_is_refused_by_the_plan_check():
    grid = quantiles.Grid(0.0, 100.0, 64)
    quantiles.check_drawable(grid, 5e-324, [1])  # one EM at the smallest double
    with pytest.raises(ValueError):
        quantiles.check_drawable(grid, 5e-324, [3])  # ε/2 per level is 0.0
    with pytest.raises(ValueError):
        quantiles.check_drawable(grid, math.inf, [1])


@pytest.mark.parametrize("sql", ["MEDIAN(age)", "MIN(age), MAX(age)", "QUANTILE_CONT(age, 0.9)"])
@pytest.mark.parametrize("epsilon", ["1e-12", "1e-300"])
def test_quantiles_at_tiny_epsilon_answer(fresh, sql, epsilon):
    service, spy, conn = fresh
    rows = _run(conn, f"SELECT {sql} FROM visits", epsilon)
    assert len(rows) == 1 and spy.reads >= 1
    assert 0 < float(_spent(service)) <= float(epsilon) * (1 + 1e-12)


def test_quantile_epsilon_that_underflows_to_zero_is_refused_free(fresh):
    error = _refused(
        fresh, "SELECT department, MEDIAN(age) FROM visits GROUP BY department", "5e-324"
    )
    assert error.sqlstate == "22023" and error.construct == "epsilon"


def test_a_cancel_reaches_the_quantile_release_loop(fresh):
    service, spy, conn = fresh
    spy.cancel_after_read = conn
    with pytest.raises(ChargedFailure) as info:
        _run(conn, "SELECT department, MEDIAN(age) FROM visits GROUP BY department", "1.0")
    assert info.value.sqlstate == "57014" and info.value.message == CANCELLED_AFTER_READ
    assert 0 < _spent(service) <= 1


def test_the_smooth_median_sensitivity_is_one_numpy_pass_equal_to_the_definition():
    rng = np.random.default_rng(5)
    for n, r, beta in ((0, 1, 0.1), (1, 1, 1.0), (9, 2, 0.3), (200, 3, 1e-12), (501, 1, 2.0)):
        x = np.sort(rng.integers(0, 50, n)).astype(np.float64)
        got = quantiles.smooth_sensitivity_median(x, 0.0, 50.0, beta, r)
        padded = np.concatenate([[0.0], x, [50.0]])
        m = (n + 1) // 2
        want = max(
            math.exp(-k * beta)
            * (padded[min(m + 2 * r * (k + 1), n + 1)] - padded[max(m - 2 * r * (k + 1), 0)])
            for k in range(n + 2)
        )
        assert got == pytest.approx(want, rel=1e-12, abs=0)


# --- partition selection: free work, bounded and cached ---------------------------------------


def test_optimal_selection_table_is_refused_from_its_closed_form_and_cached(monkeypatch):
    builds = Counter(partition._build_table)
    monkeypatch.setattr(partition, "_build_table", builds)
    partition._keep_table.cache_clear()
    for _ in range(3):
        with pytest.raises(ValueError, match="units per group"):
            partition.keep_table(1e-9, 1e-8)
    assert builds.calls == 0, "refused before any step of the table"
    assert partition._keep_table.cache_info().hits == 2, "the refusal is cached"
    partition.keep_table(0.5, 1e-6)
    partition.keep_table(0.5, 1e-6)
    assert builds.calls == 1


@pytest.mark.parametrize(
    ("epsilon", "delta"), [(1.0, 1e-6), (0.01, 1e-6), (1e-4, 1e-6), (3.0, 0.2), (60.0, 1e-9)]
)
def test_the_table_length_closed_form_is_within_one_step(epsilon, delta):
    n = len(partition.keep_table(epsilon, delta)) - 1
    assert partition.table_length(epsilon, delta) <= n <= partition.table_length(epsilon, delta) + 1


def test_thresholded_group_by_at_small_epsilon_plans_without_building_a_table(fresh, monkeypatch):
    """'auto' at ε = 1e-12 built ~2M big-integer steps before giving up, every time."""
    service, spy, conn = fresh
    builds = Counter(partition._build_table)
    monkeypatch.setattr(partition, "_build_table", builds)
    cur = conn.cursor()
    cur.execute("SET epsilon = 1e-12")
    for _ in range(3):
        cur.execute("EXPLAIN SELECT diagnosis, COUNT(*) FROM visits GROUP BY diagnosis")
    assert builds.calls == 0 and spy.reads == 0 and _spent(service) == 0
    cur.execute("SET partition_selection = 'optimal'")
    error = _refused(fresh, "SELECT diagnosis, COUNT(*) FROM visits GROUP BY diagnosis")
    assert "needs too many units per group" in error.message
    assert builds.calls == 0


# --- every mechanism is checked before the reserve ----------------------------------------------


def test_interval_simulation_at_the_largest_drawable_scale():
    """1 − exp(−1/b) rounded to 0 above b ≈ 9e15 and rng.geometric(0) failed after the charge."""
    mech = Laplace(l1=1.0, epsilon=1 / 1.5e16)
    check_laplace_drawable(mech.scale)
    draws = _approximate_noise(mech, np.random.default_rng(0), 1000)
    assert np.all(np.isfinite(draws)) and draws.std() > 1e15


QUERIES = [
    "SELECT COUNT(*) FROM visits",
    "SELECT department, COUNT(*), AVG(cost) FROM visits GROUP BY department",
    "SELECT diagnosis, COUNT(*) FROM visits GROUP BY diagnosis",
    "SELECT MEDIAN(age), QUANTILE_CONT(age, 1e-20) FROM visits",
    "SELECT department, MIN(age), MAX(age) FROM visits GROUP BY department",
    "SELECT SUM(cost), STDDEV(cost) FROM visits",
    RULE_LIST.format(eps="1e-12").replace(", epsilon => 1e-12", ""),
    "SELECT * FROM dp_linear_regression('visits', label => 'cost', features => 'age', "
    "noise => 'laplace')",
]


@pytest.mark.parametrize("epsilon", TINY)
@pytest.mark.parametrize("sql", QUERIES)
def test_at_any_tiny_epsilon_a_query_answers_or_is_refused_free(fresh, sql, epsilon):
    """The class behind issue 25's items 2 and 4: a mechanism that cannot run at its ε is
    refused before the reserve (22023, nothing read or spent); none fails after it."""
    service, spy, conn = fresh
    try:
        _run(conn, sql, epsilon)
    except dpsql.Error as exc:
        assert exc.message not in (FAILED_AFTER_READ, CANCELLED_AFTER_READ), sql
        assert not isinstance(exc, ChargedFailure), exc.message
        assert spy.reads == 0 and _spent(service) == 0, exc.message
        assert exc.sqlstate == "22023" and exc.hint, exc.message
    else:
        assert spy.reads >= 1
        assert _spent(service) > 0


def test_the_drawable_check_refuses_with_what_to_do(fresh):
    error = _refused(fresh, "SELECT department, COUNT(*) FROM visits GROUP BY department", "1e-300")
    assert error.sqlstate == "22023" and error.construct == "epsilon"
    assert error.message.startswith("cannot draw noise for")
    assert "raise epsilon" in error.hint and "nothing was spent" in error.hint
    assert "Error" not in error.message and "ValueError" not in error.message


def test_cancel_check_is_the_57014_cancel():
    handle = QueryHandle()
    check = cancel_check(handle)
    check()
    handle.interrupt()
    with pytest.raises(dpsql.OperationalError) as info:
        check()
    assert info.value.sqlstate == "57014"
    cancel_check(None)()  # no handle: never cancelled


def test_zero_noise_hook_still_exact_for_long_levels():
    """The object-integer path picks the same best bin as the int64 path."""
    grid = quantiles.Grid(0.0, 10.0, 10)
    counts = np.array([0, 3, 0, 0, 2, 0, 0, 0, 5, 0], dtype=np.int64)
    em = quantiles.ExponentialQuantile(grid, 1.0)
    short = em.release(counts, quantiles.target("quantile", 0.5), ZeroNoise()).bin
    tgt = quantiles.Target(Fraction(1, 2) - Fraction(1, 10**25))
    assert em.release(counts, tgt, ZeroNoise()).bin == short
