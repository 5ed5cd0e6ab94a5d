"""Smooth-sensitivity mechanisms: closed-form constants, noise law, and the admissibility
conditions (sliding and dilation) checked numerically on the densities themselves."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import integrate, stats

from dpsql.privacy.samplers import SeededNoise, ZeroNoise
from dpsql.privacy.smooth import SmoothCauchy, SmoothLaplace

EPSILONS = [0.05, 0.5, 1.0, 4.0]


@pytest.mark.parametrize("eps", EPSILONS)
def test_cauchy_closed_forms(eps: float) -> None:
    m = SmoothCauchy(eps)
    assert m.beta == pytest.approx(eps / 6, rel=1e-15)  # ε / (2(γ+1)), γ = 2
    assert m.alpha == pytest.approx(eps / 6, rel=1e-15)
    assert m.delta == 0.0
    assert m.scale(0.3) == pytest.approx(6 * 0.3 / eps, rel=1e-15)


@pytest.mark.parametrize("eps", EPSILONS)
@pytest.mark.parametrize("delta", [1e-9, 1e-6, 1e-3])
def test_laplace_closed_forms(eps: float, delta: float) -> None:
    m = SmoothLaplace(eps, delta)
    assert m.beta == pytest.approx(eps / (2 * math.log(2 / delta)), rel=1e-15)
    assert m.alpha == pytest.approx(eps / 2, rel=1e-15)
    assert m.scale(0.3) == pytest.approx(2 * 0.3 / eps, rel=1e-15)


def test_noise_follows_the_scaled_law() -> None:
    """KS test of the draws divided by the closed-form scale (fixed seed; p floor 1e-4)."""
    s, eps = 0.02, 0.7
    z = SmoothCauchy(eps).noise(SeededNoise(1), s, size=50_000) / (6 * s / eps)
    assert stats.kstest(z, stats.cauchy().cdf).pvalue > 1e-4
    z = SmoothLaplace(eps, 1e-6).noise(SeededNoise(2), s, size=50_000) / (2 * s / eps)
    assert stats.kstest(z, stats.laplace().cdf).pvalue > 1e-4


def test_noise_shapes_and_edge_cases() -> None:
    m = SmoothCauchy(1.0)
    src = SeededNoise(3)
    assert m.noise(src, np.array([0.1, 0.2, 0.3])).shape == (3,)
    assert m.noise(src, 0.1, size=7).shape == (7,)
    assert m.noise(src, np.array([0.1, 0.2]), size=2).shape == (2,)
    assert m.noise(src, 0.1).shape == ()
    assert not m.noise(src, np.zeros(4)).any()  # S = 0: no noise needed
    assert not SmoothLaplace(1.0, 1e-6).noise(ZeroNoise(), 0.5, size=3).any()
    a = SmoothLaplace(1.0, 1e-6).noise(SeededNoise(9), [0.1, 0.2])
    b = SmoothLaplace(1.0, 1e-6).noise(SeededNoise(9), [0.1, 0.2])
    assert np.array_equal(a, b)
    with pytest.raises(ValueError):
        m.noise(src, -0.1)
    with pytest.raises(ValueError):
        SmoothCauchy(0.0)
    with pytest.raises(ValueError):
        SmoothLaplace(1.0, 0.0)


# --- admissibility (NRS 2007): sliding by α and dilating by e^λ, |λ| <= β -------------------

Z = np.linspace(-200, 200, 400_001)


def _log_cauchy(z: np.ndarray) -> np.ndarray:
    return -np.log1p(z * z) - math.log(math.pi)


@pytest.mark.parametrize("eps", EPSILONS)
def test_cauchy_is_admissible(eps: float) -> None:
    """Pointwise density ratios bound the set probabilities, with δ = 0."""
    m = SmoothCauchy(eps)
    for shift in (m.alpha, -m.alpha):
        assert np.max(_log_cauchy(Z) - _log_cauchy(Z + shift)) <= eps / 2 + 1e-12
    for lam in np.linspace(-m.beta, m.beta, 41):
        # density of e^λ Z at z is e^(-λ) h(e^(-λ) z)
        ratio = _log_cauchy(Z) - (-lam + _log_cauchy(np.exp(-lam) * Z))
        assert np.max(ratio) <= eps / 2 + 1e-12


@pytest.mark.parametrize("eps", EPSILONS)
@pytest.mark.parametrize("delta", [1e-6, 1e-3])
def test_laplace_is_admissible(eps: float, delta: float) -> None:
    """Sliding: ratio e^|Δ| <= e^(ε/2). Dilation: the hockey-stick divergence
    ∫ max(0, h(z) − e^(ε/2) e^(-λ) h(e^(-λ) z)) dz is <= δ/2 for every |λ| <= β."""
    m = SmoothLaplace(eps, delta)
    log_h = -np.abs(Z) - math.log(2)
    assert np.max(log_h - (-np.abs(Z + m.alpha) - math.log(2))) <= eps / 2 + 1e-12

    def excess(z: float, lam: float) -> float:
        h = 0.5 * math.exp(-abs(z))
        g = 0.5 * math.exp(-lam - abs(z) * math.exp(-lam))
        return max(0.0, h - math.exp(eps / 2) * g)

    for lam in np.linspace(-m.beta, m.beta, 21):
        div = 2 * integrate.quad(excess, 0, math.inf, args=(lam,), limit=200)[0]
        assert div <= delta / 2 * (1 + 1e-6)


def test_laplace_dilation_needs_the_delta() -> None:
    """The δ is not decorative: with β three times larger the divergence exceeds δ/2."""
    eps, delta = 1.0, 1e-6
    lam = -3 * SmoothLaplace(eps, delta).beta

    def excess(z: float) -> float:
        h = 0.5 * math.exp(-abs(z))
        g = 0.5 * math.exp(-lam - abs(z) * math.exp(-lam))
        return max(0.0, h - math.exp(eps / 2) * g)

    assert 2 * integrate.quad(excess, 0, math.inf, limit=200)[0] > delta / 2
