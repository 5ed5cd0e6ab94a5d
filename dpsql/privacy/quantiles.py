"""DP quantiles from engine-computed bin counts: the exponential mechanism on a public grid, and
the smooth-sensitivity median.

Input. The declared range [L, U] of a column is cut into B public bins (:class:`Grid`); the
engine computes, per group, the count of values in each bin after bounding every unit to at
most R values (``max_values``). Nothing here sees a value, only these counts.

Exponential mechanism (Smith 2011, on a grid). The target is a rank point τ = q·n + offset
(n = Σ counts; :func:`target` gives the conventions). Bin b covers the rank interval
[A_b, B_b] = [count below b, count up to b]; its utility is −d_b with
d_b = max(A_b − τ, τ − B_b, 0), the distance in ranks between τ and the bin. Adding one value
moves A_b and B_b by 0 or 1 and τ by q, so d_b moves by at most Δ₁ = max(q, 1 − q) (1/2 for
the median, 1 for MIN/MAX); a unit's R values by at most Δ = R·Δ₁. Releasing bin b with
P(b) ∝ exp(−ε d_b / (2Δ)) is ε-DP (McSherry & Talwar 2007), and the released value is the
bin's representative (its value for unit bins of an integer column, else its midpoint).

Exact sampling. ε is replaced by a rational ε' <= ε (ε itself when it is a short rational,
else rounded down to a multiple of 2⁻³²), so every γ_b = ε'(d_b − min d)/(2Δ) is an exact
rational. The bin is the inverse CDF of the weights e^(−γ_b) at a uniform U drawn from CSPRNG
bytes: a float pass with a rigorous error bound decides whenever U·total is farther than the
bound from every cumulative sum (all but ~10⁻¹² of draws); otherwise correctly rounded decimal
arithmetic with more bits of the same U decides, at doubling precision. The output is exactly
the EM distribution (no truncated tails: every bin keeps its positive probability). The work
is O(B) whatever the data (the rare exact path aside).

Several quantiles: recursive splitting (as in Kaplan, Schnapp & Stemmer 2022): the middle
quantile is released first, the bins are split at it and each side's quantiles are released
recursively with their levels rescaled; each of the ⌈log₂(m+1)⌉ levels spends ε/levels, and
within a level the EMs run on disjoint bins, so a unit's R values spread over them cost at
most one level's ε in total (each EM is calibrated for R).

Intervals. The EM tail bound P(d_out > (2Δ/ε)(ln B + t)) <= e^(−t), with min_b d_b = 0, makes
h = (2Δ/ε) ln(B/α) a *public* rank half-width: with probability >= 1 − α the released value
lies between the (τ − h)-th and (τ + h)-th ranks of the data (bin-rounded), i.e. between the
quantiles q ∓ h/n. :meth:`QuantileRelease.level_interval` turns it into quantile levels with a
noisy n. The EM's output distribution itself is data-dependent, so it is never released.

Smooth-sensitivity median (Nissim, Raskhodnikova & Smith 2007, §3.1, for R values per unit):
S(x) = max_k e^(−kβ) (x_{m+2R(k+1)} − x_{m−2R(k+1)}) with x_i = L below 1 and U above n, over
the sorted bin representatives (a window wide enough for add/remove neighbours, see
:func:`smooth_sensitivity_median`); noise 6S/ε · Cauchy (:class:`SmoothCauchy`, pure ε). The
release is clamped to [L, U] and snapped to its bin's representative (the float Cauchy draw
never shows its low bits; Mironov 2012's snapping, without a formal proof for Cauchy). S is
data-dependent, so no interval is released with it.
"""

from __future__ import annotations

import bisect
import decimal
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from dpsql.privacy.accounting import Cost, exact
from dpsql.privacy.samplers import (
    ByteStream,
    NoiseSource,
    ZeroNoise,
    bernoulli_exp_scalar,
    uniform_below_scalar,
)
from dpsql.privacy.smooth import SmoothCauchy

MAX_BINS = 1 << 17  # proposals grow with B; a grid finer than this is refused
_EPS_BITS = 32


# --- the public grid -----------------------------------------------------------------------


