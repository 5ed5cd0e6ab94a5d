"""Intervals that cover: AVG, VAR and STDDEV by inverting a pivot of their noisy measures.

A plug-in simulation (redraw the noise around the *released* measures and read the spread of
the recomputed formula) describes the noise well when the formula is nearly linear, and fails
for small groups: a variance near 0 is clamped there, every redraw clamps too, and the
interval collapses to [0, 0] while the exact value is far away (issue 31: VAR / STDDEV
intervals of small groups covered 73–91%, 5–13% of them zero-width).

Here each interval is a confidence set. For a ratio x* = a*/b* of two exact measures released
as a = a* + Z_a, b = b* + Z_b (independent, public noise distributions), the pivot
a − x*·b = Z_a − x*·Z_b has a known distribution whatever a* and b* are (Fieller 1954). So
{x : |a − x·b| <= q_level(x)}, with q_level(x) the level's quantile of |Z_a − x·Z_b|, holds x*
with probability >= level, for a group of 2 units as for one of 10,000. No linearisation, no
plug-in: the set is wide where the count is small and tight where it is large.

- AVG: x = the centred mean S/N (sum over count), at the stated level.
- VAR_POP = E[y²] − μ² with y the centred fixed-point value: μ's set at level 1 − α₁ and the
  second moment's set (sumsq over count, w = E[y²] − centre2) at 1 − α₂; by the union bound
  both hold with probability >= 1 − α₁ − α₂, and then the variance lies in
  [w_lo + c2 − max μ², w_hi + c2 − min μ²] ∩ [0, cap]. VAR_SAMP multiplies by N/(N − 1)
  over the count's own interval (α₃), STDDEV is the square root. α₁ + α₂ + α₃ = 1 − level.

Post-processing of released values and public noise distributions: it costs nothing. The
quantiles come from 20,000 draws of the public noise (their error in level ~0.0015), the set
from a grid of 129 candidates refined by bisection at its edges; released values that no data
could give (the < 1 − level case) get the column's whole range, never a zero-width interval.
"""

from __future__ import annotations

import numpy as np

from dpsql.privacy import coverage_kernel

# --- test inversion (Fieller): a ratio's confidence set from the pivot â − x·b̂ ---------------

PIVOT_GRID = 129  # points of x at which the pivot's quantile is simulated (then interpolated)
BISECTIONS = 16  # per edge: the edge to 2^-16 of a grid cell
_CHUNK = 4096  # groups per vectorised block (bounds the memory of groups × grid)


def pivot_quantiles(
    draws_a: np.ndarray, draws_b: np.ndarray, level: float, x_lo: float, x_hi: float
) -> tuple[np.ndarray, np.ndarray]:
    """(grid of x over [x_lo, x_hi], the level's quantile of |Z_a − x·Z_b| at each): the
    distribution of the pivot at a candidate x, from draws of the two (public) noises."""
    xs = np.linspace(x_lo, x_hi, PIVOT_GRID)
    qs = np.array([np.quantile(np.abs(draws_a - x * draws_b), level) for x in xs])
    return xs, qs


