"""Noise sources: where the random integers added to exact aggregates come from.

Every release draws through a :class:`NoiseSource`; the pipeline never touches a random
generator directly, so the exact CSPRNG samplers, a seeded source for statistical tests and
the "no noise" test hook are interchangeable.

Scales are in *noise units*: aggregates are integers (counts, or sums in fixed point at the
plan's granularity), so every sampler returns int64 arrays.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np


class NoiseSource(Protocol):
    """Draws integer noise. ``scale``/``sigma`` are floats > 0; ``size`` >= 0."""

    def discrete_laplace(self, scale: float, size: int) -> np.ndarray:
        """i.i.d. draws with P(k) ∝ exp(-|k| / scale), k ∈ ℤ."""
        ...

    def discrete_gaussian(self, sigma: float, size: int) -> np.ndarray:
        """i.i.d. draws with P(k) ∝ exp(-k² / (2 σ²)), k ∈ ℤ."""
        ...

    # Continuous draws, for data-dependent selection (smooth sensitivity, noisy max),
    # never added to a released float aggregate.
    def uniform(self, size: int) -> np.ndarray:
        """float64 in [0, 1)."""
        ...

    def laplace(self, scale: float, size: int) -> np.ndarray: ...

    def gaussian(self, sigma: float, size: int) -> np.ndarray: ...

    def cauchy(self, size: int) -> np.ndarray:
        """Standard Cauchy (density ∝ 1/(1+z²)): the γ = 2 smooth-sensitivity noise."""
        ...

    def gumbel(self, scale: float, size: int) -> np.ndarray: ...


class ZeroNoise:
    """Test hook: releases the exact bounded aggregates. Never reachable from a policy."""

    def discrete_laplace(self, scale: float, size: int) -> np.ndarray:
        return np.zeros(size, dtype=np.int64)

    def discrete_gaussian(self, sigma: float, size: int) -> np.ndarray:
        return np.zeros(size, dtype=np.int64)


class _GeneratorNoise:
    """Geometric-difference / rounded-Gaussian sampling from a numpy Generator.

    Interim implementation behind the interface; the exact samplers replace it.
    """

    def __init__(self, rng: np.random.Generator) -> None:
        self._rng = rng

    def discrete_laplace(self, scale: float, size: int) -> np.ndarray:
        p = 1.0 - np.exp(-1.0 / scale)
        g1 = self._rng.geometric(p, size) - 1
        g2 = self._rng.geometric(p, size) - 1
        return (g1 - g2).astype(np.int64)

    def discrete_gaussian(self, sigma: float, size: int) -> np.ndarray:
        return np.rint(self._rng.normal(0.0, sigma, size)).astype(np.int64)

    def uniform(self, size: int) -> np.ndarray:
        return self._rng.random(size)

    def laplace(self, scale: float, size: int) -> np.ndarray:
        return self._rng.laplace(0.0, scale, size)

    def gaussian(self, sigma: float, size: int) -> np.ndarray:
        return self._rng.normal(0.0, sigma, size)

    def cauchy(self, size: int) -> np.ndarray:
        return self._rng.standard_cauchy(size)

    def gumbel(self, scale: float, size: int) -> np.ndarray:
        return self._rng.gumbel(0.0, scale, size)


class SeededNoise(_GeneratorNoise):
    """Deterministic noise for statistical tests with fixed seeds. Not for releases."""

    def __init__(self, seed: int) -> None:
        super().__init__(np.random.default_rng(seed))


class SecureNoise(_GeneratorNoise):
    """Noise for real releases."""

    def __init__(self) -> None:
        super().__init__(np.random.default_rng())


def default_source() -> NoiseSource:
    return SecureNoise()