@dataclass(frozen=True)
class Grid:
    """B public bins over [lower, upper]: equal (``linear``) or equal in log(x − lower + 1)
    (``log``: constant relative resolution, for skewed columns such as income). ``integer``
    columns with unit bins release the value itself."""

    lower: float
    upper: float
    bins: int
    integer: bool = False
    scale: str = "linear"

    def __post_init__(self) -> None:
        if not (math.isfinite(self.lower) and math.isfinite(self.upper)):
            raise ValueError("a quantile grid needs finite declared bounds")
        if not self.upper > self.lower:
            raise ValueError("a quantile grid needs upper > lower")
        if not (isinstance(self.bins, int) and 1 <= self.bins <= MAX_BINS):
            raise ValueError(f"a quantile grid has 1 to {MAX_BINS} bins")
        if self.scale not in ("linear", "log"):
            raise ValueError("a grid's scale is 'linear' or 'log'")

    @classmethod
    def for_column(
        cls, lower: float, upper: float, *, integer: bool, bins: int = 4096, scale: str = "linear"
    ) -> Grid:
        """Unit bins for an integer column whose range fits; else ``bins`` bins."""
        if integer and upper - lower + 1 <= bins:
            return cls(float(lower), float(upper) + 1.0, int(upper - lower + 1), integer=True)
        return cls(float(lower), float(upper), bins, scale=scale)

    @property
    def width(self) -> float:
        """The bin width (linear grids; the widest bin of a log grid)."""
        edges = self.edges()
        return float(np.max(np.diff(edges)))

    @property
    def _log_span(self) -> float:
        return math.log1p(self.upper - self.lower)

    def edges(self) -> np.ndarray:
        i = np.arange(self.bins + 1, dtype=np.float64)
        if self.scale == "log":
            out = self.lower + np.expm1(self._log_span * i / self.bins)
        else:
            out = self.lower + (self.upper - self.lower) / self.bins * i
        out[0], out[-1] = self.lower, self.upper
        return out

    def values(self) -> np.ndarray:
        """Each bin's representative: its value (integer unit bins) or its midpoint."""
        if self.integer and self.scale == "linear" and self.upper - self.lower == self.bins:
            return self.lower + np.arange(self.bins, dtype=np.float64)
        edges = self.edges()
        return (edges[:-1] + edges[1:]) / 2

    def bin_of(self, values: np.ndarray) -> np.ndarray:
        """Bin indices of values (clamped into the range), as the engine's lowering of the
        grid computes them (dpsql.lower.compile.bin_expr, a tree)."""
        x = np.asarray(values, dtype=np.float64)
        if self.scale == "log":
            shifted = 1.0 + np.maximum(0.0, x - self.lower)  # as LN(1 + ...) in SQL
            raw = np.floor(np.log(shifted) * (self.bins / self._log_span))
        else:
            raw = np.floor((x - self.lower) * (self.bins / (self.upper - self.lower)))
        return np.clip(raw, 0, self.bins - 1).astype(np.int64)

    def counts(self, values: np.ndarray) -> np.ndarray:
        """Per-bin counts of ``values`` (tests and benchmarks; the engine does this in SQL)."""
        return np.bincount(self.bin_of(values), minlength=self.bins).astype(np.int64)


# --- targets -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """τ = q·n + offset: the rank point a release aims at (exact rationals)."""

    q: Fraction
    offset: Fraction = Fraction(0)
    # "rank": d_b = max(A_b − τ, τ − B_b, 0), the rank distance of τ from the bin;
    # "cdf": s_b = |(1 − q)·A_b − q·(n − B_b)| (the CDF score OpenDP uses): it also counts the
    # values inside a bin on the far side of τ, so on tie-heavy data (ages on unit bins) the bin
    # holding τ stands out from its neighbours. Same sensitivity max(q, 1 − q); s_b >= d_b.
    score: str = "rank"

    def rank(self, n: int) -> Fraction:
        return self.q * n + self.offset

    @property
    def sensitivity(self) -> Fraction:
        """How far one added or removed value moves any d_b: max(q, 1 − q) (A_b and B_b move
        by 0 or 1 together with τ's q); 1/2 for the median, 1 for MIN and MAX."""
        return max(self.q, 1 - self.q)


