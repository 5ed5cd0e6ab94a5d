"""Smooth-sensitivity noise (Nissim, Raskhodnikova & Smith, STOC 2007, full version §2).

Framework (NRS: admissible noise distributions, and the lemma that turns them into a
mechanism). A noise density h is (α, β)-admissible when, for every |Δ| <= α and |λ| <= β and
every set S,

- sliding:   P[Z ∈ S] <= e^(ε/2) P[Z ∈ S + Δ] + δ/2,
- dilation:  P[Z ∈ S] <= e^(ε/2) P[e^λ Z ∈ S] + δ/2.

If S(x) is a β-smooth upper bound on the local sensitivity of f (S(x) >= LS_f(x) and
S(x) <= e^β S(x') for neighbours), then f(x) + (S(x)/α)·Z is (ε, δ)-DP: neighbours shift the
centre by at most LS_f(x) <= S(x), i.e. α noise units, and change the scale by a factor e^λ,
|λ| <= β.

- Cauchy-type, h(z) ∝ 1/(1 + |z|^γ), γ > 1 (NRS §2, Cauchy-type densities):
  α = β = ε/(2(γ+1)), δ = 0. Sliding: |d/dz ln(1+|z|^γ)| <= γ+1 (at most 1 for γ = 2), so a
  shift by α costs <= e^(ε/2). Dilation: ln h(z) − ln h(e^(-λ) z) + λ <= (γ+1)|λ| (at most
  |λ| for γ = 2), so |λ| <= β costs <= e^(ε/2). For γ = 2 (the standard Cauchy):
  β = ε/6 and noise 6S/ε · Z. Both bounds are loose for γ = 2 by a factor 3; we keep the
  published constants, which are what DP-GreedyRL (Ly et al. 2024) is analysed with.
- Laplace, h(z) = e^(-|z|)/2 (NRS Lemmas 2.6 and 2.9, as cited in google-research
  dp_multiq/smooth.py): α = ε/2, β = ε/(2 ln(2/δ)); noise 2S/ε · Z.
  Sliding costs exactly e^(|Δ|) <= e^(ε/2); dilation needs the δ/2 slack for the tail.

The draws are continuous floats: these mechanisms serve data-dependent *selection* (the
rule-list learner's noisy Gini scores), never a released aggregate; see docs/noise.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from dpsql.privacy.samplers import NoiseSource

CAUCHY_GAMMA = 2


def _scaled(
    draw, smooth_sensitivity: np.ndarray | float, alpha: float, size: int | None
) -> np.ndarray:
    """(S/α) · Z, with Z drawn once per output element; S broadcasts against ``size``."""
    s = np.asarray(smooth_sensitivity, dtype=np.float64)
    if np.any(s < 0) or not np.all(np.isfinite(s)):
        raise ValueError("smooth sensitivity must be finite and >= 0")
    shape = s.shape if size is None else np.broadcast_shapes(s.shape, (size,))
    n = math.prod(shape)
    z = np.asarray(draw(n), dtype=np.float64).reshape(shape)
    return (s / alpha) * z


@dataclass(frozen=True)
class SmoothCauchy:
    """Standard Cauchy noise (γ = 2) scaled by 6S/ε: (ε, 0)-DP for a β-smooth S, β = ε/6."""

    epsilon: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.epsilon) and self.epsilon > 0):
            raise ValueError("epsilon must be a finite number > 0")

    @property
    def alpha(self) -> float:
        """ε/(2(γ+1)) = ε/6: the shift (in noise units) the density absorbs for e^(ε/2)."""
        return self.epsilon / (2 * (CAUCHY_GAMMA + 1))

    @property
    def beta(self) -> float:
        """ε/(2(γ+1)) = ε/6: the smoothness the sensitivity bound S must have."""
        return self.epsilon / (2 * (CAUCHY_GAMMA + 1))

    @property
    def delta(self) -> float:
        return 0.0

    def scale(self, smooth_sensitivity: float) -> float:
        """6 S / ε."""
        return smooth_sensitivity / self.alpha

    def noise(
        self, source: NoiseSource, smooth_sensitivity: np.ndarray | float, size: int | None = None
    ) -> np.ndarray:
        """6S/ε · Cauchy draws, shaped like ``smooth_sensitivity`` (or ``size``, broadcast)."""
        return _scaled(source.cauchy, smooth_sensitivity, self.alpha, size)


@dataclass(frozen=True)
class SmoothLaplace:
    """Laplace(1) noise scaled by 2S/ε: (ε, δ)-DP for a β-smooth S, β = ε/(2 ln(2/δ))."""

    epsilon: float
    delta: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.epsilon) and self.epsilon > 0):
            raise ValueError("epsilon must be a finite number > 0")
        if not 0 < self.delta < 1:
            raise ValueError("delta must be in (0, 1)")

    @property
    def alpha(self) -> float:
        """ε/2."""
        return self.epsilon / 2

    @property
    def beta(self) -> float:
        """ε / (2 ln(2/δ))."""
        return self.epsilon / (2 * math.log(2 / self.delta))

    def scale(self, smooth_sensitivity: float) -> float:
        """2 S / ε."""
        return smooth_sensitivity / self.alpha

    def noise(
        self, source: NoiseSource, smooth_sensitivity: np.ndarray | float, size: int | None = None
    ) -> np.ndarray:
        """2S/ε · Laplace(1) draws, shaped like ``smooth_sensitivity`` (or ``size``, broadcast)."""
        return _scaled(lambda n: source.laplace(1.0, n), smooth_sensitivity, self.alpha, size)
