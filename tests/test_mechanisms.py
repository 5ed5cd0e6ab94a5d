"""Calibration: analytic Gaussian σ, zCDP conversion, intervals and τ from the exact pmf,
fixed-point release on the granularity lattice."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import integrate, stats

from dpsql.privacy.accounting import Cost, rho_to_epsilon
from dpsql.privacy.mechanisms import (
    Gaussian,
    Laplace,
    analytic_gaussian_sigma,
    classical_gaussian_sigma,
    discrete_gaussian_tail,
    discrete_laplace_tail,
    gaussian_delta,
    lattice_granularity,
    release_fixed_point,
    zcdp_rho,
)
from dpsql.privacy.samplers import SeededNoise, ZeroNoise, gaussian_sigma2, laplace_scale

# --- analytic Gaussian ----------------------------------------------------------------------


def hockey_stick(sigma: float, l2: float, epsilon: float) -> float:
    """δ(ε) of N(0,σ²) vs N(Δ,σ²) by numerical integration of ∫ max(0, p − e^ε q):
    independent of the closed form of Balle & Wang's Theorem 8."""
    p = stats.norm(0, sigma).pdf
    q = stats.norm(l2, sigma).pdf
    # p > e^ε q exactly for x < Δ/2 − εσ²/Δ
    cut = l2 / 2 - epsilon * sigma**2 / l2
    val, _ = integrate.quad(
        lambda x: p(x) - math.exp(epsilon) * q(x), cut - 40 * sigma, cut, epsabs=1e-300
    )
    return val


CASES = [(0.1, 1e-5), (0.5, 1e-6), (1.0, 1e-5), (2.0, 1e-8), (5.0, 1e-5), (10.0, 1e-9)]


@pytest.mark.parametrize(("eps", "delta"), CASES)
def test_analytic_sigma_meets_delta_exactly(eps: float, delta: float) -> None:
    sigma = analytic_gaussian_sigma(1.0, eps, delta)
    assert gaussian_delta(sigma, 1.0, eps) <= delta  # valid, for every ε
    assert gaussian_delta(sigma * (1 - 1e-9), 1.0, eps) > delta  # and the smallest such σ
    assert hockey_stick(sigma, 1.0, eps) == pytest.approx(delta, rel=1e-6)


def test_analytic_sigma_reference_value() -> None:
    """ε = 1, δ = 1e-5, Δ = 1: σ ≈ 3.7306 (the value quoted for Balle & Wang's calibration;
    checked here against the numerical integral above), versus 4.8448 for the classical bound."""
    assert analytic_gaussian_sigma(1.0, 1.0, 1e-5) == pytest.approx(3.73063, abs=1e-5)
    assert classical_gaussian_sigma(1.0, 1.0, 1e-5) == pytest.approx(4.84481, abs=1e-5)


@pytest.mark.parametrize(("eps", "delta"), [(0.05, 1e-6), (0.1, 1e-5), (0.5, 1e-5), (0.9, 1e-3)])
def test_analytic_beats_classical_below_one(eps: float, delta: float) -> None:
    assert analytic_gaussian_sigma(1.0, eps, delta) < classical_gaussian_sigma(1.0, eps, delta)


def test_classical_bound_is_invalid_for_large_epsilon() -> None:
    """Why the analytic calibration is needed: at ε = 10 the classical σ is too small."""
    eps, delta = 10.0, 1e-9
    assert gaussian_delta(classical_gaussian_sigma(1.0, eps, delta), 1.0, eps) > delta
    assert gaussian_delta(analytic_gaussian_sigma(1.0, eps, delta), 1.0, eps) <= delta


def test_analytic_sigma_scales_with_sensitivity() -> None:
    base = analytic_gaussian_sigma(1.0, 0.7, 1e-6)
    assert analytic_gaussian_sigma(37.0, 0.7, 1e-6) == pytest.approx(37 * base, rel=1e-10)
    assert analytic_gaussian_sigma(0.0, 0.7, 1e-6) == 0.0
    with pytest.raises(ValueError):
        analytic_gaussian_sigma(1.0, 0.0, 1e-6)
    with pytest.raises(ValueError):
        analytic_gaussian_sigma(1.0, 1.0, 0.0)