def target(kind: str, q: float | None = None, score: str = "rank") -> Target:
    """The rank point of an aggregate.

    - ``quantile`` q ∈ (0, 1) (MEDIAN is q = 1/2; PERCENTILE_CONT/DISC and QUANTILE_* alike):
      τ = q·n, the point splitting the data in q : 1 − q.
    - ``min``: τ = 1/2, the middle of the smallest value's rank interval [0, 1]: the bin of the
      minimum has distance 0, every other bin at least 1/2.
    - ``max``: τ = n − 1/2, symmetrically the bin of the maximum.
    """
    if kind == "min":
        return Target(Fraction(0), Fraction(1, 2))
    if kind == "max":
        return Target(Fraction(1), Fraction(-1, 2))
    if kind != "quantile":
        raise ValueError(f"unknown quantile target {kind!r}")
    if q is None or not 0 < q < 1:
        raise ValueError("a quantile level must be in (0, 1)")
    if score not in ("rank", "cdf"):
        raise ValueError("a quantile score is 'rank' or 'cdf'")
    return Target(exact(q), score=score)


# --- the exponential mechanism ---------------------------------------------------------------


def _epsilon_below(epsilon: float) -> Fraction:
    """A rational ε' <= ε: ε itself when its exact value has a denominator <= 2^k, else ε
    rounded down to a multiple of 2^-k, with k = 32 for ε >= 1/2 and 32 more bits for every
    halving below (ε' keeps at least 32 significant bits, so a tiny ε is never rounded to 0;
    a smaller ε' only strengthens the guarantee). Refuses only a non-finite or non-positive ε
    (ValueError): every finite ε > 0 a plan can hold is drawable."""
    if not (math.isfinite(epsilon) and epsilon > 0):
        raise ValueError("the exponential mechanism needs a finite epsilon > 0")
    bits = _EPS_BITS + max(0, -math.frexp(epsilon)[1])
    value = exact(epsilon)
    if value.denominator <= 1 << bits and value <= Fraction(epsilon):
        return value
    rounded = Fraction(math.floor(Fraction(epsilon) * (1 << bits)), 1 << bits)
    if rounded <= 0:  # unreachable: ε >= 2^(e-1) and 2^-bits <= 2^(e-33)
        raise ValueError("epsilon is too small for the exponential mechanism")
    return rounded


#: Largest magnitude the int64 rank arithmetic may reach; beyond it Python integers are used.
_INT64_SAFE = 1 << 62


def _integers(values: np.ndarray, bound: int) -> np.ndarray:
    """``values`` (int64) as int64 when every intermediate stays below 2^62 in magnitude
    (``bound``), else as Python integers (object array): exact either way, never wrapping."""
    return values if bound < _INT64_SAFE else values.astype(object)


def distances(counts: np.ndarray, tau: Fraction) -> tuple[np.ndarray, int]:
    """(D·d_b for every bin, D): d_b = max(A_b − τ, τ − B_b, 0) as integer numerators over
    the common denominator D of τ (exact). int64 when n·D + |τ·D| stays below 2^62, else
    Python integers: a level with a long decimal (QUANTILE_CONT(x, 1e-20), D = 10^20) or a
    large n never overflows, whatever the data."""
    counts = np.asarray(counts, dtype=np.int64)
    if counts.size and counts.min() < 0:
        raise ValueError("bin counts must be >= 0")
    den = tau.denominator
    t = tau.numerator
    counts = _integers(counts, (int(counts.sum()) + 1) * den + abs(t))
    upper = np.cumsum(counts) * den
    lower = upper - counts * den
    return np.maximum(np.maximum(lower - t, t - upper), 0), den


