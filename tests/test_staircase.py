"""The discrete staircase noise (dpsql.privacy.mechanisms.Staircase): its ε-DP ratio bound on
the integers (and two broken variants the same check catches), the exact sampler against the
pmf, its closed forms (E|X|, variance, tail) against direct sums, the interval's coverage, and
E|noise| below the discrete Laplace's at the same charge."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from conftest import exact_connect, fixture_policy
from scipy import stats

from dpsql.errors import InternalError
from dpsql.frontend.bind import parse_statement
from dpsql.plan.canonical import canonical
from dpsql.plan.check import check_plan
from dpsql.privacy.mechanisms import (
    Laplace,
    Staircase,
    quieter_sum_noise,
    staircase_expected_abs,
    staircase_step,
    staircase_tail,
    staircase_weight,
)
from dpsql.privacy.samplers import SeededNoise, ZeroNoise

CASES = [(1.0, 1), (1.0, 5), (0.5, 6), (2.0, 3), (0.9, 7), (1.0, 40), (0.1, 9)]


def exponent(m: int, period: int, step: int, decay: int = 1, inner: int = 1) -> int:
    """f(m) = e^(-ε · exponent(m)): j·decay for |m| in [jD, jD + g), j·decay + inner after.
    decay = inner = 1 is the staircase; anything else is a broken variant."""
    j, r = divmod(abs(m), period)
    return j * decay + (0 if r < step else inner)


def worst_jump(period: int, step: int, **broken: int) -> int:
    """max over m in a window and |d| <= D of exponent(m + d) − exponent(m): f(m)/f(m + d) is
    e^(ε · that), so ε-DP at sensitivity D needs it <= 1 (an exact integer check)."""
    window = range(-5 * period - 3, 5 * period + 4)
    return max(
        exponent(m + d, period, step, **broken) - exponent(m, period, step, **broken)
        for m in window
        for d in range(-period, period + 1)
    )


@pytest.mark.parametrize(("epsilon", "period"), CASES)
def test_ratio_bound_holds_for_the_chosen_step_and_every_other(epsilon: float, period: int):
    assert worst_jump(period, staircase_step(epsilon, period)) <= 1
    for step in range(period + 1) if period < 10 else ():  # any g in [0, D]: the proof
        assert worst_jump(period, step) <= 1  # does not use g
    # the weights the mechanism states are those exponents
    g = staircase_step(epsilon, period)
    for m in range(-3 * period, 3 * period):
        assert staircase_weight(epsilon, period, g, m) == math.exp(
            -exponent(m, period, g) * epsilon
        )


@pytest.mark.parametrize("period", [2, 5, 9])
def test_broken_staircases_fail_the_ratio_check(period: int):
    """A decay of e^(-2ε) per period, or an inner step of e^(-2ε), moves f by e^(2ε) within
    one sensitivity: the check above must see it."""
    step = max(1, period // 3)
    assert worst_jump(period, step, decay=2) == 2
    assert worst_jump(period, step, inner=2) == 2


@pytest.mark.parametrize(("epsilon", "period"), CASES)
def test_closed_forms_match_direct_sums(epsilon: float, period: int):
    s = Staircase(l1=float(period), epsilon=epsilon)
    g = s.step
    span = period * (math.ceil(60 / epsilon) + 2)
    m = np.arange(-span, span + 1)
    w = np.array([staircase_weight(epsilon, period, g, int(v)) for v in m])
    p = w / w.sum()
    assert s.expected_abs == pytest.approx(float((np.abs(m) * p).sum()), rel=1e-9)
    assert s.variance == pytest.approx(float((m * m * p).sum()), rel=1e-9)
    for k in (-period - 1, 0, 1, g, period, 2 * period + 1, 5 * period):
        assert staircase_tail(epsilon, period, g, k) == pytest.approx(
            float(p[m >= k].sum()), rel=1e-9, abs=1e-15
        )


@pytest.mark.parametrize(("epsilon", "period"), [(1.0, 5), (0.5, 12), (2.0, 30), (1.0, 40)])
def test_step_is_the_discrete_optimum(epsilon: float, period: int):
    best = min(range(period + 1), key=lambda g: staircase_expected_abs(epsilon, period, g))
    assert staircase_expected_abs(epsilon, period, staircase_step(epsilon, period)) == (
        pytest.approx(staircase_expected_abs(epsilon, period, best), rel=1e-12)
    )


def test_quieter_than_laplace_at_the_same_charge():
    """E|noise| of the staircase below the discrete Laplace's at the same ε and Δ (0.9595 of
    it at ε = 1 for large Δ), the same cost; at Δ = 1 they coincide and the Laplace stays."""
    for epsilon in (0.5, 1.0, 2.0):
        for l1 in (5.0, 100.0, 2.0**30):
            s, lap = Staircase(l1, epsilon), Laplace(l1, epsilon)
            assert s.expected_abs < lap.expected_abs
            assert s.cost == lap.cost
            assert s.privacy_map(l1, 0.0).epsilon == pytest.approx(epsilon)
            assert quieter_sum_noise(l1, epsilon) == s
    assert Staircase(2.0**30, 1.0).expected_abs / Laplace(2.0**30, 1.0).expected_abs == (
        pytest.approx(0.9595, abs=1e-4)
    )
    assert quieter_sum_noise(1.0, 1.0) == Laplace(1.0, 1.0)


def test_privacy_map_counts_periods_of_the_sensitivity():
    """Calibrated to D but run on a query that moves by 2D, the map states 2ε (so the plan
    check fails such a plan); a query that cannot change costs nothing; no noise costs ∞."""
    s = Staircase(l1=10.0, epsilon=0.7)
    assert s.privacy_map(10.0, 0.0).epsilon == pytest.approx(0.7)
    assert s.privacy_map(10.5, 0.0).epsilon == pytest.approx(0.7)  # integers move by <= 10
    assert s.privacy_map(11.0, 0.0).epsilon == pytest.approx(1.4)
    assert s.privacy_map(20.0, 0.0).epsilon == pytest.approx(1.4)
    assert s.privacy_map(0.0, 0.0).epsilon == 0
    assert math.isinf(Staircase(l1=0.0, epsilon=1.0).privacy_map(1.0, 0.0).epsilon)


def _chi_square_p(draws: np.ndarray, epsilon: float, period: int, step: int) -> float:
    lim = 6 * period
    z = sum(staircase_weight(epsilon, period, step, v) for v in range(-60 * period, 60 * period))
    cells = np.arange(-lim, lim + 1)
    p = np.array([staircase_weight(epsilon, period, step, int(v)) / z for v in cells])
    tail = (1 - p.sum()) / 2
    p = np.concatenate([[tail], p, [tail]])
    clipped = np.clip(draws, -lim - 1, lim + 1)
    observed = np.bincount(clipped + lim + 1, minlength=p.size)
    chi = float(((observed - p * draws.size) ** 2 / (p * draws.size)).sum())
    return float(stats.chi2.sf(chi, p.size - 1))


@pytest.mark.parametrize(("epsilon", "period", "seed"), [(1.0, 5, 1), (0.5, 6, 2), (2.0, 3, 3)])
def test_sampler_matches_the_pmf(epsilon: float, period: int, seed: int):
    """Chi-square of the exact sampler's draws against the pmf (cells |m| <= 6D, two tails),
    both paths: vectorised (100,000 draws) and one draw at a time (calls of <= 32 draws).
    Fixed seeds; p > 0.001 (a sampler off by one step or with the wrong decay gives p ~ 0)."""
    step = staircase_step(epsilon, period)
    source = SeededNoise(seed)
    many = source.discrete_staircase(epsilon, period, step, 100_000)
    assert _chi_square_p(many, epsilon, period, step) > 1e-3
    few = np.concatenate([source.discrete_staircase(epsilon, period, step, 30) for _ in range(200)])
    assert _chi_square_p(few, epsilon, period, step) > 1e-3
    # the same draws fail against a wrong step: the test has power
    assert _chi_square_p(many, epsilon, period, min(period, step + 2)) < 1e-6


def test_sampler_refuses_bad_parameters_and_zero_noise_is_zero():
    source = SeededNoise(0)
    with pytest.raises(ValueError):
        source.discrete_staircase(1.0, 0, 0, 3)
    with pytest.raises(ValueError):
        source.discrete_staircase(1.0, 4, 5, 3)
    with pytest.raises(ValueError):
        source.discrete_staircase(-1.0, 4, 1, 3)
    assert Staircase(l1=0.0, epsilon=1.0).sample(source, 4).tolist() == [0, 0, 0, 0]
    assert ZeroNoise().discrete_staircase(1.0, 4, 1, 2).tolist() == [0, 0]


def test_approximate_draws_follow_the_pmf():
    """The error bars' fast draws (numpy's generator) have the exact pmf too."""
    s = Staircase(l1=5.0, epsilon=1.0)
    draws = s.approximate(np.random.default_rng(4), 100_000).astype(np.int64)
    assert _chi_square_p(draws, 1.0, 5, s.step) > 1e-3


@pytest.mark.parametrize(("epsilon", "l1"), [(1.0, 5.0), (0.5, 1000.0), (2.0, 37.0)])
def test_interval_covers_at_its_level(epsilon: float, l1: float):
    """The 95% half-width h from the closed-form CDF: P(|X| <= h) >= 0.95 > P(|X| <= h − 1)
    exactly, and on 40,000 exact draws the coverage is 0.95 within 4 standard errors."""
    s = Staircase(l1=l1, epsilon=epsilon)
    for level in (0.5, 0.9, 0.95, 0.99):
        h = int(s.interval_halfwidth(level))
        assert 1 - 2 * s._tail(h + 1) >= level > 1 - 2 * s._tail(h)
    h = s.interval_halfwidth(0.95)
    draws = s.sample(SeededNoise(5), 40_000)
    covered = float(np.mean(np.abs(draws) <= h))
    assert covered >= 0.95 - 4 * math.sqrt(0.95 * 0.05 / draws.size)


def test_cache_key_tells_the_mechanisms_apart():
    """A plan's canonical text names the mechanism's class, so an answer released with one
    noise never serves a plan with the other (dpsql.plan.canonical)."""
    assert canonical(Staircase(5.0, 1.0)) != canonical(Laplace(5.0, 1.0))
    assert canonical(Staircase(5.0, 1.0)) == canonical(Staircase(5.0, 1.0))


# --- the plans that choose it --------------------------------------------------------------


@pytest.fixture(scope="module")
def conn():
    c = exact_connect(fixture_policy())
    yield c
    c.close()


def _plan(conn, sql: str):
    return conn.service.plan(parse_statement(sql, conn.service.policy), conn._settings)


def test_an_ungrouped_sum_gets_the_staircase_and_a_grouped_one_keeps_the_laplace(conn):
    """One unit moves an ungrouped SUM (G = 1) in one coordinate: the staircase, charged the
    same ε as the Laplace it replaces; over G = 3 groups the Laplace (module doc of
    :meth:`Staircase.privacy_map`). Counts and bias measures keep the Laplace."""
    plan = _plan(conn, "SELECT SUM(cost), AVG(cost) FROM visits")
    kinds = {m.kind: m.mechanism for m in plan.measures}
    assert isinstance(kinds["sum"], Staircase) and isinstance(kinds["values"], Laplace)
    assert all(isinstance(m.mechanism, Laplace) for m in plan.measures if m.measure_kind.bias)
    for m in plan.measures:
        assert m.mechanism.cost == Laplace(l1=m.l1, epsilon=m.epsilon).cost
    check_plan(plan)
    grouped = _plan(conn, "SELECT department, SUM(cost) FROM visits GROUP BY department")
    assert grouped.max_groups > 1
    assert all(isinstance(m.mechanism, Laplace) for m in grouped.measures)


def test_the_plan_check_refuses_a_staircase_the_tree_does_not_allow(conn):
    """Its own map, evaluated at the tree's sensitivity and G: on G = 3 groups the staircase
    at period G·p costs 3ε (each changed group up to ε), and one calibrated to a single row's
    range costs R·ε; both fail the check before any data is read."""
    grouped = _plan(conn, "SELECT department, SUM(cost) FROM visits GROUP BY department")
    m = grouped.measures[0]
    moved = dataclasses.replace(m, mechanism=Staircase(l1=m.l1, epsilon=m.epsilon))
    with pytest.raises(InternalError, match="charges epsilon"):
        check_plan(grouped.with_(measures=(moved, *grouped.measures[1:])))
    plan = _plan(conn, "SELECT SUM(cost) FROM visits")
    m = plan.measures[0]
    narrow = dataclasses.replace(m, mechanism=Staircase(l1=float(m.row_bound), epsilon=m.epsilon))
    with pytest.raises(InternalError, match="charges epsilon"):
        check_plan(plan.with_(measures=(narrow, *plan.measures[1:])))


def test_explain_names_the_staircase_and_the_answer_is_charged_its_epsilon(conn):
    cur = conn.cursor()
    cur.execute("EXPLAIN SELECT SUM(cost) FROM visits")
    rows = cur.fetchall()
    assert [r[2] for r in rows if r[1] == "sum(cost)"] == ["staircase"]
    assert any("m0: staircase noise" in str(r[1]) for r in rows if r[0] == "plan")
    plan = _plan(conn, "SELECT SUM(cost) FROM visits")
    assert float(plan.cost.epsilon) == pytest.approx(conn._settings.epsilon, rel=1e-12)


@pytest.mark.parametrize("epsilon", [2.0**-54, 1e-9, 0.01, 1.0, 30.0, 700.0, 1000.0, 1e6, 1e300])
@pytest.mark.parametrize("l1", [1.0, 3.0, 1e6, 2.0**40])
def test_the_choice_and_its_closed_forms_hold_at_any_epsilon(epsilon: float, l1: float) -> None:
    """A SUM's noise is chosen at planning, before anything is charged, for any ε a session
    may set (SET epsilon = 1000 in the BI replay): the closed forms never divide by zero or
    overflow (at ε = 1000, e^(-ε) is 0 in floats), the chosen noise has a finite E|X| and
    tails in [0, 1], and the staircase's step is >= 1."""
    noise = quieter_sum_noise(l1, epsilon)
    assert math.isfinite(noise.expected_abs) and noise.expected_abs >= 0
    for m in (-3, 0, 1, 2):
        assert 0.0 <= noise._tail(m) <= 1.0
    if isinstance(noise, Staircase):
        assert 1 <= noise.step <= noise.period


@pytest.mark.parametrize(("l1", "epsilon"), [(2.0**30, 2.0**-40), (1e6, 1e-12), (2.0**40, 1e-6)])
def test_a_staircase_beyond_the_samplers_range_is_refused_before_any_draw(
    l1: float, epsilon: float
) -> None:
    """The plan's drawability check samples 0 draws before the charge: a staircase whose
    draws could leave int64 (its magnitude is the Laplace's at scale D/ε) is refused there,
    exactly where the Laplace at that scale is, not by an overflow after the charge."""
    with pytest.raises(ValueError):
        Laplace(l1=l1, epsilon=epsilon).sample(SeededNoise(7), 0)
    with pytest.raises(ValueError):
        Staircase(l1=l1, epsilon=epsilon).sample(SeededNoise(7), 0)


def test_a_staircase_at_the_edge_of_the_range_draws_in_int64() -> None:
    """Just inside the Laplace's range, both paths draw without overflow."""
    noise = Staircase(l1=2.0**20, epsilon=2.0**-30)
    assert noise.sample(SeededNoise(7), 0).size == 0
    for size in (3, 40):
        assert noise.sample(SeededNoise(7), size).dtype == np.int64
