"""Linear regression from noisy sufficient statistics (XᵀX, Xᵀy, yᵀy), one release.

Rows are the scaled design z = (1, x₁ … x_d) ∈ [−1, 1]^D (D = d + 1, the 1 is the intercept)
and the scaled label y ∈ [−1, 1], both on the lattice 2⁻ᵇ (b = :data:`FEATURE_BITS`, the SQL
path rounds there in the engine). The released vector is the upper triangle of ZᵀZ, Zᵀy and
yᵀy; every entry is a sum of per-row products on the lattice 2⁻²ᵇ, computed exactly in float64
and released as an integer multiple of 2⁻²ᵇ plus *discrete* noise (no floating-point noise on a
released aggregate, as everywhere in dpsql).

Sensitivity of one row (|z_i z_j| ≤ 1, |z_i y| ≤ 1, y² ≤ 1):
L2² ≤ D(D+1)/2 + D + 1 and L1 ≤ D(D+1)/2 + D + 1; a unit owning ≤ R rows changes the vector by
at most R times that (triangle inequality).

- ``noise="gaussian"``: discrete Gaussian, σ the smallest with the RDP curve α·Δ₂²/2σ² (exact
  for the multivariate discrete Gaussian on integer shifts, Canonne-Kamath-Steinke 2020)
  converting to (ε, δ) by the improved conversion; cost (ε, δ).
- ``noise="laplace"``: discrete Laplace at scale Δ₁/ε; cost (ε, 0).

Coefficients come from a ridge solve, (ZᵀZ~ + λI) w = Zᵀy~ with the noisy matrix's negative
eigenvalues floored (post-processing). Intervals: a parametric bootstrap over the public noise
distribution plus the sampling covariance σ̂²(ZᵀZ~ + λI)⁻¹ estimated from the released values.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from dpsql.privacy.accounting import Cost
from dpsql.privacy.rdp import DEFAULT_ORDERS, epsilon_floor, rdp_to_epsilon
from dpsql.privacy.samplers import NoiseSource

FEATURE_BITS = 10  # features and label on the lattice 2^-10 of [-1, 1]
LATTICE = 2.0 ** (-2 * FEATURE_BITS)  # products of two lattice values
NOISES = ("gaussian", "laplace")


@lru_cache(maxsize=256)
def gaussian_sigma_rdp(l2: float, epsilon: float, delta: float) -> float:
    """Smallest σ (relative 1e-9) whose Gaussian RDP curve α·l2²/2σ² meets (ε, δ)."""

    def ok(sigma: float) -> bool:
        a = np.asarray(DEFAULT_ORDERS)
        return (
            rdp_to_epsilon(DEFAULT_ORDERS, a * l2 * l2 / (2 * sigma * sigma), delta)[0] <= epsilon
        )

    if not (epsilon > 0 and 0 < delta < 1) or epsilon <= epsilon_floor(delta):
        raise ValueError("epsilon is too small for this delta: no noise scale reaches it")
    hi = l2
    while not ok(hi):  # terminates: ε > the floor, and ε(σ) -> the floor as σ grows
        hi *= 2
    lo = hi / 2
    while ok(lo):
        hi, lo = lo, lo / 2
    while hi - lo > 1e-9 * hi:
        mid = 0.5 * (lo + hi)
        hi, lo = (mid, lo) if ok(mid) else (hi, mid)
    return hi


@dataclass(frozen=True)
class StatsPlan:
    """The calibrated release: dimension, sensitivities, noise scale (real units), cost."""

    epsilon: float
    delta: float
    noise: str
    dimension: int  # D = features + 1
    rows_per_unit: int
    l1: float
    l2: float
    scale: float  # σ (gaussian) or b (laplace), in the statistics' own units
    cost: Cost

    @property
    def size(self) -> int:
        D = self.dimension
        return D * (D + 1) // 2 + D + 1

    @property
    def entry_std(self) -> float:
        return self.scale if self.noise == "gaussian" else math.sqrt(2) * self.scale


def plan_sufficient_stats(
    epsilon: float, delta: float, features: int, rows_per_unit: int = 1, noise: str = "gaussian"
) -> StatsPlan:
    """Sensitivities and noise scale for ``features`` columns, reading no data."""
    if noise not in NOISES:
        raise ValueError(f"noise must be one of {NOISES}")
    if not (epsilon > 0 and math.isfinite(epsilon)):
        raise ValueError("epsilon must be > 0")
    D = features + 1
    per_row = D * (D + 1) / 2 + D + 1
    l1 = rows_per_unit * per_row
    l2 = rows_per_unit * math.sqrt(per_row)
    if noise == "gaussian":
        if not 0 < delta < 1:
            raise ValueError("delta must be in (0, 1)")
        return StatsPlan(
            epsilon, delta, noise, D, rows_per_unit, l1, l2,
            gaussian_sigma_rdp(l2, epsilon, delta), Cost(epsilon, delta),
        )  # fmt: skip
    return StatsPlan(epsilon, 0.0, noise, D, rows_per_unit, l1, l2, l1 / epsilon, Cost(epsilon))


#: Largest noise scale, in lattice units, the exact samplers draw precisely (samplers.py).
MAX_LATTICE_SCALE = 2.0**50


def check_drawable(plan: StatsPlan) -> None:
    """ValueError when the noise is beyond the exact samplers (before anything is charged)."""
    if plan.scale / LATTICE >= MAX_LATTICE_SCALE:
        raise ValueError("epsilon is too small: the noise scale is beyond the exact sampler")


def exact_statistics(Z: np.ndarray, y: np.ndarray) -> np.ndarray:
    """(triu(ZᵀZ), Zᵀy, yᵀy) as one vector, exact for lattice inputs."""
    D = Z.shape[1]
    iu = np.triu_indices(D)
    return np.concatenate([(Z.T @ Z)[iu], Z.T @ y, [y @ y]])


def noisy_statistics(
    plan: StatsPlan, Z: np.ndarray, y: np.ndarray, source: NoiseSource
) -> np.ndarray:
    """The released vector: exact lattice statistics plus discrete noise. Call after charging."""
    units = np.rint(exact_statistics(Z, y) / LATTICE).astype(np.int64)
    if plan.noise == "gaussian":
        noise = source.discrete_gaussian(plan.scale / LATTICE, plan.size)
    else:
        noise = source.discrete_laplace(plan.scale / LATTICE, plan.size)
    return (units + noise).astype(np.float64) * LATTICE


def unpack(plan: StatsPlan, released: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """(ZᵀZ symmetric, Zᵀy, yᵀy) from the released vector."""
    D = plan.dimension
    iu = np.triu_indices(D)
    k = len(iu[0])
    m = np.zeros((D, D))
    m[iu] = released[:k]
    m = m + np.triu(m, 1).T
    return m, released[k : k + D], float(released[k + D])


def default_ridge(plan: StatsPlan) -> float:
    """λ ≈ the spectral norm of the noise matrix (≈ 2σ√D): data-independent."""
    return 2.0 * plan.entry_std * math.sqrt(plan.dimension)


def ridge_solve(xtx: np.ndarray, xty: np.ndarray, ridge: float) -> np.ndarray:
    """w = (PSD(ZᵀZ~) + λJ)⁻¹ Zᵀy~: the noisy matrix's negative eigenvalues floored at 0, and
    λ on the features only (J = I without the intercept), so shrinkage never pulls the
    intercept towards the middle of the label's range."""
    vals, vecs = np.linalg.eigh(xtx)
    psd = (vecs * np.maximum(vals, 0.0)) @ vecs.T
    penalty = np.full(len(xty), ridge)
    penalty[0] = 0.0
    return np.linalg.solve(psd + np.diag(penalty) + 1e-9 * np.eye(len(xty)), xty)