@dataclass(frozen=True)
class _Scores:
    """γ_b = ε'·(d_b − min d)/(2RΔ) = steps_b · num / den exactly; ``steps`` are int64, or
    Python integers (object) where int64 could overflow (:func:`distances`)."""

    steps: np.ndarray
    num: int
    den: int

    def exact(self, b: int) -> Fraction:
        return Fraction(int(self.steps[b]) * self.num, self.den)

    def floats(self) -> np.ndarray:
        if self.steps.dtype != object:
            return self.steps.astype(np.float64) * (self.num / self.den)
        # Python integers (a long level's denominator): each γ correctly rounded from its
        # exact value, capped where e^(-γ) is 0 in floats anyway (never an OverflowError).
        top = 10**300 * self.den
        return np.array(
            [
                (int(s) * self.num) / self.den if int(s) * self.num < top else 1e300
                for s in self.steps
            ],
            dtype=np.float64,
        )


def cdf_distances(counts: np.ndarray, q: Fraction) -> tuple[np.ndarray, int]:
    """(D·s_b, D): s_b = |(1 − q)·A_b − q·(n − B_b)| as integer numerators over q's
    denominator (exact; Python integers when int64 could overflow, as :func:`distances`).
    One added value moves A_b (value below b) or n − B_b (above) by 1, or neither (inside):
    s_b moves by at most max(q, 1 − q)."""
    counts = np.asarray(counts, dtype=np.int64)
    if counts.size and counts.min() < 0:
        raise ValueError("bin counts must be >= 0")
    a, den = q.numerator, q.denominator
    counts = _integers(counts, (int(counts.sum()) + 1) * (den + abs(a)))
    upper = np.cumsum(counts)
    lower = upper - counts
    above = int(counts.sum()) - upper
    return np.abs((den - a) * lower - a * above), den


def _scores(counts: np.ndarray, tgt: Target, epsilon: Fraction, max_values: int) -> _Scores:
    n = int(np.asarray(counts, dtype=np.int64).sum())
    if tgt.score == "cdf":
        d, den = cdf_distances(counts, tgt.q)
    else:
        d, den = distances(counts, tgt.rank(n))
    sens = tgt.sensitivity * max_values
    # γ = ε'·(d − min)/(2·sens) with d = steps/den
    scale = epsilon / (2 * sens * den)
    return _Scores(d - d.min(), scale.numerator, scale.denominator)


def em_probabilities(
    counts: np.ndarray, tgt: Target, epsilon: float, max_values: int = 1
) -> np.ndarray:
    """The EM's output distribution over bins (float, for tests and audits: never released)."""
    w = np.exp(-_scores(counts, tgt, _epsilon_below(epsilon), max_values).floats())
    return w / w.sum()


_ULP = 2.0**-53


def _sample(scores: _Scores, source: NoiseSource) -> int:
    """Index b with P(b) ∝ exp(−γ_b), exactly, by inverting the CDF at a uniform U.

    Fast path: float weights with a rigorous error bound (γ_b to 3 ulps, exp to 16 ulps, the
    cumulative sum to B ulps); U = u/2⁶⁴ from 8 CSPRNG bytes; when U·total lies farther than
    the bound from every cumulative sum the float answer is the exact one. Otherwise (about
    once in 10¹² draws) :func:`_resolve` decides with correctly rounded decimal arithmetic and
    more bits of the same U, doubling the precision until the comparison is certain.
    """
    if isinstance(source, ZeroNoise):  # the no-noise test hook: the best bin (first of ties)
        return int(np.argmin(scores.steps))
    fetch = getattr(source, "_random_bytes", None)
    gamma = scores.floats()
    if fetch is None:  # a source without raw bytes: Gumbel-max in floats (not exact)
        return int(np.argmax(-gamma + source.gumbel(1.0, gamma.size)))
    rb = ByteStream(fetch, 8)
    u = rb.take(8)
    w = np.exp(-gamma)
    cum = np.cumsum(w)
    total = float(cum[-1])
    eta = (3.0 * float(gamma.max()) + 16.0) * _ULP + gamma.size * 2 * _ULP
    margin = 4.0 * eta * total + 2.0**-60 * total
    x_lo = u * 2.0**-64 * total
    x_hi = (u + 1) * 2.0**-64 * total
    j = int(np.searchsorted(cum, x_lo, side="right"))
    below = float(cum[j - 1]) if j > 0 else 0.0
    if j < cum.size and x_lo - below > margin and float(cum[j]) - x_hi > margin:
        return j
    return _resolve(scores, u, 64, rb)


