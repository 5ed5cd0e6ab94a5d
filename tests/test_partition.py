"""Partition selection: the optimal keep probability (Desfontaines et al. 2022) and the
Gaussian threshold with reused counts."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import numpy as np
import pytest

from dpsql.privacy.accounting import exact
from dpsql.privacy.partition import (
    GRID_BITS,
    GaussianSelection,
    OptimalSelection,
    _exp_below,
    expected_suppression,
    keep_table,
)
from dpsql.privacy.samplers import SeededNoise, ZeroNoise

ONE = 1 << GRID_BITS
PARAMS = [(1.0, 1e-6), (0.1, 1e-6), (0.01, 1e-9), (3.0, 1e-5), (1e-3, 1e-6)]


def violations(table: list[int] | tuple[int, ...], epsilon: float, delta: float) -> list[int]:
    """Every n where the (ε, δ)-DP inequalities between counts n and n+1 fail, checked in
    exact rational arithmetic with a rational r <= e^ε (passing with r implies passing with
    e^ε): π(n+1) <= r π(n) + δ, 1 − π(n) <= r (1 − π(n+1)) + δ, and the two reverse ones."""
    r = _exp_below(epsilon)
    assert r <= Fraction(math.exp(epsilon))
    d = Fraction(delta) * ONE
    bad = []
    for n in range(len(table) - 1):
        p, q = Fraction(table[n]), Fraction(table[n + 1])
        ok = (
            q <= r * p + d
            and ONE - p <= r * (ONE - q) + d
            and p <= r * q + d
            and ONE - q <= r * (ONE - p) + d
        )
        if not ok:
            bad.append(n)
    return bad


@pytest.mark.parametrize("epsilon,delta", PARAMS)
def test_keep_table_is_private_exactly_monotone_and_saturates(epsilon, delta) -> None:
    table = keep_table(epsilon, delta)
    assert table[0] == 0 and table[-1] == ONE
    assert all(a <= b for a, b in itertools.pairwise(table))
    assert violations(table, epsilon, delta) == []
    # Beyond the saturation point π stays 1, and 1 vs 1 is private trivially.
    sel = OptimalSelection(epsilon, delta)
    assert sel.keep_probability(sel.saturation + 5) == 1.0 and sel.keep_probability(0) == 0.0


@pytest.mark.parametrize("epsilon,delta", PARAMS)
def test_keep_table_matches_the_closed_form_and_is_tight(epsilon, delta) -> None:
    """Below the crossing π(n) = δ(e^{nε} − 1)/(e^ε − 1) (the paper's closed form); every
    step is the smaller of the two bounds, up to the grid (optimality: no larger π is DP)."""
    table = keep_table(epsilon, delta)
    e = math.exp(epsilon)
    for n in range(1, len(table)):
        p = table[n - 1] / ONE
        bound = min(e * p + delta, 1 - (1 - p - delta) / e, 1.0)
        assert table[n] / ONE == pytest.approx(bound, rel=1e-9, abs=4 * 2.0**-GRID_BITS)
        closed = delta * math.expm1(n * epsilon) / math.expm1(epsilon)
        if closed < 0.5 and n * epsilon < 700:
            # the crossing is where e^ε π + δ meets the other bound, above 1/2 − δ
            # grid rounding: at most one 2⁻⁵³ lost per step, amplified by e^ε per step after
            grid = n * math.exp(n * epsilon) * 2.0**-GRID_BITS
            assert table[n] / ONE == pytest.approx(closed, rel=1e-9, abs=grid)


def test_a_broken_table_is_caught() -> None:
    """The checker and the empirical audit below catch a table built for 2ε, and one that
    ignores the second (suppression-side) bound."""
    eps, delta = 1.0, 1e-6
    assert violations(keep_table(2 * eps, delta), eps, delta) != []
    # Only the first branch, capped at 1: P(drop) shrinks too fast near saturation.
    first_only = [0]
    for _ in range(40):
        first_only.append(min(ONE, math.floor(first_only[-1] * math.exp(eps) + delta * ONE)))
    assert violations(first_only, eps, delta) != []


def test_groups_per_unit_split_epsilon_and_delta() -> None:
    sel = OptimalSelection(1.0, 1e-6, max_groups=3)
    eps, delta = sel.per_group
    assert eps * 3 <= 1.0 and delta * 3 <= 1e-6
    assert sel.table == keep_table(eps, delta)
    assert sel.cost.epsilon == 1.0 and sel.cost.delta == 1e-6
    assert sel.cost.exact_zrho == 3 * exact(eps) ** 2 / 2  # per-group zCDP, summed
    assert exact(eps) >= Fraction(eps)  # the rational charged is never below the float run
    assert OptimalSelection(1.0, 1e-6).saturation < sel.saturation


def test_keep_draw_is_exactly_u_below_pi() -> None:
    sel = OptimalSelection(1.0, 1e-6)
    n = 14
    p = sel.keep_numerator(n) * 2.0**-GRID_BITS

    class Fixed:
        def __init__(self, u: float) -> None:
            self.u = u

        def uniform(self, size: int) -> np.ndarray:
            return np.full(size, self.u)

    assert sel.keep(np.array([n]), Fixed(math.nextafter(p, 0)))[0]
    assert not sel.keep(np.array([n]), Fixed(p))[0]
    assert not sel.keep(np.array([0]), Fixed(0.0))[0]  # an absent key is never made up
    assert sel.keep(np.array([1, 10_000]), ZeroNoise()).tolist() == [True, True]


def _keep_rate(sel, n: int, draws: int, seed: int) -> float:
    return float(np.mean(sel.keep(np.full(draws, n), SeededNoise(seed))))


@pytest.mark.parametrize("n", [12, 13, 14, 16])
def test_empirical_audit_on_neighbouring_counts(n: int) -> None:
    """P(keep | n+1) <= e^ε P(keep | n) + δ and P(drop | n) <= e^ε P(drop | n+1) + δ on
    200,000 draws each (fixed seeds), with a 5-standard-error tolerance; the 2ε table fails."""
    eps, delta, draws = 1.0, 1e-6, 200_000
    sel = OptimalSelection(eps, delta)
    lo, hi = _keep_rate(sel, n, draws, 1), _keep_rate(sel, n + 1, draws, 2)
    assert lo == pytest.approx(sel.keep_probability(n), abs=5 * math.sqrt(0.25 / draws))

    def slack(p: float) -> float:
        return 5 * math.sqrt(max(p * (1 - p), 1e-6) / draws) * (1 + math.e)

    assert hi <= math.exp(eps) * lo + delta + slack(hi)
    assert 1 - lo <= math.exp(eps) * (1 - hi) + delta + slack(lo)
    # The broken variant (a table for 2ε), audited where it is not yet saturated.
    broken = OptimalSelection(2 * eps, delta)
    m = 6 + n % 3  # 6, 7 or 8: where the 2ε table rises
    assert 0.01 < broken.keep_probability(m) < 0.99
    b_lo, b_hi = _keep_rate(broken, m, draws, 3), _keep_rate(broken, m + 1, draws, 4)
    violated = b_hi > math.exp(eps) * b_lo + delta + slack(b_hi) or (
        1 - b_lo > math.exp(eps) * (1 - b_hi) + delta + slack(b_lo)
    )
    assert violated


def test_optimal_selection_suppresses_far_less_than_gaussian_thresholding() -> None:
    """Unit counts of PUMS GROUP BY educ (public sample; fixed here): expected suppression."""
    counts = np.array([13, 14, 17, 21, 24, 24, 31, 33, 38, 51, 54, 60, 76, 165, 178, 201])
    optimal = expected_suppression(OptimalSelection(1.0, 1e-6), counts)
    gaussian = expected_suppression(GaussianSelection(1.0, 1e-6), counts)
    assert optimal == pytest.approx(0.0661, abs=5e-4)
    assert gaussian > 3 * optimal
    # Empirically, 2,000 runs: within 4 standard errors of the exact expectation.
    sel = OptimalSelection(1.0, 1e-6)
    source = SeededNoise(11)
    rates = [1 - np.mean(sel.keep(counts, source)) for _ in range(2000)]
    assert np.mean(rates) == pytest.approx(optimal, abs=4 * np.std(rates) / math.sqrt(2000))


def test_gaussian_selection_reuses_its_noisy_counts() -> None:
    sel = GaussianSelection(1.0, 1e-6, max_groups=2)
    assert sel.mechanism.l2 == pytest.approx(math.sqrt(2))
    assert sel.cost.delta == 5e-7 and sel.cost.rho == pytest.approx(
        2 / (2 * sel.mechanism.scale**2)
    )
    counts = np.array([5, 40, 300])
    keep, noisy = sel.select(counts, SeededNoise(5))
    assert keep.tolist() == (noisy >= sel.tau).tolist()
    draws = 20_000
    many = sel.keep(np.full(draws, int(sel.tau)), SeededNoise(9))
    assert 1 - many.mean() == pytest.approx(
        sel.suppression_probability(int(sel.tau)), abs=5 * math.sqrt(0.25 / draws)
    )
    assert sel.suppression_probability(1) > 1 - 1e-6


def test_bad_parameters_are_refused() -> None:
    for args in ((0.0, 1e-6), (1.0, 0.0), (1.0, 1.0), (math.inf, 1e-6)):
        with pytest.raises(ValueError):
            OptimalSelection(*args)
    with pytest.raises(ValueError):
        OptimalSelection(1.0, 1e-6, max_groups=0)
    with pytest.raises(ValueError, match="units per group"):
        keep_table(1e-9, 1e-8)
