"""DP-SGD for generalised linear models (squared and logistic loss), numpy-vectorised.

Algorithm (Abadi et al. 2016, with Poisson sampling as the accountant assumes):

1. A noisy row count ñ (discrete Laplace, sensitivity R rows per unit, ``count_share`` of ε,
   pure) fixes the expected batch size q·ñ that normalises the gradient: n itself is private.
2. ``steps`` times: every privacy unit joins the batch independently with probability q (all of
   its ≤ R rows together); each row's gradient is clipped to L2 norm C; the clipped sum gets
   N(0, (z·R·C)²) noise per coordinate; w ← clip(w − lr·(noisy sum / max(q·ñ, 1) + l2·w))
   onto the box [−50, 50]^d (projected SGD).
3. The released weights are the average of the iterates over the second half (post-processing).

Sensitivity: adding or removing one unit changes the clipped sum by the sum of ≤ R vectors of
norm ≤ C, so by at most R·C in L2; the noise std is z times that, and one step is the
subsampled Gaussian with noise multiplier z (:mod:`dpsql.privacy.rdp`). z is the smallest value
whose ``steps``-fold RDP converts to the SGD share of ε at δ. Total: (ε, δ) by basic
composition of the count (ε_count, 0) and the steps (ε − ε_count, δ).

The per-example gradient of a GLM is r_i·x_i (r_i the residual), so its norm is |r_i|·‖x_i‖ and
clipping never materialises the (batch × d) gradient matrix.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from dpsql.privacy.accounting import Cost
from dpsql.privacy.rdp import calibrate_noise_multiplier, dpsgd_epsilon
from dpsql.privacy.samplers import NoiseSource

LOSSES = ("squared", "logistic")
#: Projected SGD: weights (on the [−1, 1] scale) stay in [−WEIGHT_BOX, WEIGHT_BOX]. A fixed,
#: data-independent box, so the projection is post-processing of each noisy step; it only
#: stops noise-driven blow-ups (a fitted weight of 50 on a [−1, 1] feature is already absurd).
WEIGHT_BOX = 50.0
#: Gradient sum over a batch: (loss, X batch, y batch, w, clip) -> vector.
GradientSum = Callable[[str, np.ndarray, np.ndarray, np.ndarray, float], np.ndarray]


@dataclass(frozen=True)
class DPSGDConfig:
    """Public parameters of one DP-SGD fit (everything the cost depends on)."""

    epsilon: float
    delta: float
    steps: int = 1000
    sample_rate: float = 0.01
    clip: float = 1.0
    learning_rate: float = 1.0
    l2: float = 1e-4
    rows_per_unit: int = 1
    count_share: float = 0.02

    def validate(self) -> None:
        checks = [
            (self.epsilon > 0 and math.isfinite(self.epsilon), "epsilon must be > 0"),
            (0 < self.delta < 1, "delta must be in (0, 1)"),
            (1 <= self.steps <= 100_000, "steps must be in [1, 100000]"),
            (0 < self.sample_rate <= 1, "sample_rate must be in (0, 1]"),
            (self.clip > 0 and math.isfinite(self.clip), "clip must be > 0"),
            (self.learning_rate > 0 and math.isfinite(self.learning_rate), "learning_rate > 0"),
            (self.l2 >= 0 and math.isfinite(self.l2), "l2 must be >= 0"),
            (self.rows_per_unit >= 1, "rows_per_unit must be >= 1"),
            (0 < self.count_share < 1, "count_share must be in (0, 1)"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


@dataclass(frozen=True)
class DPSGDPlan:
    """The calibrated mechanism: noise multiplier z, noise std z·R·C, the ε split, the cost."""

    config: DPSGDConfig
    noise_multiplier: float
    noise_std: float
    sgd_epsilon: float
    count_epsilon: float
    count_scale: float
    cost: Cost

    @property
    def accounted_epsilon(self) -> float:
        """ε the accountant gives the steps at the calibrated z (<= sgd_epsilon)."""
        c = self.config
        return dpsgd_epsilon(c.sample_rate, self.noise_multiplier, c.steps, c.delta)


def plan_dpsgd(config: DPSGDConfig) -> DPSGDPlan:
    """Calibrate z from (ε, δ, q, steps), reading no data. Raises ValueError on bad input."""
    config.validate()
    count_epsilon = config.epsilon * config.count_share
    sgd_epsilon = config.epsilon - count_epsilon
    z = calibrate_noise_multiplier(sgd_epsilon, config.delta, config.sample_rate, config.steps)
    std = z * config.rows_per_unit * config.clip
    scale = config.rows_per_unit / count_epsilon
    if scale >= 2.0**50:  # beyond the exact discrete Laplace sampler: refuse, free
        raise ValueError("epsilon is too small: the row count's noise is beyond the sampler")
    return DPSGDPlan(
        config, z, std, sgd_epsilon, count_epsilon, scale, Cost(config.epsilon, config.delta)
    )


# --- gradients -------------------------------------------------------------------------------


def _residual(loss: str, X: np.ndarray, y: np.ndarray, w: np.ndarray) -> np.ndarray:
    m = X @ w
    if loss == "squared":
        return m - y
    return 0.5 * (1.0 + np.tanh(0.5 * m)) - y  # sigmoid(m) - y, overflow-free


def clipped_gradient_sum(
    loss: str, X: np.ndarray, y: np.ndarray, w: np.ndarray, clip: float
) -> np.ndarray:
    """Σ_i clip_C(r_i·x_i): each row's gradient scaled to L2 norm <= C, then summed."""
    r = _residual(loss, X, y, w)
    norms = np.abs(r) * np.sqrt(np.einsum("ij,ij->i", X, X))
    factor = np.minimum(1.0, clip / np.maximum(norms, 1e-300))
    return X.T @ (r * factor)