def _sample_pf(scores: _Scores, source: NoiseSource) -> int:
    """Permute-and-flip (McKenna & Sheldon 2020): visit bins in a uniformly random order and
    stop at the first b accepted with probability exp(−γ_b) (the best bin always is). ε-DP
    with the EM's calibration, never worse in expected utility. Exact: the order is drawn
    lazily by Fisher–Yates on exact uniform integers, each flip by the exact
    Bernoulli(exp(−p/q)) of samplers.py. The number of flips depends on the data."""
    if isinstance(source, ZeroNoise):
        return int(np.argmin(scores.steps))
    fetch = getattr(source, "_random_bytes", None)
    if fetch is None:  # a source without raw bytes: exponential noisy max in floats (not exact)
        gamma = scores.floats()
        return int(np.argmax(-gamma - np.log(source.uniform(gamma.size) + 2.0**-54)))
    rb = ByteStream(fetch, 256)
    steps = scores.steps
    remaining = list(range(steps.size))
    left = len(remaining)
    while True:
        i = uniform_below_scalar(rb, left)
        b = remaining[i]
        remaining[i] = remaining[left - 1]
        left -= 1
        num = int(steps[b]) * scores.num
        if num == 0 or bernoulli_exp_scalar(rb, num, scores.den):
            return b


def _resolve(scores: _Scores, u: int, bits: int, rb: ByteStream) -> int:
    """The exact inverse CDF at U ∈ [u, u + 1)/2^bits: bounds on every e^(−γ) from decimal
    exp (correctly rounded) at ``prec`` digits, widened by the rounding of −γ; refine U and
    the precision until one index is certain."""
    prec = 60
    size = scores.steps.size
    while True:
        ctx = decimal.Context(prec=prec + 10)
        lo_terms, hi_terms = [], []
        for b in range(size):
            g = scores.exact(b)
            x = ctx.divide(decimal.Decimal(-g.numerator), decimal.Decimal(g.denominator))
            term = Fraction(ctx.exp(x))
            rel = Fraction(int(abs(x)) + 2, 10 ** (prec - 1))
            lo_terms.append(term * (1 - rel))
            hi_terms.append(term * (1 + rel))
        cum_lo = list(itertools.accumulate(lo_terms))
        cum_hi = list(itertools.accumulate(hi_terms))
        u_lo, u_hi = Fraction(u, 1 << bits), Fraction(u + 1, 1 << bits)
        x_lo, x_hi = u_lo * cum_lo[-1], u_hi * cum_hi[-1]
        j = bisect.bisect_right(cum_hi, x_lo)
        if j < size and (j == 0 or cum_hi[j - 1] <= x_lo) and x_hi < cum_lo[j]:
            return j
        u = (u << 64) | rb.take(8)
        bits += 64
        prec *= 2


@dataclass(frozen=True)
class QuantileRelease:
    """A released quantile: the value, its bin, and the public 95% rank half-width."""

    value: float
    bin: int
    rank_halfwidth: float  # h: |rank(value) − τ| <= h with probability >= confidence
    confidence: float

    def level_interval(self, q: float, noisy_n: float) -> tuple[float, float]:
        """Quantile levels (q − h/n̂, q + h/n̂), clipped to [0, 1]: post-processing of a
        noisy count n̂ released elsewhere."""
        n = max(float(noisy_n), 1.0)
        return max(0.0, q - self.rank_halfwidth / n), min(1.0, q + self.rank_halfwidth / n)


def rank_halfwidth(
    bins: int, epsilon: float, sensitivity: float, confidence: float = 0.95
) -> float:
    """h = (2Δ/ε) ln(B/α), Δ = R·max(q, 1 − q): the EM's rank error exceeds h with
    probability <= α = 1 − c (min_b d_b = 0, and P(d_out > (2Δ/ε)(ln B + t)) <= e^(−t))."""
    if not 0 < confidence < 1:
        raise ValueError("confidence must be in (0, 1)")
    return 2 * float(sensitivity) / epsilon * math.log(bins / (1 - confidence))