def ratio_set(
    a: np.ndarray, b: np.ndarray, xs: np.ndarray, qs: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Per group, the hull of {x : |a − x·b| <= q(x)} within [xs[0], xs[-1]] (``qs``: the
    quantiles at ``xs``, shared or one row per group): a confidence
    set for x* = a*/b* from a = a* + Z_a, b = b* + Z_b (independent noises), since
    a − x*·b = Z_a − x*·Z_b whatever a*, b* are (Fieller's pivot). It holds x* with the
    probability the quantiles ``qs`` were taken at, for every group size: no linearisation.

    The set is read at the grid points and at the point estimate a/b, then each edge is
    refined by bisection inside its grid cell (q interpolated linearly). Where no candidate
    passes (released values no data could give), the whole range."""
    if qs.ndim == 1 and coverage_kernel.ready() and _increasing(xs):
        # one quantile row (AVG): the same search compiled, equal to the bit (~0.5 ms a group
        # in numpy, a quarter of an ungrouped AVG query's CPU in the server)
        return coverage_kernel.ratio_sets(a, b, xs, qs, BISECTIONS)
    lo_out = np.empty(len(a))
    hi_out = np.empty(len(a))
    for start in range(0, len(a), _CHUNK):
        sl = slice(start, start + _CHUNK)
        rows = qs if qs.ndim == 1 else qs[sl]
        lo_out[sl], hi_out[sl] = _ratio_set_block(a[sl], b[sl], xs, rows)
    return lo_out, hi_out


def _increasing(xs: np.ndarray) -> bool:
    """A grid of at least two strictly increasing points (where the compiled np.interp is
    numpy's; a degenerate range, every candidate equal, stays with numpy)."""
    return len(xs) >= 2 and bool(np.all(xs[1:] > xs[:-1]))


def _q_at(x: np.ndarray, xs: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """q at x (groups × candidates), linear between grid points: one q-row for every group
    (``qs`` 1-D) or one row per group (2-D)."""
    if qs.ndim == 1:
        return np.interp(x, xs, qs)
    x = np.clip(x, xs[0], xs[-1])
    i = np.clip(np.searchsorted(xs, x), 1, len(xs) - 1)
    t = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
    rows = np.arange(len(qs))[:, None]
    return qs[rows, i - 1] * (1 - t) + qs[rows, i] * t


def _ratio_set_block(
    a: np.ndarray, b: np.ndarray, xs: np.ndarray, qs: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    x_lo, x_hi = xs[0], xs[-1]
    with np.errstate(divide="ignore", invalid="ignore"):
        point = np.where(b > 0, a / b, np.nan)
    point = np.clip(np.nan_to_num(point, nan=x_lo), x_lo, x_hi)

    def passes(x: np.ndarray) -> np.ndarray:
        return np.abs(a[:, None] - x * b[:, None]) <= _q_at(x, xs, qs)

    grid = np.broadcast_to(xs, (len(a), len(xs)))
    ok = passes(grid)
    point_ok = passes(point[:, None])[:, 0]
    any_grid = ok.any(axis=1)
    first = np.argmax(ok, axis=1)
    last = len(xs) - 1 - np.argmax(ok[:, ::-1], axis=1)
    # the outermost passing candidate on each side (grid point or the point estimate)
    left = np.where(any_grid, xs[first], np.inf)
    right = np.where(any_grid, xs[last], -np.inf)
    left = np.where(point_ok & (point < left), point, left)
    right = np.where(point_ok & (point > right), point, right)
    found = np.isfinite(left)
    left, right = np.where(found, left, x_lo), np.where(found, right, x_hi)
    step = xs[1] - xs[0]
    # bisect each edge between the passing candidate and the next grid point outwards
    lo_in, lo_out = left.copy(), np.maximum(left - step, x_lo)
    hi_in, hi_out = right.copy(), np.minimum(right + step, x_hi)
    for _ in range(BISECTIONS):
        mid = (lo_in + lo_out) / 2
        good = passes(mid[:, None])[:, 0]
        lo_in, lo_out = np.where(good, mid, lo_in), np.where(good, lo_out, mid)
        mid = (hi_in + hi_out) / 2
        good = passes(mid[:, None])[:, 0]
        hi_in, hi_out = np.where(good, mid, hi_in), np.where(good, hi_out, mid)
    # the last bisection's outer end: the edge never falls inside the set
    low = np.where(found, lo_out, x_lo)
    high = np.where(found, hi_out, x_hi)
    return low, high


def sample_factor(
    low: np.ndarray, high: np.ndarray, n: np.ndarray, h_n: float, cap: float
) -> tuple[np.ndarray, np.ndarray, float]:
    """A population variance's [low, high] times N/(N − 1) (1 at N <= 1, as the release does)
    over the count's interval n ± h_n, and the cap times the factor's largest value, 2."""

    def factor(m: np.ndarray) -> np.ndarray:
        return np.where(m > 1, m / np.maximum(m - 1, 1e-300), 1.0)

    n_lo = np.maximum(n - h_n, 1.0)
    n_hi = np.maximum(n + h_n, 1.0)
    # a count is an integer: N > 1 means N >= 2 (a rescaled pair's fractional count, which
    # needs NULLs in a pair over R or group scaling, is the one case this bound assumes away)
    f_max = factor(np.maximum(n_lo, 2.0))
    f_min = np.where(n_lo > 1, factor(n_hi), 1.0)
    return low * f_min, high * f_max, cap * 2.0


# --- the variance: the second moment about a candidate mean ----------------------------------

MEAN_GRID = 17  # candidate means at which the variance pivot's quantiles are simulated


def variance_pivot_quantiles(
    z_s: np.ndarray,
    z_n: np.ndarray,
    z_q: np.ndarray,
    center2: float,
    level: float,
    y_lo: float,
    y_hi: float,
    cap: float,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(mean grid, variance grid, quantiles[mean, variance]) of |P(μ, v)| with
    P(μ, v) = Z_q − 2μ·Z_s + (μ² + c2 − v)·Z_n: the noise of Σ(y − μ)² − v·N computed from
    the released sum, count and sumsq (q = Σ(y² − c2))."""
    mus = np.linspace(y_lo, y_hi, MEAN_GRID)
    vs = np.linspace(0.0, cap, PIVOT_GRID)
    k = min(int(level * (len(z_s) - 1)) + 1, len(z_s) - 1)
    out = np.empty((len(mus), len(vs)))
    for j, mu in enumerate(mus):
        base = z_q - 2 * mu * z_s + (mu * mu + center2) * z_n
        pivot = np.abs(base[None, :] - vs[:, None] * z_n[None, :])
        out[j] = np.partition(pivot, k, axis=1)[:, k]
    return mus, vs, out


def variance_set(
    s: np.ndarray,
    n: np.ndarray,
    q: np.ndarray,
    mean_lo: np.ndarray,
    mean_hi: np.ndarray,
    center2: float,
    grid: tuple[np.ndarray, np.ndarray, np.ndarray],
) -> tuple[np.ndarray, np.ndarray]:
    """Per group, the hull over candidate means μ in the mean's set [mean_lo, mean_hi] of
    {v : |A(μ) − v·n| <= q(μ, v)}, A(μ) = q + c2·n − 2μ·s + μ²·n (Σ(y − μ)² from released
    values). At the true mean μ*, Σ(y − μ*)² = v*·N* and A(μ*) − v*·n = P(μ*, v*): a pivot, so
    v* is in the set at μ* with the level's probability. Over μ ∈ [mean_lo, mean_hi], A/n is
    a convex quadratic (least at s/n), so the sets' hull is reached at s/n (clamped into the
    range) and at the range's ends: those three are read. Away from μ*
    a set only moves up by (μ − μ*)², second order: the mean's uncertainty costs little."""
    mus, vs, qs = grid
    with np.errstate(divide="ignore", invalid="ignore"):
        centre = np.where(n > 0, s / n, (mean_lo + mean_hi) / 2)
    centre = np.clip(centre, mean_lo, mean_hi)
    candidates = [centre, mean_lo, mean_hi]
    low = np.full(len(s), np.inf)
    high = np.full(len(s), -np.inf)
    for mu in candidates:
        a = q + center2 * n - 2 * mu * s + mu * mu * n
        # the quantile rows at each group's μ: linear between the grid's means
        j = np.clip(np.searchsorted(mus, mu), 1, len(mus) - 1)
        t = np.clip((mu - mus[j - 1]) / (mus[j] - mus[j - 1]), 0.0, 1.0)
        rows = qs[j - 1] * (1 - t)[:, None] + qs[j] * t[:, None]
        lo, hi = ratio_set(a, n, vs, rows)
        low, high = np.minimum(low, lo), np.maximum(high, hi)
    return low, high