def per_example_gradients(
    loss: str, X: np.ndarray, y: np.ndarray, w: np.ndarray, clip: float | None
) -> np.ndarray:
    """The (rows × d) clipped per-example gradients (for tests; training uses the sum)."""
    r = _residual(loss, X, y, w)
    g = r[:, None] * X
    if clip is None:
        return g
    norms = np.linalg.norm(g, axis=1)
    return g * np.minimum(1.0, clip / np.maximum(norms, 1e-300))[:, None]


# --- sampling --------------------------------------------------------------------------------


def unit_rows(units: np.ndarray | None, n_rows: int, rows_per_unit: int) -> np.ndarray:
    """(units × R) row indices, −1 padded; each unit keeps its first R rows as given.

    ``units`` (one id per row) or None (every row its own unit). The SQL path has already
    kept at most R rows per unit by keyed hash; the estimator bounds here.
    """
    if units is None:
        return np.arange(n_rows, dtype=np.int64)[:, None]
    _, inverse = np.unique(np.asarray(units), return_inverse=True)
    order = np.argsort(inverse, kind="stable")
    sorted_units = inverse[order]
    starts = np.searchsorted(sorted_units, np.arange(sorted_units.max(initial=-1) + 1))
    rank = np.arange(n_rows) - starts[sorted_units]
    keep = rank < rows_per_unit
    out = np.full((len(starts), rows_per_unit), -1, dtype=np.int64)
    out[sorted_units[keep], rank[keep]] = order[keep]
    return out


def poisson_sample(source: NoiseSource, n: int, q: float) -> np.ndarray:
    """Indices in [0, n) each kept independently with probability q (geometric gaps)."""
    if q >= 1:
        return np.arange(n)
    log1mq = math.log1p(-q)
    picked: list[np.ndarray] = []
    position = -1
    while True:
        k = int(q * max(n - position, 0) + 6 * math.sqrt(q * n + 1) + 16)
        u = 1.0 - source.uniform(k)  # (0, 1]
        gaps = np.floor(np.log(u) / log1mq).astype(np.int64) + 1
        pos = position + np.cumsum(gaps)
        picked.append(pos[pos < n])
        if pos[-1] >= n:
            return np.concatenate(picked)
        position = int(pos[-1])


# --- training --------------------------------------------------------------------------------


def train_dpsgd(
    plan: DPSGDPlan,
    loss: str,
    X: np.ndarray,
    y: np.ndarray,
    rows: np.ndarray,
    source: NoiseSource,
    *,
    gradient_sum: GradientSum = clipped_gradient_sum,
    check: Callable[[], None] | None = None,
) -> tuple[np.ndarray, float]:
    """Weights for the scaled design ``X`` (its first column the intercept's 1) and ñ.

    ``rows`` is :func:`unit_rows`' (units × R) index matrix. Call only after charging
    ``plan.cost``. ``gradient_sum`` exists so tests can plug in a broken (unclipped) variant.
    ``check`` (the query's cancel check) runs before each of the ``steps`` (<= 100000) steps.
    """
    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {LOSSES}")
    c = plan.config
    n_rows = int((rows >= 0).sum())
    noisy_n = float(n_rows + int(source.discrete_laplace(plan.count_scale, 1)[0]))
    batch = max(c.sample_rate * noisy_n, 1.0)  # at least one row: tiny ñ cannot blow up steps
    d = X.shape[1]
    w = np.zeros(d)
    average = np.zeros(d)
    tail_start = c.steps // 2
    for t in range(c.steps):
        if check is not None:
            check()
        chosen = rows[poisson_sample(source, rows.shape[0], c.sample_rate)].ravel()
        chosen = chosen[chosen >= 0]
        g = gradient_sum(loss, X[chosen], y[chosen], w, c.clip)
        g = g + source.gaussian(plan.noise_std, d)
        w = np.clip(w - c.learning_rate * (g / batch + c.l2 * w), -WEIGHT_BOX, WEIGHT_BOX)
        if t >= tail_start:
            average += w
    return average / (c.steps - tail_start), noisy_n