# --- zCDP ---------------------------------------------------------------------------------


def test_gaussian_cost_is_rho() -> None:
    g = Gaussian(l2=3.0, epsilon=1.0, delta=1e-6)
    assert g.rho == pytest.approx(9 / (2 * g.scale**2), rel=1e-15)
    assert g.cost == Cost(rho=g.rho)
    assert Laplace(l1=2.0, epsilon=0.3).cost == Cost(epsilon=0.3)


def test_rho_to_epsilon_formula() -> None:
    """Bun & Steinke 2016, Prop. 1.3: ε = ρ + 2√(ρ ln(1/δ))."""
    assert rho_to_epsilon(0.5, 1e-6) == pytest.approx(0.5 + 2 * math.sqrt(0.5 * math.log(1e6)))
    assert rho_to_epsilon(0.0, 1e-6) == 0.0
    assert rho_to_epsilon(0.1, 0.0) == math.inf
    assert rho_to_epsilon(0.1, 1e-9) > rho_to_epsilon(0.1, 1e-6) > rho_to_epsilon(0.01, 1e-6)


@pytest.mark.parametrize("sigma", [0.5, 1.0, 3.0, 10.0, 100.0])
@pytest.mark.parametrize("delta", [1e-3, 1e-6, 1e-10])
def test_rho_to_epsilon_is_valid_for_the_gaussian(sigma: float, delta: float) -> None:
    """The conversion must be conservative: the Gaussian with ρ = Δ²/2σ² really is
    (rho_to_epsilon(ρ, δ), δ)-DP by the exact profile of Balle & Wang."""
    rho = 1 / (2 * sigma**2)
    eps = rho_to_epsilon(rho, delta)
    assert gaussian_delta(sigma, 1.0, eps) <= delta
    # ... and it is an upper bound on the exact ε at this δ, loose by less than a factor 5 here
    exact = analytic_epsilon(sigma, delta)
    assert exact <= eps <= 5 * exact


@pytest.mark.parametrize(("eps", "delta"), [(0.1, 1e-6), (1.0, 1e-6), (3.0, 1e-9), (10.0, 1e-3)])
def test_zcdp_rho_inverts_the_conversion(eps: float, delta: float) -> None:
    rho = zcdp_rho(eps, delta)
    assert rho_to_epsilon(rho, delta) == pytest.approx(eps, rel=1e-12)
    sigma = 1 / math.sqrt(2 * rho)
    assert sigma >= analytic_gaussian_sigma(1.0, eps, delta)  # looser for a single release
    assert gaussian_delta(sigma, 1.0, eps) <= delta


def analytic_epsilon(sigma: float, delta: float) -> float:
    lo, hi = 0.0, 1.0
    while gaussian_delta(sigma, 1.0, hi) > delta:
        hi *= 2
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if gaussian_delta(sigma, 1.0, mid) <= delta else (mid, hi)
    return hi


# --- intervals and thresholds from the exact pmf ------------------------------------------


def laplace_tail_exact(mech: Laplace, m: int) -> float:
    """P(X >= m) from the closed form at the realised scale, in Fractions where possible."""
    q = math.exp(-1 / float(laplace_scale(mech.scale)))
    if m >= 0:
        return q**m / (1 + q)
    return 1 - q ** (1 - m) / (1 + q)


def gaussian_tail_exact(mech: Gaussian, m: int) -> float:
    """P(X >= m) by direct summation of the pmf (independent of the library's formula)."""
    s2 = float(gaussian_sigma2(mech.scale))
    width = math.ceil(60 * math.sqrt(s2)) + abs(m) + 5
    k = np.arange(-width, width + 1, dtype=np.float64)
    w = np.exp(-(k * k) / (2 * s2))
    return float(w[k >= m].sum() / w.sum())