@dataclass(frozen=True)
class ExponentialQuantile:
    """The EM over a public grid for one rank target: ε-DP for ≤ ``max_values`` values per
    unit (utility sensitivity R). ``cost`` is what to charge."""

    grid: Grid
    epsilon: float
    max_values: int = 1
    confidence: float = 0.95
    method: str = "em"  # "em": exponential mechanism; "pf": permute-and-flip (same ε)

    name = "exponential_quantile"

    def __post_init__(self) -> None:
        _epsilon_below(self.epsilon)
        if not (isinstance(self.max_values, int) and self.max_values >= 1):
            raise ValueError("max_values must be an integer >= 1")
        if self.method not in ("em", "pf"):
            raise ValueError("method is 'em' or 'pf'")

    @property
    def cost(self) -> Cost:
        return Cost(epsilon=self.epsilon)

    def rank_halfwidth(self, tgt: Target) -> float:
        """The public 95% (``confidence``) rank half-width of a release aimed at ``tgt``."""
        sensitivity = float(tgt.sensitivity) * self.max_values
        return rank_halfwidth(self.grid.bins, self.epsilon, sensitivity, self.confidence)

    def release(self, counts: np.ndarray, tgt: Target, source: NoiseSource) -> QuantileRelease:
        counts = _check_counts(counts, self.grid)
        scores = _scores(counts, tgt, _epsilon_below(self.epsilon), self.max_values)
        b = _sample(scores, source) if self.method == "em" else _sample_pf(scores, source)
        value = float(self.grid.values()[b])
        return QuantileRelease(value, b, self.rank_halfwidth(tgt), self.confidence)


def _check_counts(counts: np.ndarray, grid: Grid) -> np.ndarray:
    counts = np.asarray(counts, dtype=np.int64)
    if counts.shape != (grid.bins,):
        raise ValueError(f"expected {grid.bins} bin counts, got shape {counts.shape}")
    if counts.size and counts.min() < 0:
        raise ValueError("bin counts must be >= 0")
    return counts


# --- several quantiles: recursive splitting --------------------------------------------------


def levels(m: int) -> int:
    """⌈log₂(m + 1)⌉: the depth of the splitting tree of m quantiles."""
    return max(1, math.ceil(math.log2(m + 1)))


@dataclass(frozen=True)
class JointQuantiles:
    """m quantiles (increasing levels) by recursive splitting: ε-DP in total."""

    grid: Grid
    epsilon: float
    max_values: int = 1
    confidence: float = 0.95
    score: str = "rank"  # each level's EM score (see Target)

    name = "recursive_quantiles"

    @property
    def cost(self) -> Cost:
        return Cost(epsilon=self.epsilon)

    def level_epsilon(self, m: int) -> float:
        """The ε each EM of ``m`` levels runs at: the largest float e with levels(m)·e <= ε
        (at most two nextafter steps below ε/levels, whatever ε)."""
        depth = levels(m)
        eps = self.epsilon / depth
        while eps * depth > self.epsilon:
            eps = math.nextafter(eps, 0.0)
        return eps

    def release(
        self, counts: np.ndarray, qs: Sequence[float], source: NoiseSource
    ) -> list[QuantileRelease]:
        qs = [float(q) for q in qs]
        if not qs or any(not 0 < q < 1 for q in qs) or qs != sorted(qs):
            raise ValueError("quantile levels must be increasing and in (0, 1)")
        counts = _check_counts(counts, self.grid)
        eps = self.level_epsilon(len(qs))
        out: dict[int, QuantileRelease] = {}
        self._split(counts, 0, self.grid.bins, list(enumerate(qs)), 0.0, 1.0, eps, source, out)
        return [out[i] for i in range(len(qs))]

    def _split(self, counts, lo, hi, items, q_lo, q_hi, eps, source, out) -> None:
        """Release the middle item on bins [lo, hi) (levels rescaled to (q_lo, q_hi)), then
        recurse: left on bins [lo, b] with their data, right on bins [b, hi) with the data of
        (b, hi) only, so every value is in exactly one subproblem per level."""
        if not items:
            return
        mid = len(items) // 2
        index, q = items[mid]
        local = (exact(q) - exact(q_lo)) / (exact(q_hi) - exact(q_lo))
        local = min(max(local, Fraction(0)), Fraction(1))
        tgt = Target(local, score=self.score if 0 < local < 1 else "rank")
        scores = _scores(counts[lo:hi], tgt, _epsilon_below(eps), self.max_values)
        b = lo + _sample(scores, source)
        sensitivity = float(tgt.sensitivity) * self.max_values
        h = rank_halfwidth(hi - lo, eps, sensitivity, self.confidence)
        out[index] = QuantileRelease(float(self.grid.values()[b]), b, h, self.confidence)
        left = counts.copy()
        left[b + 1 :] = 0
        right = counts.copy()
        right[: b + 1] = 0
        self._split(left, lo, b + 1, items[:mid], q_lo, q, eps, source, out)
        self._split(right, b, hi, items[mid + 1 :], q, q_hi, eps, source, out)


