"""Automatic clipping bounds: a DP estimate of a tight range inside the declared bounds.

SUM and AVG pay noise in proportion to the clipping range, so a column declared in
[0, 500000] whose values are mostly far smaller pays for bounds it does not need. Here a
stated share ε_b of the query's ε buys a noisy histogram of |x| over public log-scale bins
(the engine computes the per-bin counts after bounding each unit to R values), and the range
is chosen from it by post-processing (ApproxBounds-style, as in Google's DP libraries):

- bins: [0, s), [s, 2s), [2s, 4s), ..., [2^(k−1) s, 2^k s = M] with M = max(|L|, |U|) and s
  the smallest public resolution (:class:`LogHistogram`);
- noise: discrete Laplace of scale R/ε_b on every bin (each value is in one bin: a unit moves
  the vector by at most R in L1), so the histogram is ε_b-DP;
- choice (``method``):
  ``"threshold"``: the top edge of the highest bin whose noisy count reaches τ, where τ makes
  an empty bin pass with probability <= ``false_bin``/#bins (ApproxBounds);
  ``"quantile"``: the top edge of the bin where the noisy cumulative share reaches ``q``;
  ``"sum"``: the edge C minimising the estimated error of a SUM released with ε_s:
  bias(C) + E|noise| = Σ_b n̂_b (r_b − C)₊ + R C / ε_s, from the noisy counts n̂ (r_b the
  bin's midpoint);
  ``"mse"``: the edge C minimising the estimated mean squared error of that SUM instead,
  bias(C)² + Var(noise) = (Σ_b n̂_b (r_b − C)₊)² + 2 (R C / ε_s)² (Laplace): the default
  clamp range kept per data version chose a total's bound so until "posterior" (measured
  against "sum" in docs/mechanisms.md: a squared bias weighs the heavy tail a noisy
  histogram under-shows more than its absolute value does).
  ``"posterior"``: "mse" with the counts' uncertainty and finer candidates (the default
  clamp of a single total from the kept histogram, dpsql.service.bounds; issue 31): each
  bin's true count is estimated by its posterior mean m_b and variance v_b given its noisy
  count (the release's own discrete Laplace likelihood, scale R/ε_b) under a geometric prior
  whose mean is the noisy mass of the bin and its two neighbours (:func:`posterior_counts`),
  and C minimises
  the expected squared bias plus noise variance, (Σ m_b e_b(C))² + Σ v_b e_b(C)² +
  2 (R C/ε_s)², over :data:`POSTERIOR_STEPS` candidates per bin (a bin's values spread
  log-uniformly inside it; the top bin's at the declared bound, where the engine's clamp
  piles any value beyond it: e_b(C) the mean excess over C). A tail bin of 13 values under
  noise of scale 10 is neither taken at its raw count nor dropped: its posterior keeps the
  chance that it holds more, and a too-low clamp (which costs far more than a too-high one)
  is chosen only on evidence. Measured against "mse" in docs/mechanisms.md.
  Every choice is post-processing of the noisy histogram: it costs nothing beyond ε_b.

The range returned is [max(L, −C), min(U, C)] (for a non-negative column, [L, min(U, C)]).
:func:`bias_report` estimates, from the same noisy histogram, the bias clamping introduces
(a release of SUM/AVG must say it is biased towards zero by about that much).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from dpsql.privacy.accounting import Cost
from dpsql.privacy.mechanisms import Laplace
from dpsql.privacy.samplers import NoiseSource

METHODS = ("threshold", "quantile", "sum", "mse", "posterior")
#: "posterior": candidate bounds per bin (log-spaced inside it, its top edge the last)
POSTERIOR_STEPS = 4
#: "posterior": the prior mean's floor (a bin whose neighbourhood shows no mass)
PRIOR_FLOOR = 0.5


@dataclass(frozen=True)
class LogHistogram:
    """Public log-scale bins of |x| up to ``maximum`` M = max(|L|, |U|): [0, s), then
    [s·r^(i−1), s·r^i) for i = 1..k with s·r^k = M (r = ``ratio``, 2 for ApproxBounds; a finer
    ratio gives the "sum" method finer candidate bounds)."""

    maximum: float
    smallest: float
    ratio: float = 2.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.maximum) and self.maximum > 0):
            raise ValueError("a clipping histogram needs a finite declared bound > 0")
        if not (0 < self.smallest <= self.maximum):
            raise ValueError("the smallest bin edge must be in (0, maximum]")
        if not (math.isfinite(self.ratio) and self.ratio > 1):
            raise ValueError("the bin ratio must be > 1")

    @classmethod
    def for_bounds(
        cls, lower: float, upper: float, *, resolution: float = 1.0, ratio: float = 2.0
    ) -> LogHistogram:
        """Bins for a column declared in [lower, upper]: edges M/r^k down to ``resolution``."""
        maximum = max(abs(lower), abs(upper))
        if maximum <= resolution:
            return cls(float(maximum), float(maximum), ratio)
        k = max(0, math.floor(math.log(maximum / resolution) / math.log(ratio)))
        return cls(float(maximum), float(maximum / ratio**k), ratio)

    @property
    def steps(self) -> int:
        """k: the number of ratio steps from s to M."""
        return round(math.log(self.maximum / self.smallest) / math.log(self.ratio))

    @property
    def bins(self) -> int:
        return self.steps + 1

    def edges(self) -> np.ndarray:
        """0, s, s·r, ..., M (bins + 1 edges)."""
        tops = self.smallest * self.ratio ** np.arange(self.bins, dtype=np.float64)
        tops[-1] = self.maximum
        return np.concatenate([[0.0], tops])

    def midpoints(self) -> np.ndarray:
        e = self.edges()
        return (e[:-1] + e[1:]) / 2

    def bin_of(self, values: np.ndarray) -> np.ndarray:
        """0 below s, else ⌊ln(|x|/s)/ln r⌋ + 1, clamped: as the engine's lowering of the
        histogram computes it (dpsql.lower.compile.clamp_histogram_query, a tree)."""
        a = np.minimum(np.abs(np.asarray(values, dtype=np.float64)), self.maximum)
        ratio = np.maximum(a, self.smallest) / self.smallest
        raw = np.where(a < self.smallest, 0, np.floor(np.log(ratio) / math.log(self.ratio)) + 1)
        return np.clip(raw, 0, self.bins - 1).astype(np.int64)

    def counts(self, values: np.ndarray) -> np.ndarray:
        return np.bincount(self.bin_of(values), minlength=self.bins).astype(np.int64)


@dataclass(frozen=True)
class ClipRange:
    """A DP clipping range and what it was chosen from (all public after the release)."""

    lower: float
    upper: float
    bound: float  # C: the chosen bound on |x|
    noisy_counts: np.ndarray
    histogram: LogHistogram
    method: str

    def bias(self) -> BiasReport:
        return bias_report(self.noisy_counts, self.histogram, self.bound)


@dataclass(frozen=True)
class BiasReport:
    """The estimated effect of clamping |x| at C, from the noisy histogram (post-processing).

    ``sum_bias``: Σ n̂_b (r_b − C)₊ (r_b the bin midpoint), the amount a clamped SUM of |x|
    is estimated to lose; ``clipped_share``: the estimated share of values beyond C;
    ``sum_bias_upper``: the same with bin tops for r_b (an upper estimate).
    """

    sum_bias: float
    sum_bias_upper: float
    clipped_share: float

    def relative(self, total: float) -> float:
        """The bias relative to a (noisy) total, for the release's notes."""
        return self.sum_bias / max(abs(total), 1e-300)