LAPLACES = [Laplace(1, 5.0), Laplace(1, 1.0), Laplace(1, 0.1), Laplace(3, 0.01), Laplace(2, 1e-4)]
GAUSSIANS = [
    Gaussian(1, 5.0, 1e-5),
    Gaussian(1, 1.0, 1e-6),
    Gaussian(1, 0.1, 1e-6),
    Gaussian(4, 0.01, 1e-9),
]
TARGETS = [(1e-6, 1), (1e-6, 10), (1e-9, 3), (0.05, 1)]


def exact_tail(mech, m: int) -> float:
    return (laplace_tail_exact if isinstance(mech, Laplace) else gaussian_tail_exact)(mech, m)


@pytest.mark.parametrize("mech", LAPLACES + GAUSSIANS, ids=repr)
@pytest.mark.parametrize(("delta", "groups"), TARGETS)
def test_threshold_is_smallest_valid(mech, delta: float, groups: int) -> None:
    tau = mech.threshold(delta, groups)
    assert tau == int(tau)
    target = delta / groups
    # P(1 + X >= τ) = P(X >= τ − 1); tolerance: float rounding of the independent sums
    assert exact_tail(mech, int(tau) - 1) <= target * (1 + 1e-9)
    assert exact_tail(mech, int(tau) - 2) > target


@pytest.mark.parametrize("sigma", [0.3, 2.0, 700.0, 6000.0, 30000.0])
def test_discrete_gaussian_tail_matches_direct_sum(sigma: float) -> None:
    """Covers both branches (direct sum <= 5000, Euler–Maclaurin above)."""
    for m in (1, 2, math.ceil(sigma), math.ceil(3 * sigma), math.ceil(6 * sigma)):
        got = discrete_gaussian_tail(sigma, m)
        s2 = float(gaussian_sigma2(sigma))
        width = math.ceil(60 * math.sqrt(s2)) + m + 5
        k = np.arange(-width, width + 1, dtype=np.float64)
        w = np.exp(-(k * k) / (2 * s2))
        assert got == pytest.approx(float(w[k >= m].sum() / w.sum()), rel=1e-9, abs=1e-300)


def test_tails_at_zero_and_below() -> None:
    for tail in (discrete_laplace_tail, discrete_gaussian_tail):
        assert tail(2.0, 0) == pytest.approx(1 - tail(2.0, 1), rel=1e-14)  # symmetry
    q = math.exp(-1 / 2.0)
    assert discrete_laplace_tail(2.0, -3) == pytest.approx(1 - q**4 / (1 + q), rel=1e-14)


@pytest.mark.parametrize("mech", LAPLACES + GAUSSIANS, ids=repr)
@pytest.mark.parametrize("confidence", [0.5, 0.9, 0.95, 0.999])
def test_interval_is_smallest_covering(mech, confidence: float) -> None:
    h = int(mech.interval_halfwidth(confidence))
    # P(|X| <= h) = 1 − 2 P(X >= h + 1)
    assert 1 - 2 * exact_tail(mech, h + 1) >= confidence - 1e-12
    if h > 0:
        assert 1 - 2 * exact_tail(mech, h) < confidence


def test_interval_coverage_by_sampling() -> None:
    """The 95% interval covers ~95% of the noise actually drawn (5 standard errors)."""
    n = 100_000
    for mech in (Laplace(1, 0.05), Gaussian(1, 0.5, 1e-6)):
        h = mech.interval_halfwidth(0.95)
        draws = mech.sample(SeededNoise(13), n)
        p = 1 - 2 * exact_tail(mech, int(h) + 1)
        assert abs(np.mean(np.abs(draws) <= h) - p) < 5 * math.sqrt(p * (1 - p) / n)


def test_threshold_release_rate_by_sampling() -> None:
    """With a large δ the release probability of a count of 1 is observable."""
    n = 200_000
    mech = Laplace(1, 1.0)
    tau = mech.threshold(0.2, 1)
    released = np.mean(1 + mech.sample(SeededNoise(14), n) >= tau)
    p = laplace_tail_exact(mech, int(tau) - 1)
    assert p <= 0.2 and abs(released - p) < 5 * math.sqrt(p * (1 - p) / n)