def check_drawable(
    grid: Grid, part_epsilon: float, part_sizes: Sequence[int], method: str = "em"
) -> None:
    """ValueError unless every release of a quantile measure can run at its ε: the check the
    planner makes before the charge (from ε and the text alone, O(parts)), so that no release
    after it refuses. ``part_sizes``: per part, how many targets it releases (MIN and MAX
    alone: 1; the levels in (0, 1) jointly)."""
    if method == "smooth":
        SmoothCauchy(part_epsilon)
        return
    joint = JointQuantiles(grid, part_epsilon)
    for size in part_sizes:
        _epsilon_below(part_epsilon if size <= 1 else joint.level_epsilon(size))


# --- the privacy map of exponential-mechanism releases --------------------------------------


def exponential_map(
    epsilon: float, releases: int, max_values: int = 1, calibrated_values: int = 1
) -> Cost:
    """The cost of ``releases`` exponential mechanisms of ``epsilon`` each (a quantile
    measure's parts in every group, MODE's one noisy max per group), each calibrated for a
    unit with ``calibrated_values`` values in its group, when the plan's Bound node lets a
    unit hold ``max_values`` there (equal: the cost the planner charges).

    Proof (stated once for both plan-tree nodes: dpsql.plan.measures.QuantileMeasurement and
    dpsql.aggregates.mode.ModeMeasurement). An EM calibrated for utility sensitivity Δ with
    P(b) ∝ exp(ε·u_b / (2Δ)) is ε-DP (McSherry & Talwar 2007). Its utilities move by Δ per
    ``calibrated_values`` values of one unit (a rank distance by at most max(q, 1 − q) per
    value, a count by at most 1), so with ``max_values`` values they move by at most
    Δ' = Δ·max_values / calibrated_values; each weight's exponent and the normaliser's log
    then move by at most ε·Δ' / (2Δ), and the loss is at most ε·max(1, Δ'/Δ) (never below ε:
    the planner charged that much). The releases compose (pure ε: their sum; zCDP: each
    ε_r-DP release charged ε_r²/2, a safe upper bound on the EM's ε_r²/8, summed)."""
    e = Fraction(epsilon) * max(Fraction(1), Fraction(max_values, calibrated_values))
    return Cost(epsilon=e * releases, zrho=releases * e * e / 2)


# --- report-noisy-max (MODE: dpsql.aggregates.mode) ---------------------------------------------


def report_noisy_max(
    counts: np.ndarray, epsilon: float, sensitivity: int, source: NoiseSource
) -> int:
    """The index of a noisy largest count: the exponential mechanism with utility c_b and
    sensitivity Δ, P(b) ∝ exp(ε'·c_b / (2Δ)) (ε' <= ε exactly rational), i.e. report-noisy-
    max with Gumbel noise, drawn exactly by inverting the CDF (:func:`_sample`): ε-DP whenever
    one unit moves each count by at most Δ. ZeroNoise: the first largest count."""
    counts = np.asarray(counts, dtype=np.int64)
    if counts.ndim != 1 or counts.size == 0 or (counts.size and counts.min() < 0):
        raise ValueError("report_noisy_max needs a non-empty vector of counts >= 0")
    if not (isinstance(sensitivity, int) and sensitivity >= 1):
        raise ValueError("the sensitivity must be an integer >= 1")
    scale = _epsilon_below(epsilon) / (2 * sensitivity)
    steps = _integers(counts.max() - counts, int(counts.max()))
    return _sample(_Scores(steps, scale.numerator, scale.denominator), source)