def bias_report(noisy_counts: np.ndarray, hist: LogHistogram, bound: float) -> BiasReport:
    n = np.maximum(np.asarray(noisy_counts, dtype=np.float64), 0.0)
    e = hist.edges()
    mid, top = (e[:-1] + e[1:]) / 2, e[1:]
    beyond = np.maximum(mid - bound, 0.0)
    total = float(n.sum())
    share = float(n[e[:-1] >= bound].sum() / total) if total > 0 else 0.0
    return BiasReport(
        float((n * beyond).sum()), float((n * np.maximum(top - bound, 0.0)).sum()), share
    )


def clip_range(lower: float, upper: float, bound: float) -> tuple[float, float]:
    """The clamp range a bound C gives a column declared in [lower, upper]: [max(lower, −C),
    min(upper, C)] (a non-negative column keeps its lower bound); a range entirely below zero,
    e.g. [-10, -5], keeps the declared one.

    >>> clip_range(-100.0, 100.0, 10.0), clip_range(0.0, 100.0, 10.0), clip_range(-10, -5, 1)
    ((-10.0, 10.0), (0.0, 10.0), (-10, -5))
    """
    lo = lower if lower >= 0 else max(lower, -bound)
    hi = min(upper, bound)
    if hi < lo:
        return lower, upper
    return lo, hi


