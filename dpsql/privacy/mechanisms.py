"""Calibrated additive-noise mechanisms: one object knows its scale, cost, intervals and τ.

All quantities are in noise units (integers). A mechanism is built from a sensitivity and a
privacy parameter, and is the single place where scale, privacy cost, the 95% interval and
the thresholding τ are derived, so they can never disagree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from scipy import optimize, special, stats

from dpsql.privacy.accounting import Cost
from dpsql.privacy.samplers import NoiseSource


def _norm_cdf(x: float) -> float:
    return 0.5 * special.erfc(-x / math.sqrt(2.0))


@lru_cache(maxsize=1024)
def analytic_gaussian_sigma(l2: float, epsilon: float, delta: float) -> float:
    """Smallest σ for which N(0, σ²) noise on an L2-sensitivity-``l2`` query is (ε, δ)-DP.

    Balle & Wang (2018), Theorem 8: the exact condition
    Φ(Δ/2σ − εσ/Δ) − e^ε Φ(−Δ/2σ − εσ/Δ) ≤ δ, solved numerically; valid for every ε > 0.
    """
    if l2 <= 0:
        return 0.0
    if not (epsilon > 0 and 0 < delta < 1):
        raise ValueError("the Gaussian mechanism needs epsilon > 0 and 0 < delta < 1")

    def excess(sigma: float) -> float:
        a = l2 / (2 * sigma)
        b = epsilon * sigma / l2
        return _norm_cdf(a - b) - math.exp(epsilon) * _norm_cdf(-a - b) - delta

    hi = l2
    while excess(hi) > 0:
        hi *= 2
    lo = hi / 2
    while excess(lo) <= 0 and lo > 1e-12:
        lo /= 2
    return float(optimize.brentq(excess, lo, hi, xtol=1e-12 * hi, rtol=1e-15))


def _discrete_laplace_tail(scale: float, m: int) -> float:
    """P(X >= m) for m >= 1 under the discrete Laplace with parameter ``scale``."""
    q = math.exp(-1.0 / scale)
    return q**m / (1 + q)


@dataclass(frozen=True)
class Laplace:
    """Discrete Laplace noise with scale Δ1/ε: pure ε-DP."""

    l1: float
    epsilon: float

    name = "laplace"

    @property
    def scale(self) -> float:
        return self.l1 / self.epsilon

    @property
    def cost(self) -> Cost:
        return Cost(epsilon=self.epsilon)

    def sample(self, source: NoiseSource, size: int) -> np.ndarray:
        if self.l1 == 0:
            return np.zeros(size, dtype=np.int64)
        return source.discrete_laplace(self.scale, size)

    def interval_halfwidth(self, confidence: float = 0.95) -> float:
        """Smallest integer h with P(|X| <= h) >= confidence."""
        if self.l1 == 0:
            return 0.0
        q = math.exp(-1.0 / self.scale)
        # P(|X| > h) = 2 q^(h+1) / (1 + q)
        h = math.log((1 - confidence) * (1 + q) / 2) / math.log(q) - 1
        return float(max(0, math.ceil(h)))

    def threshold(self, delta: float, max_groups: int) -> float:
        """τ so that a key held by one unit (count 1) is released with probability <= δ.

        The unit can create at most ``max_groups`` keys, so each gets δ / max_groups.
        """
        target = delta / max_groups
        q = math.exp(-1.0 / self.scale)
        # P(1 + X >= τ) = q^(τ-1) / (1 + q) <= target
        m = math.log(target * (1 + q)) / math.log(q)
        return 1.0 + math.ceil(m)


@dataclass(frozen=True)
class Gaussian:
    """Discrete Gaussian noise, σ from the analytic Gaussian mechanism; charged as ρ-zCDP."""

    l2: float
    epsilon: float
    delta: float

    name = "gaussian"

    @property
    def scale(self) -> float:
        return analytic_gaussian_sigma(self.l2, self.epsilon, self.delta)

    @property
    def rho(self) -> float:
        """zCDP of the (discrete) Gaussian: Δ2² / (2σ²) (Canonne, Kamath, Steinke 2020)."""
        if self.l2 == 0:
            return 0.0
        return self.l2**2 / (2 * self.scale**2)

    @property
    def cost(self) -> Cost:
        return Cost(rho=self.rho)

    def sample(self, source: NoiseSource, size: int) -> np.ndarray:
        if self.l2 == 0:
            return np.zeros(size, dtype=np.int64)
        return source.discrete_gaussian(self.scale, size)

    def interval_halfwidth(self, confidence: float = 0.95) -> float:
        if self.l2 == 0:
            return 0.0
        return float(math.ceil(self.scale * stats.norm.ppf(0.5 + confidence / 2)))

    def threshold(self, delta: float, max_groups: int) -> float:
        """τ so that a key held by one unit is released with probability <= δ / max_groups."""
        target = delta / max_groups
        return 1.0 + math.ceil(self.scale * stats.norm.isf(target))


Mechanism = Laplace | Gaussian