def test_zero_sensitivity_and_validation() -> None:
    for mech in (Laplace(0, 1.0), Gaussian(0, 1.0, 1e-6)):
        assert not mech.sample(SeededNoise(0), 5).any()
        assert mech.interval_halfwidth() == 0.0
    assert Laplace(2, 1.0).sample(ZeroNoise(), 3).tolist() == [0, 0, 0]
    with pytest.raises(ValueError):
        Laplace(1, 0.0)
    with pytest.raises(ValueError):
        Laplace(-1, 1.0)
    with pytest.raises(ValueError):
        Gaussian(1, 1.0, 0.0)
    with pytest.raises(ValueError):
        Laplace(1, 1.0).threshold(0.0, 3)


def test_mechanisms_are_frozen_and_named() -> None:
    lap, gau = Laplace(1, 1.0), Gaussian(1, 1.0, 1e-6)
    assert (lap.name, gau.name) == ("laplace", "gaussian")
    assert lap.scale == 1.0 and gau.scale == analytic_gaussian_sigma(1, 1.0, 1e-6)
    with pytest.raises(AttributeError):
        lap.epsilon = 2.0  # type: ignore[misc]


# --- fixed-point release ------------------------------------------------------------------

ints = st.integers(min_value=-(2**51), max_value=2**51)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(ints, ints), min_size=1, max_size=20), st.integers(-40, 20))
def test_release_is_exact_on_power_of_two_lattice(pairs, exponent: int) -> None:
    g = math.ldexp(1.0, exponent)
    exact = np.array([a for a, _ in pairs], dtype=np.int64)
    noise = np.array([b for _, b in pairs], dtype=np.int64)
    out = release_fixed_point(exact, noise, g)
    for value, (a, b) in zip(out.tolist(), pairs, strict=True):
        assert Fraction(value) == Fraction(a + b) * Fraction(g)  # exactly k·g


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.tuples(ints, ints), min_size=1, max_size=20),
    st.floats(min_value=1e-9, max_value=1e6, allow_nan=False, allow_infinity=False),
)
def test_release_is_nearest_double_to_lattice_point(pairs, g: float) -> None:
    exact = np.array([a for a, _ in pairs], dtype=np.int64)
    noise = np.array([b for _, b in pairs], dtype=np.int64)
    out = release_fixed_point(exact, noise, g)
    for value, (a, b) in zip(out.tolist(), pairs, strict=True):
        point = Fraction(a + b) * Fraction(g)  # k · (granularity as represented)
        assert abs(Fraction(value) - point) <= Fraction(np.spacing(abs(value))) / 2
        assert value == float(np.float64(a + b) * g)


@settings(max_examples=200, deadline=None)
@given(ints, ints, ints, st.floats(min_value=1e-6, max_value=1e3))
def test_release_depends_on_the_noisy_integer_only(a: int, b: int, c: int, g: float) -> None:
    """(a, b) and (a + c, b − c) give the same noisy integer, hence bit-identical output:
    nothing about the exact value survives beyond the DP integer (Mironov 2012)."""
    one = release_fixed_point(np.array([a]), np.array([b]), g)
    two = release_fixed_point(np.array([a + c]), np.array([b - c]), g)
    assert one.tobytes() == two.tobytes()


def test_release_refuses_floats_and_overflow() -> None:
    with pytest.raises(TypeError):
        release_fixed_point(np.array([1.5]), np.array([1]), 0.1)
    with pytest.raises(OverflowError):
        release_fixed_point(np.array([2**62]), np.array([2**62]), 1.0)
    with pytest.raises(ValueError):
        release_fixed_point(np.array([1]), np.array([1]), 0.0)
    assert (
        release_fixed_point(np.array([], dtype=np.int64), np.array([], dtype=np.int64), 1.0).size
        == 0
    )


@pytest.mark.parametrize("x", [1.0, 0.3, 0.01, 1e-6, 7.0, 1024.0, 1e5])
def test_lattice_granularity_is_a_power_of_two_below(x: float) -> None:
    g = lattice_granularity(x)
    mantissa, _ = math.frexp(g)
    assert mantissa == 0.5 and x / 2 < g <= x