@dataclass(frozen=True)
class ApproxBounds:
    """Spend ``epsilon`` (the stated share of a query's ε) on a DP clipping range."""

    histogram: LogHistogram
    epsilon: float
    max_values: int = 1
    method: str = "sum"
    q: float = 0.99  # "quantile"
    false_bin: float = 0.05  # "threshold": P(some empty bin passes τ) <= this
    sum_epsilon: float | None = None  # "sum": the ε the clamped SUM will get
    # "posterior": the released histogram's noise scale, where it is not this object's own
    # (choosing from a kept histogram released by another ApproxBounds), and a weight each
    # count stands for (a histogram of units weighted by the rows a unit keeps)
    noise_scale: float | None = None
    weight: float = 1.0

    name = "approx_bounds"

    def __post_init__(self) -> None:
        if not (math.isfinite(self.epsilon) and self.epsilon > 0):
            raise ValueError("automatic clipping needs a share epsilon > 0")
        if self.method not in METHODS:
            raise ValueError(f"method is one of {METHODS}")
        if self.method in ("sum", "mse", "posterior") and not (
            self.sum_epsilon and self.sum_epsilon > 0
        ):
            raise ValueError(f"method {self.method!r} needs the SUM's epsilon (sum_epsilon > 0)")
        if not (isinstance(self.max_values, int) and self.max_values >= 1):
            raise ValueError("max_values must be an integer >= 1")

    @property
    def mechanism(self) -> Laplace:
        return Laplace(l1=float(self.max_values), epsilon=self.epsilon)

    @property
    def cost(self) -> Cost:
        return self.mechanism.cost

    @property
    def threshold(self) -> float:
        """τ: an empty bin's noisy count reaches τ with probability <= false_bin / #bins."""
        return self.mechanism.threshold(self.false_bin, self.histogram.bins) - 1

    def release(
        self, counts: np.ndarray, source: NoiseSource, lower: float, upper: float
    ) -> ClipRange:
        counts = np.asarray(counts, dtype=np.int64)
        if counts.shape != (self.histogram.bins,) or (counts.size and counts.min() < 0):
            raise ValueError(f"expected {self.histogram.bins} non-negative bin counts")
        noisy = counts + self.mechanism.sample(source, counts.size)
        return self.choose(noisy, lower, upper)

    def choose(self, noisy: np.ndarray, lower: float, upper: float) -> ClipRange:
        """The range from a noisy histogram (post-processing only)."""
        noisy = np.asarray(noisy)
        bound = getattr(self, f"_by_{self.method}")(noisy.astype(np.float64))
        lo, hi = clip_range(lower, upper, bound)
        if self.weight != 1.0:  # the counts the range was chosen from, as the rows they stand for
            noisy = noisy * self.weight
        return ClipRange(float(lo), float(hi), float(bound), noisy, self.histogram, self.method)

    def _by_threshold(self, noisy: np.ndarray) -> float:
        passed = np.flatnonzero(noisy >= self.threshold)
        top = self.histogram.edges()[1:]
        return float(top[passed[-1]]) if passed.size else self.histogram.maximum

    def _by_quantile(self, noisy: np.ndarray) -> float:
        n = np.maximum(noisy, 0.0)
        top = self.histogram.edges()[1:]
        if n.sum() <= 0:
            return self.histogram.maximum
        share = np.cumsum(n) / n.sum()
        return float(top[int(np.searchsorted(share, self.q))])

    def _by_sum(self, noisy: np.ndarray) -> float:
        candidates = self.histogram.edges()[1:]
        assert self.sum_epsilon is not None
        errors = [
            bias_report(noisy, self.histogram, c).sum_bias + self.max_values * c / self.sum_epsilon
            for c in candidates
        ]
        return float(candidates[int(np.argmin(errors))])

    def _by_mse(self, noisy: np.ndarray) -> float:
        candidates = self.histogram.edges()[1:]
        assert self.sum_epsilon is not None
        errors = [
            bias_report(noisy, self.histogram, c).sum_bias ** 2
            + 2 * (self.max_values * c / self.sum_epsilon) ** 2
            for c in candidates
        ]
        return float(candidates[int(np.argmin(errors))])

    def _by_posterior(self, noisy: np.ndarray) -> float:
        scale = self.noise_scale if self.noise_scale is not None else self.mechanism.scale
        mean, var = posterior_counts(noisy, scale)
        mean, var = mean * self.weight, var * self.weight**2
        candidates, excess = posterior_candidates(self.histogram)
        assert self.sum_epsilon is not None
        noise = self.max_values * candidates / self.sum_epsilon
        errors = (excess @ mean) ** 2 + (excess**2) @ var + 2 * noise**2
        return float(candidates[int(np.argmin(errors))])


