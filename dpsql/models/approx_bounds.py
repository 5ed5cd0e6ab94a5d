"""``bounds="auto"`` for the in-process estimators: DP feature bounds from a noisy histogram.

The estimators clip every feature to [lower, upper] and the sensitivity follows from that
range, so the range must be public. When the caller has no public range, ``bounds="auto"``
buys one with a stated share of the fit's ε (:data:`SHARE`, 10%), as ``clip = "auto"`` does
for SUM in SQL (dpsql/privacy/clipping.py), but with no declared outer range to search in:

- bins (public, the same for every dataset): per feature, the signed log-scale bins
  ±[2^k, 2^(k+1)) for k = :data:`LOW_EXP` … :data:`HIGH_EXP` − 1 and one zero bin
  (−2^LOW_EXP, 2^LOW_EXP); a value beyond ±2^HIGH_EXP falls into the outermost bin, NaN into
  none;
- noise: every bin of every feature gets discrete Laplace noise of scale R·d/ε_b (a unit
  changes at most R rows, each of which sits in one bin of each of the d features: L1 ≤ R·d),
  so the whole histogram is ε_b-DP (pure);
- choice (post-processing): per feature, from the lower edge of the lowest bin to the upper
  edge of the highest bin whose noisy count reaches τ = b·ln(#bins / :data:`FALSE_BIN`) (an
  empty bin passes with probability below FALSE_BIN / #bins); when none does, the bin with
  the largest noisy count. Never an error: the choice runs after the charge.

Bins are powers of two, so a chosen bound may be up to twice the data's extreme: the fit
clips less than it could but never silently. The bounds are released with the model
(``bounds_``).
"""

from __future__ import annotations

import math

import numpy as np

from dpsql.privacy.samplers import NoiseSource

SHARE = 0.1  # of the fit's ε, spent on the bounds
LOW_EXP = -16  # the zero bin is (−2^-16, 2^-16)
HIGH_EXP = 48  # the outermost bins end at ±2^48
FALSE_BIN = 1e-3  # chance that some empty bin passes the threshold

_EXPS = np.arange(LOW_EXP, HIGH_EXP)  # k of the bins [2^k, 2^(k+1))
N_SIDE = len(_EXPS)
N_BINS = 2 * N_SIDE + 1  # negative (outermost first), zero, positive


def _edges() -> tuple[np.ndarray, np.ndarray]:
    """(lower, upper) edge of every bin, in bin order."""
    pos_lo, pos_hi = 2.0**_EXPS, 2.0 ** (_EXPS + 1)
    tiny = 2.0**LOW_EXP
    lower = np.concatenate([-pos_hi[::-1], [-tiny], pos_lo])
    upper = np.concatenate([-pos_lo[::-1], [tiny], pos_hi])
    return lower, upper


LOWER_EDGES, UPPER_EDGES = _edges()


def bin_index(x: np.ndarray) -> np.ndarray:
    """The bin of each finite value (NaN: −1)."""
    x = np.asarray(x, dtype=np.float64)
    magnitude = np.abs(x)
    with np.errstate(divide="ignore", invalid="ignore"):
        k = np.floor(np.log2(np.where(magnitude > 0, magnitude, 1.0)))
    k = np.clip(k, LOW_EXP, HIGH_EXP - 1).astype(np.int64) - LOW_EXP  # 0 … N_SIDE − 1
    out = np.where(x > 0, N_SIDE + 1 + k, N_SIDE - 1 - k)
    out = np.where(magnitude < 2.0**LOW_EXP, N_SIDE, out)
    return np.where(np.isnan(x), -1, out)


def scale(rows_per_unit: int, features: int, epsilon: float) -> float:
    """Discrete Laplace scale of every bin: R·d / ε_b."""
    return rows_per_unit * features / epsilon


def choose(noisy: np.ndarray, b: float) -> tuple[float, float]:
    """(lower, upper) from one feature's noisy bin counts (post-processing only)."""
    tau = b * math.log(N_BINS / FALSE_BIN)
    passed = np.flatnonzero(noisy >= tau)
    if len(passed) == 0:
        passed = np.array([int(np.argmax(noisy))])
    return float(LOWER_EDGES[passed[0]]), float(UPPER_EDGES[passed[-1]])


def approximate_bounds(
    X: np.ndarray, rows: np.ndarray, rows_per_unit: int, epsilon: float, source: NoiseSource
) -> tuple[np.ndarray, np.ndarray]:
    """ε-DP (lower, upper) per column of ``X`` over the rows each unit keeps (``rows``:
    :func:`dpsql.models.dpsgd.unit_rows`' matrix). Call only after charging ``epsilon``."""
    kept = X[rows[rows >= 0]]
    d = X.shape[1]
    b = scale(rows_per_unit, d, epsilon)
    lower, upper = np.empty(d), np.empty(d)
    for j in range(d):
        idx = bin_index(kept[:, j])
        counts = np.bincount(idx[idx >= 0], minlength=N_BINS)
        noisy = counts + source.discrete_laplace(b, N_BINS)
        lower[j], upper[j] = choose(noisy, b)
    return lower, upper


__all__ = ["SHARE", "approximate_bounds", "bin_index", "choose", "scale"]