def _sampling_draw(a: np.ndarray, ridge: float, scale2: float, z: np.ndarray) -> np.ndarray:
    """One draw from N(0, s²(PSD(a) + λJ)⁻¹), by its Cholesky factor."""
    vals, vecs = np.linalg.eigh(a)
    m = (vecs * np.maximum(vals, 0.0)) @ vecs.T + np.diag(np.r_[0.0, np.full(len(a) - 1, ridge)])
    m += 1e-9 * np.eye(len(a)) + np.diag(np.r_[1.0, np.zeros(len(a) - 1)]) * (m[0, 0] <= 0)
    chol = np.linalg.cholesky(m)
    return np.sqrt(scale2) * np.linalg.solve(chol.T, z)


def bootstrap_draws(
    plan: StatsPlan,
    released: np.ndarray,
    ridge: float,
    source: NoiseSource,
    draws: int = 300,
    check: Callable[[], None] | None = None,
) -> np.ndarray:
    """(draws × D) simulated coefficient vectors: post-processing of the release only.

    Each draw adds fresh noise from the public noise distribution to the released statistics,
    re-solves, and adds a draw from the sampling covariance σ̂²(ZᵀZ~ + λI)⁻¹ (σ̂² the residual
    variance implied by the same noisy statistics), so percentile intervals cover both the
    privacy noise and the sampling error of a linear model. Approximate: a bootstrap, not a
    guarantee. ``check`` (the query's cancel check) runs before each draw.
    """
    D = plan.dimension
    sims = np.empty((draws, D))
    for b in range(draws):
        if check is not None:
            check()
        if plan.noise == "gaussian":
            e = source.gaussian(plan.scale, plan.size)
        else:
            e = source.laplace(plan.scale, plan.size)
        a, v, s = unpack(plan, released + e)
        wb = ridge_solve(a, v, ridge)
        n_b = max(a[0, 0], D + 2.0)
        rss = max(s - 2 * wb @ v + wb @ a @ wb, 0.0)
        sims[b] = wb + _sampling_draw(a, ridge, rss / (n_b - D), source.gaussian(1.0, D))
    return sims