def posterior_counts(noisy: np.ndarray, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """Per bin, the posterior mean and variance of the true count n >= 0 given the noisy
    count y of a discrete Laplace release of scale ``scale`` (P(y | n) ∝ exp(−|y − n|/scale)),
    under a geometric prior whose mean μ_b is the average of max(y, 0) over the bin and its
    two neighbours (at least :data:`PRIOR_FLOOR`): an empirical-Bayes estimate that borrows
    the neighbourhood's mass. Exact sums over n within 16·scale of y (the likelihood
    beyond is below e^-16 of its peak; per bin a window of that width around max(y, 0), as
    the prior, whose mean is at least a third of the bin's own count, cannot pull it further).
    Post-processing only. Weighted counts (a histogram of units, dpsql.service.bounds) are
    passed unweighted and the moments scaled after."""
    y = np.asarray(noisy, dtype=np.float64)  # (..., bins): several histograms at once
    if y.size == 0:
        return y.copy(), y.copy()
    positive = np.maximum(y, 0.0)
    padded = np.concatenate([positive[..., :1], positive, positive[..., -1:]], axis=-1)
    mu = np.maximum((padded[..., :-2] + padded[..., 1:-1] + padded[..., 2:]) / 3, PRIOR_FLOOR)
    width = int(16 * scale + 8)
    low = np.maximum(np.floor(positive) - width, 0.0)
    # every integer in the window, or (a large noise scale) 4,001 points spread over it
    n = low[..., None] + np.linspace(0.0, 2 * width, min(2 * width + 1, 4001))
    log_w = -np.abs(y[..., None] - n) / scale + n * np.log(mu / (1 + mu))[..., None]
    w = np.exp(log_w - log_w.max(axis=-1, keepdims=True))
    w /= w.sum(axis=-1, keepdims=True)
    mean = (w * n).sum(axis=-1)
    return mean, np.maximum((w * n * n).sum(axis=-1) - mean * mean, 0.0)


@functools.lru_cache(maxsize=64)
def posterior_candidates(hist: LogHistogram) -> tuple[np.ndarray, np.ndarray]:
    """The "posterior" rule's candidate bounds (:data:`POSTERIOR_STEPS` log-spaced per bin,
    each bin's top edge among them) and, per candidate C and bin b, e_b(C): the mean excess
    (x − C)⁺ of a value of bin b, its values spread log-uniformly in the bin (8 points; bin 0
    at its midpoint), the top bin's at the declared bound (values beyond it are clamped
    there). Public: a function of the bins alone (cached per histogram: every later query
    of a column chooses on the same bins)."""
    edges = hist.edges()
    tops = edges[1:]
    lows = np.concatenate([[tops[0] / hist.ratio], tops[:-1]])
    steps = np.arange(1, POSTERIOR_STEPS + 1) / POSTERIOR_STEPS
    candidates = np.unique((lows[:, None] * (tops / lows)[:, None] ** steps[None, :]).ravel())
    candidates = candidates[candidates <= hist.maximum]
    t = (np.arange(8) + 0.5) / 8
    points = np.empty((hist.bins, 8))
    for b in range(hist.bins):
        lo, hi = edges[b], edges[b + 1]
        points[b] = hi / 2 if lo <= 0 else lo * (hi / lo) ** t
    points[-1] = hist.maximum
    excess = np.maximum(points[None, :, :] - candidates[:, None, None], 0.0).mean(axis=2)
    candidates.flags.writeable = excess.flags.writeable = False  # cached: shared by callers
    return candidates, excess
