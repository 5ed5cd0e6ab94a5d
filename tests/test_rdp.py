"""The subsampled-Gaussian RDP accountant against published values and brute-force integrals."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from scipy import integrate

from dpsql.privacy.rdp import (
    DEFAULT_ORDERS,
    calibrate_noise_multiplier,
    compute_rdp,
    dpsgd_epsilon,
    rdp_subsampled_gaussian,
    rdp_to_epsilon,
)


def brute_force_rdp(q: float, z: float, alpha: float) -> float:
    """D_α(μ₁ ‖ μ₀) by numerical integration, μ₀ = N(0, z²), μ₁ = (1−q)N(0, z²) + qN(1, z²).

    Independent of the series: the integrand is E_μ₀[(μ₁/μ₀)^α], in log space.
    """

    def integrand(x: float) -> float:
        log_mu0 = -x * x / (2 * z * z) - math.log(z * math.sqrt(2 * math.pi))
        log_ratio = np.logaddexp(math.log1p(-q), math.log(q) + (2 * x - 1) / (2 * z * z))
        return math.exp(log_mu0 + alpha * log_ratio)

    # The mass sits near 0 and, for large α, near the shifted peak; split the line there.
    peak = alpha / 1.0
    points = sorted({-50 * z, 0.0, 0.5, min(peak, 50 * z), 60 * z + peak})
    total = 0.0
    for a, b in itertools.pairwise(points):
        part, _ = integrate.quad(integrand, a, b, limit=400, epsabs=0, epsrel=1e-12)
        total += part
    return math.log(total) / (alpha - 1)


# --- published values (TF-Privacy rdp_accountant_test.py, which checks them with mpmath) ----


def test_tf_privacy_scalar():
    assert compute_rdp(0.1, 2, 10, [5])[0] == pytest.approx(0.07737, abs=1e-5)


def test_tf_privacy_sequence_integer_fractional_and_infinite_orders():
    got = compute_rdp(0.01, 2.5, 50, [1.5, 2.5, 5, 50, 100, math.inf])
    want = [0.00065, 0.001085, 0.00218075, 0.023846, 167.416307]
    assert got[:5] == pytest.approx(want, abs=1e-5)
    assert got[5] == math.inf


def test_tf_privacy_epsilon_at_target_delta_classic_conversion():
    orders = range(2, 33)
    eps, order = rdp_to_epsilon(orders, compute_rdp(0.01, 4, 10_000, orders), 1e-5, improved=False)
    assert eps == pytest.approx(1.258575, abs=1e-5) and order == 20


def test_tf_privacy_composition_of_two_mechanisms():
    orders = (1.25, 1.5, 1.75, 2, 2.5, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32, 64, 256)
    rdp = compute_rdp(1e-4, 0.4, 40_000, orders) + compute_rdp(0.1, 2, 100, orders)
    eps, order = rdp_to_epsilon(orders, rdp, 1e-5, improved=False)
    assert eps == pytest.approx(8.509656, abs=1e-5) and order == 2.5


def test_improved_conversion_is_never_worse():
    for q, z, steps in [(0.01, 1.1, 10_000), (0.01, 4, 10_000), (0.1, 2, 100), (1.0, 5.0, 1)]:
        rdp = compute_rdp(q, z, steps)
        new, _ = rdp_to_epsilon(DEFAULT_ORDERS, rdp, 1e-5)
        old, _ = rdp_to_epsilon(DEFAULT_ORDERS, rdp, 1e-5, improved=False)
        assert new <= old


# --- brute force, integer and fractional orders ------------------------------------------


@pytest.mark.parametrize(
    "q, z, alpha",
    [
        (0.01, 1.1, 2),
        (0.01, 1.1, 8),
        (0.01, 1.1, 32),
        (0.01, 1.1, 1.5),
        (0.01, 1.1, 4.7),
        (0.01, 1.1, 17.3),
        (0.1, 2.0, 5),
        (0.1, 2.0, 2.5),
        (0.3, 0.8, 3),
        (0.3, 0.8, 3.25),
        (0.001, 0.6, 12.5),
    ],
)
def test_series_match_numerical_integration(q, z, alpha):
    series = rdp_subsampled_gaussian(q, z, alpha)
    assert series == pytest.approx(brute_force_rdp(q, z, alpha), rel=1e-6, abs=1e-12)


def test_opacus_style_example_q001_sigma11_10k_steps():
    """q = 0.01, σ = 1.1, 10k steps, δ = 1e-5: the curve checked point-wise by integration."""
    orders = [1.5, 2, 3, 4.5, 6, 8, 10, 12, 16]
    rdp = compute_rdp(0.01, 1.1, 10_000, orders)
    brute = [10_000 * brute_force_rdp(0.01, 1.1, a) for a in orders]
    assert rdp == pytest.approx(brute, rel=1e-6)
    eps, _ = rdp_to_epsilon(orders, brute, 1e-5)
    assert dpsgd_epsilon(0.01, 1.1, 10_000, 1e-5) <= eps + 1e-9
    # The improved-conversion figure on the default orders .
    assert dpsgd_epsilon(0.01, 1.1, 10_000, 1e-5) == pytest.approx(5.632, abs=2e-3)


def test_no_sampling_is_the_gaussian_mechanism():
    assert rdp_subsampled_gaussian(1.0, 2.0, 3.0) == pytest.approx(3 / 8)
    assert rdp_subsampled_gaussian(0.0, 2.0, 3.0) == 0.0
    # Full-batch Gaussian: RDP α/(2z²) converted is close to the exact (analytic) Gaussian.
    assert dpsgd_epsilon(1.0, 5.0, 1, 1e-5) < 1.1


def test_monotone_in_q_sigma_and_steps():
    base = dpsgd_epsilon(0.01, 1.0, 500, 1e-6)
    assert dpsgd_epsilon(0.02, 1.0, 500, 1e-6) > base
    assert dpsgd_epsilon(0.01, 1.2, 500, 1e-6) < base
    assert dpsgd_epsilon(0.01, 1.0, 1000, 1e-6) > base


@pytest.mark.parametrize("eps, q, steps", [(0.5, 0.01, 1000), (1.0, 0.02, 500), (8.0, 0.05, 200)])
def test_calibration_meets_the_target_and_is_tight(eps, q, steps):
    z = calibrate_noise_multiplier(eps, 1e-6, q, steps)
    assert dpsgd_epsilon(q, z, steps, 1e-6) <= eps
    assert dpsgd_epsilon(q, z * (1 - 1e-3), steps, 1e-6) > eps * 0.999


def test_refusals():
    with pytest.raises(ValueError):
        rdp_subsampled_gaussian(1.5, 1.0, 2)
    with pytest.raises(ValueError):
        calibrate_noise_multiplier(1.0, 0.0, 0.01, 10)
    with pytest.raises(ValueError):
        rdp_to_epsilon([2.0], [1.0], 0.0)