def noisy_max_probabilities(counts: np.ndarray, epsilon: float, sensitivity: int) -> np.ndarray:
    """report_noisy_max's output distribution (float, for tests and audits: never released)."""
    counts = np.asarray(counts, dtype=np.float64)
    w = np.exp(float(_epsilon_below(epsilon)) * (counts - counts.max()) / (2 * sensitivity))
    return w / w.sum()


def check_noisy_max(epsilon: float) -> None:
    """ValueError unless a noisy max can be drawn at ``epsilon`` (checked before the charge)."""
    _epsilon_below(epsilon)


# --- smooth-sensitivity median ----------------------------------------------------------------


def sorted_values(counts: np.ndarray, grid: Grid) -> np.ndarray:
    """The bin representatives, each repeated by its count: the data as the grid sees it."""
    return np.repeat(grid.values(), np.asarray(counts, dtype=np.int64))


def smooth_sensitivity_median(
    values: np.ndarray, lower: float, upper: float, beta: float, max_values: int = 1
) -> float:
    """A β-smooth upper bound on the local sensitivity of the (lower) median of sorted
    ``values`` under adding or removing one unit's ≤ R values.

    S(x) = max_k e^(−kβ) (x_{m+2R(k+1)} − x_{m−2R(k+1)}), x_i = L below 1 and U above n. Why:
    a neighbour's sorted values satisfy x′_i ∈ [x_{i−R}, x_{i+R}] and its median position
    m′ ∈ [m − R, m + R], so the window of half-width 2R(k+1) bounds the local sensitivity of
    every dataset k units away, and the window of x at k is inside that of x′ at k + 1: the
    conditions of NRS 2007, Def. 2.1 / Lemma 2.3 for add/remove neighbours (their Prop. 3.4
    window is for a fixed n, where the median position does not move).
    """
    x = np.asarray(values, dtype=np.float64)
    n = x.size
    m = (n + 1) // 2  # 1-based median position
    padded = np.concatenate([[lower], x, [upper]])

    # max_k e^(−kβ)·(x_{m+w_k} − x_{m−w_k}), w_k = 2R(k+1), over k = 0 .. K where the window
    # first spans [L, U]: beyond K every term is e^(−kβ)(U − L), below the K-th. One numpy
    # pass of K + 1 <= n/(2R) + 1 terms, whatever β (a tiny ε does not lengthen it).
    last = max(0, -(-max(n + 1 - m, m) // (2 * max_values)) - 1)
    k = np.arange(last + 1, dtype=np.int64)
    w = 2 * max_values * (k + 1)
    high = padded[np.minimum(m + w, n + 1)]
    low = padded[np.maximum(m - w, 0)]
    terms = np.exp(-k * beta) * (high - low)
    return float(terms.max()) if terms.size else 0.0


@dataclass(frozen=True)
class SmoothMedian:
    """The median plus 6S/ε Cauchy noise: pure ε-DP (NRS 2007; :class:`SmoothCauchy`)."""

    grid: Grid
    epsilon: float
    max_values: int = 1

    name = "smooth_sensitivity_median"

    @property
    def cost(self) -> Cost:
        return Cost(epsilon=self.epsilon)

    def release(self, counts: np.ndarray, source: NoiseSource) -> float:
        counts = _check_counts(counts, self.grid)
        noise = SmoothCauchy(self.epsilon)
        x = sorted_values(counts, self.grid)
        lo, hi = self.grid.lower, self.grid.upper
        if self.grid.integer:
            hi = hi - 1.0
        s = smooth_sensitivity_median(x, lo, hi, noise.beta, self.max_values)
        median = float(x[(x.size + 1) // 2 - 1]) if x.size else (lo + hi) / 2
        noisy = median + float(noise.noise(source, s, 1)[0])
        # snapped to the representative of the public bin it falls in
        index = self.grid.bin_of(np.array([min(max(noisy, lo), hi)]))[0]
        return float(self.grid.values()[index])
