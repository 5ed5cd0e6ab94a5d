"""Calibrated additive-noise mechanisms: one object knows its scale, cost, intervals and τ.

All quantities are in noise units (integers). A mechanism is built from a sensitivity and a
privacy parameter, and is the single place where scale, privacy cost, the 95% interval and
the thresholding τ are derived, so they can never disagree. Intervals and τ are computed from
the pmf of the *discrete* noise actually drawn, at the exact parameter the sampler realises
(:func:`dpsql.privacy.samplers.laplace_scale`, :func:`~dpsql.privacy.samplers.gaussian_sigma2`),
which is never smaller than the requested one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache

import numpy as np
from scipy import special

from dpsql.privacy.accounting import Cost
from dpsql.privacy.samplers import NoiseSource, gaussian_sigma2, laplace_scale

# --- analytic Gaussian (Balle & Wang 2018) ---------------------------------------------------


def gaussian_delta(sigma: float, l2: float, epsilon: float) -> float:
    """The exact δ(ε) of N(0, σ²) noise on an L2-sensitivity-``l2`` query (Balle & Wang 2018,
    Theorem 8): Φ(Δ/2σ − εσ/Δ) − e^ε Φ(−Δ/2σ − εσ/Δ), evaluated in log space."""
    a = l2 / (2 * sigma)
    b = epsilon * sigma / l2
    first = special.log_ndtr(a - b)
    second = epsilon + special.log_ndtr(-a - b)
    if second >= first:
        return 0.0
    return float(math.exp(first) * -math.expm1(second - first))


@lru_cache(maxsize=1024)
def analytic_gaussian_sigma(l2: float, epsilon: float, delta: float) -> float:
    """Smallest σ for which N(0, σ²) noise on an L2-sensitivity-``l2`` query is (ε, δ)-DP.

    Balle & Wang (2018), Theorem 8 is an exact characterisation, valid for every ε > 0 (unlike
    σ = Δ √(2 ln(1.25/δ)) / ε, which needs ε < 1). δ(σ) decreases in σ; we bisect in log σ
    and return the upper end of the final bracket, so δ(σ) <= δ always holds (relative
    precision 1e-12).
    """
    if l2 <= 0:
        return 0.0
    if not (epsilon > 0 and math.isfinite(epsilon) and 0 < delta < 1):
        raise ValueError("the Gaussian mechanism needs epsilon > 0 and 0 < delta < 1")
    lo = hi = float(l2)
    while gaussian_delta(hi, l2, epsilon) > delta:
        hi *= 2
    while lo > 1e-300 and gaussian_delta(lo, l2, epsilon) <= delta:
        lo /= 2
    while hi - lo > 1e-12 * hi:
        mid = math.sqrt(lo * hi) if hi > 2 * lo else 0.5 * (lo + hi)
        if gaussian_delta(mid, l2, epsilon) <= delta:
            hi = mid
        else:
            lo = mid
    return hi


def classical_gaussian_sigma(l2: float, epsilon: float, delta: float) -> float:
    """Δ √(2 ln(1.25/δ)) / ε (Dwork & Roth 2014, Thm A.1): for comparison only, valid for ε < 1."""
    return l2 * math.sqrt(2 * math.log(1.25 / delta)) / epsilon


def zcdp_rho(epsilon: float, delta: float) -> float:
    """The largest ρ that :func:`dpsql.privacy.accounting.rho_to_epsilon` turns into (ε, δ):
    ρ + 2√(ρ L) = ε with L = ln(1/δ) gives ρ = (√(L + ε) − √L)².

    For a Gaussian whose *charge* must fit an (ε, δ) share: σ = Δ₂ / √(2ρ). That σ is larger
    than the analytic one for the same (ε, δ) (5.35 vs 4.22 at ε = 1, δ = 1e-6, Δ₂ = 1), because
    the zCDP conversion is loose for one release and tight only when many compose.
    """
    if not (epsilon > 0 and 0 < delta < 1):
        raise ValueError("zcdp_rho needs epsilon > 0 and 0 < delta < 1")
    log_term = math.log(1 / delta)
    return (math.sqrt(log_term + epsilon) - math.sqrt(log_term)) ** 2


# --- tails of the discrete noise ------------------------------------------------------------


def discrete_laplace_tail(scale: float, m: int) -> float:
    """P(X >= m) for X with P(k) ∝ exp(-|k|/r), r the scale the sampler realises for ``scale``.

    With q = e^(-1/r): P(X >= m) = q^m / (1 + q) for m >= 0, and 1 − P(X >= 1 − m) otherwise.
    """
    log_q = -1.0 / float(laplace_scale(scale))
    if m < 0:
        return 1.0 - discrete_laplace_tail(scale, 1 - m)
    return math.exp(m * log_q - math.log1p(math.exp(log_q)))


def discrete_gaussian_tail(sigma: float, m: int) -> float:
    """P(X >= m) for X with P(k) ∝ exp(-k²/2σ²), σ² the variance the sampler realises.

    Summed directly for σ <= 5000; beyond, ∑_{k>=m} f(k) by Euler–Maclaurin
    (∫_m^∞ f + f(m)/2 − f'(m)/12, next term O(σ^-3) relative) and Z = σ√(2π) (Poisson
    summation, error e^(-2π²σ²)).
    """
    s2 = float(gaussian_sigma2(sigma))
    if m <= 0:
        return 1.0 - discrete_gaussian_tail(sigma, 1 - m)
    sd = math.sqrt(s2)
    if sd <= 5000:
        width = math.ceil(40 * sd) + 2
        j = np.arange(0, width, dtype=np.float64)
        # ∑_{k>=m} e^(-k²/2σ²) = e^(-m²/2σ²) ∑_{j>=0} e^(-(2mj + j²)/2σ²)
        rest = float(np.exp(-(2 * m * j + j * j) / (2 * s2)).sum())
        k = np.arange(1, width, dtype=np.float64)
        z = 1.0 + 2.0 * float(np.exp(-(k * k) / (2 * s2)).sum())
        return math.exp(-(m * m) / (2 * s2)) * rest / z
    f_m = math.exp(-(m * m) / (2 * s2))
    integral = sd * math.sqrt(math.pi / 2) * float(special.erfc(m / (sd * math.sqrt(2))))
    total = integral + f_m / 2 + (m / s2) * f_m / 12
    return total / (sd * math.sqrt(2 * math.pi))


@lru_cache(maxsize=4096)
def _cached_search(mech: Mechanism, kind: str, target: float) -> int:
    """Smallest m with P(X >= m) <= target for ``mech``'s noise: a function of public
    parameters only, cached because the discrete Gaussian's tail sums cost up to ~1 ms."""
    return smallest_m(mech._tail, target, mech._guess(kind, target))


def smallest_m(tail: Callable[[int], float], target: float, guess: int) -> int:
    """Smallest integer m with tail(m) <= target, for a non-increasing ``tail``.

    Gallops from ``guess`` (steps 1, 2, 4, ...) to bracket the answer, then bisects: a few
    calls when the guess is close, O(log) when it is far (a huge noise scale, where stepping
    by one never finished and let a free EXPLAIN pin a thread).
    """
    step = 1
    if tail(guess) > target:
        low = guess  # tail(low) > target
        while tail(low + step) > target:
            low += step
            step = _doubled(step)
        high = low + step
    else:
        high = guess  # tail(high) <= target
        while tail(high - step) <= target:
            high -= step
            step = _doubled(step)
        low = high - step
    while high - low > 1:
        middle = (low + high) // 2
        if tail(middle) > target:
            low = middle
        else:
            high = middle
    return high


def _doubled(step: int) -> int:
    if step > 1 << 1000:  # past any float: the tail cannot be evaluated there
        raise ValueError("the noise scale is too large to compute its intervals")
    return step * 2


# --- fixed-point release -------------------------------------------------------------------


def release_fixed_point(exact: np.ndarray, noise: np.ndarray, granularity: float) -> np.ndarray:
    """(exact + noise) · granularity: the released float is a function of the noisy *integer*
    alone, so it carries nothing about the exact value beyond what the DP integer does.

    The sum is taken in int64 (overflow is an error, not a wrap-around); the product is one
    correctly rounded IEEE multiplication of that integer by ``granularity``, so each result is
    the double nearest to k·granularity — exactly k·granularity when ``granularity`` is a power
    of two (see :func:`lattice_granularity`). Floating-point noise is never added to a float
    (Mironov 2012).
    """
    if not (math.isfinite(granularity) and granularity > 0):
        raise ValueError(f"granularity must be a finite number > 0, got {granularity!r}")
    exact = np.asarray(exact)
    noise = np.asarray(noise)
    if exact.dtype.kind not in "iu" or noise.dtype.kind not in "iu":
        raise TypeError("release_fixed_point adds integer noise to integer aggregates only")
    exact = exact.astype(np.int64)
    noise = noise.astype(np.int64)
    limit = 1 << 53  # every |k| <= 2^53 is an exact double
    if exact.size and (np.abs(exact).max() > limit or np.abs(noise).max() > limit):
        raise OverflowError("fixed-point aggregate exceeds 2^53 units; use a coarser granularity")
    k = exact + noise
    if k.size and np.abs(k).max() > limit:
        raise OverflowError("fixed-point aggregate exceeds 2^53 units; use a coarser granularity")
    return k.astype(np.float64) * float(granularity)


def lattice_granularity(desired: float) -> float:
    """The largest power of two <= ``desired``: a granularity on whose lattice every released
    value k·g (|k| <= 2^53) is represented exactly."""
    if not (math.isfinite(desired) and desired > 0):
        raise ValueError(f"granularity must be a finite number > 0, got {desired!r}")
    _, exponent = math.frexp(desired)  # desired = m · 2^exponent with 0.5 <= m < 1
    return math.ldexp(1.0, exponent - 1)


# --- mechanisms -----------------------------------------------------------------------------


def _check(name: str, value: float, *, positive: bool) -> None:
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise ValueError(f"{name} must be a finite number {'>' if positive else '>='} 0")


class _Tails:
    """What every additive noise derives from its tail P(X >= m) (``_tail``, symmetric) and a
    starting guess (``_guess``): the interval and the thresholding τ, so a mechanism states
    only its distribution. ``_silent``: the noise is identically 0 (zero sensitivity)."""

    def _tail(self, m: int) -> float:
        raise NotImplementedError

    def _guess(self, kind: str, target: float) -> int:
        raise NotImplementedError

    @property
    def _silent(self) -> bool:
        raise NotImplementedError

    def interval_halfwidth(self, confidence: float = 0.95) -> float:
        """Smallest integer h with P(|X| <= h) >= confidence, i.e. 2 P(X >= h+1) <= 1 − c."""
        if not 0 < confidence < 1:
            raise ValueError("confidence must be in (0, 1)")
        if self._silent:
            return 0.0
        return float(_cached_search(self, "interval", (1 - confidence) / 2) - 1)  # type: ignore[arg-type]

    def threshold(self, delta: float, max_groups: int) -> float:
        """Smallest integer τ with P(1 + X >= τ) <= δ / max_groups.

        A key is released when its noisy unit count is >= τ. A key held by a single unit has
        count 1, and one unit can create at most ``max_groups`` keys, so by a union bound the
        keys it alone creates appear with probability <= δ.
        """
        if not (0 < delta < 1) or max_groups < 1:
            raise ValueError("thresholding needs 0 < delta < 1 and max_groups >= 1")
        target = delta / max_groups
        if self._silent:
            return 2.0
        return float(1 + _cached_search(self, "threshold", target))  # type: ignore[arg-type]


@dataclass(frozen=True)
class _PureEpsilon(_Tails):
    """An additive noise calibrated to an L1 sensitivity Δ1 at pure ε (its nominal scale Δ1/ε,
    its charge ε): what the Laplace and the staircase share."""

    l1: float
    epsilon: float

    def __post_init__(self) -> None:
        _check("l1", self.l1, positive=False)
        _check("epsilon", self.epsilon, positive=True)

    @property
    def _silent(self) -> bool:
        return self.l1 == 0

    @property
    def scale(self) -> float:
        return self.l1 / self.epsilon

    @property
    def cost(self) -> Cost:
        return _epsilon_cost(self.epsilon)


@dataclass(frozen=True)
class Laplace(_PureEpsilon):
    """Discrete Laplace noise with scale Δ1/ε: pure ε-DP for integer queries of L1
    sensitivity Δ1 (P(k)/P(k+Δ1) <= e^ε). The sampler's scale is >= Δ1/ε, never smaller."""

    name = "laplace"

    @property
    def variance(self) -> float:
        """About 2b² (the continuous Laplace's; the discrete one's 2q/(1 − q)² is within
        1/(6b²) relative of it)."""
        return 2.0 * self.scale**2

    @property
    def expected_abs(self) -> float:
        """E|X| of the noise drawn: 2q/(1 − q²), q = e^(-1/r) at the realised scale r."""
        if self._silent:
            return 0.0
        q = math.exp(-1.0 / float(laplace_scale(self.scale)))
        return 2.0 * q / (-math.expm1(-2.0 / float(laplace_scale(self.scale))))

    def approximate(self, rng: np.random.Generator, size: int) -> np.ndarray:
        """Fast non-cryptographic draws of (nearly) this noise, for error bars only: the
        difference of two geometrics at the nominal scale."""
        if self.scale == 0:
            return np.zeros(size)
        # 1 − e^(−1/b) as −expm1(−1/b): at a scale above ~9e15 (a drawable one) 1 − exp(...)
        # rounds to 0 and rng.geometric(0) would fail after the charge
        p = -math.expm1(-1.0 / self.scale)
        return (rng.geometric(p, size) - rng.geometric(p, size)).astype(float)

    def privacy_map(self, l1: float, l2: float, groups: int = 1) -> Cost:
        """What this noise costs on an integer query of L1 sensitivity ``l1`` (``l2`` and
        ``groups`` are not read: it holds for any vector of that L1): ε = l1 / b for the
        sampler's scale b, since P(k) / P(k + l1) <= exp(l1 / b).
        Computed from the scale the sampler uses, not from the ε it was calibrated to, so a
        calibration to a smaller sensitivity shows as a larger cost. No noise at all (b = 0)
        on a query that can change costs ε = ∞."""
        if l1 == 0:
            return Cost()
        if self.scale == 0:
            return Cost(epsilon=math.inf)
        return _laplace_loss(l1, self.scale)

    def sample(self, source: NoiseSource, size: int) -> np.ndarray:
        if self.l1 == 0:
            return np.zeros(size, dtype=np.int64)
        return source.discrete_laplace(self.scale, size)

    def _tail(self, m: int) -> float:
        if self.l1 == 0:
            return 1.0 if m <= 0 else 0.0
        return discrete_laplace_tail(self.scale, m)

    def _guess(self, kind: str, target: float) -> int:
        """m with q^m/(1+q) ≈ target, q = e^(-1/r): the exact search then moves a step or two."""
        r = float(laplace_scale(self.scale))
        return max(0, math.ceil(r * (-math.log(target) - math.log1p(math.exp(-1 / r)))))


# Costs are immutable and exact: each is computed once per (ε) or (Δ1, scale), as the
# policy's few sensitivities and shares repeat across queries (a Cost's exact ρ-view of a
# long float is a normalisation of ~200-bit integers).
@lru_cache(maxsize=4096)
def _epsilon_cost(epsilon: float) -> Cost:
    return Cost(epsilon=epsilon)


@lru_cache(maxsize=4096)
def _laplace_loss(l1: float, scale: float) -> Cost:
    return Cost(epsilon=Fraction(l1) / Fraction(scale))


@dataclass(frozen=True)
class Gaussian(_Tails):
    """Discrete Gaussian noise, σ from the analytic Gaussian mechanism; charged as ρ-zCDP.

    ρ = Δ2²/(2σ²) holds for the discrete Gaussian on integer queries (Canonne, Kamath &
    Steinke 2020, Thm 4); the sampler's σ² is >= the requested σ², so ρ is an upper bound.
    """

    l2: float
    epsilon: float
    delta: float

    name = "gaussian"

    def __post_init__(self) -> None:
        _check("l2", self.l2, positive=False)
        _check("epsilon", self.epsilon, positive=True)
        if not 0 < self.delta < 1:
            raise ValueError("delta must be in (0, 1)")

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

    def privacy_map(self, l1: float, l2: float, groups: int = 1) -> Cost:
        """What this noise costs on an integer query of L2 sensitivity ``l2`` (``l1`` and
        ``groups`` are not read): ρ = l2² / (2σ²) for the sampler's σ (Canonne, Kamath &
        Steinke 2020, Thm 4); no noise on a query that can change costs ρ = ∞."""
        if l2 == 0:
            return Cost()
        sigma = self.scale if self.l2 > 0 else 0.0
        if sigma == 0:
            return Cost(rho=math.inf)
        return Cost(rho=l2**2 / (2 * sigma**2))

    def sample(self, source: NoiseSource, size: int) -> np.ndarray:
        if self.l2 == 0:
            return np.zeros(size, dtype=np.int64)
        return source.discrete_gaussian(self.scale, size)

    @property
    def _silent(self) -> bool:
        return self.l2 == 0

    @property
    def variance(self) -> float:
        """σ² (the discrete Gaussian's is within e^(-2π²σ²) relative of it)."""
        return self.scale**2

    @property
    def expected_abs(self) -> float:
        return math.sqrt(2.0 / math.pi) * self.scale if not self._silent else 0.0

    def approximate(self, rng: np.random.Generator, size: int) -> np.ndarray:
        """Fast non-cryptographic draws of (nearly) this noise, for error bars only."""
        if self.scale == 0:
            return np.zeros(size)
        return np.rint(rng.normal(0.0, self.scale, size))

    def _tail(self, m: int) -> float:
        if self.l2 == 0:
            return 1.0 if m <= 0 else 0.0
        return discrete_gaussian_tail(self.scale, m)

    def _guess(self, kind: str, target: float) -> int:
        """Where the exact search starts: the continuous Gaussian's quantile (interval: one
        step further out, as the tail sum starts at m)."""
        sd = math.sqrt(float(gaussian_sigma2(self.scale)))
        if kind == "interval":
            return math.ceil(sd * float(special.ndtri(1 - target))) + 1
        return max(1, math.ceil(sd * float(-special.ndtri(target))))


# --- the staircase (Geng & Viswanath 2016), on the integers -----------------------------------


def staircase_weight(epsilon: float, period: int, step: int, m: int) -> float:
    """The unnormalised pmf f(m) of the discrete staircase: e^(-jε) for |m| in [jD, jD + g),
    e^(-(j+1)ε) for |m| in [jD + g, (j+1)D) (D = ``period``, g = ``step``)."""
    j, r = divmod(abs(m), period)
    return math.exp(-(j + (0 if r < step else 1)) * epsilon)


def _staircase_sums(epsilon: float, period: int, step: int) -> tuple[float, float, float, float]:
    """(Z, Σ_{a>=0} a f(a), Σ_{a>=0} a² f(a), S_w) in closed form: with q = e^(-ε) and
    a = jD + r, f(a) = q^j w(r), w(r) = 1 for r < g, q otherwise, so the half-line sums are
    geometric series in j times sums over one period (S_w = Σ w, R1 = Σ r w, R2 = Σ r² w);
    Z = 2 Σ_{a>=0} f(a) − f(0) counts 0 once."""
    d, g = period, step
    q = math.exp(-epsilon)
    one_q = -math.expm1(-epsilon)

    def s1(n: int) -> float:  # Σ_{r<n} r
        return n * (n - 1) / 2

    def s2(n: int) -> float:  # Σ_{r<n} r²
        return (n - 1) * n * (2 * n - 1) / 6

    s_w = g + (d - g) * q
    r1 = s1(g) + q * (s1(d) - s1(g))
    r2 = s2(g) + q * (s2(d) - s2(g))
    g0, g1, g2 = 1 / one_q, q / one_q**2, q * (1 + q) / one_q**3
    h0 = s_w * g0
    h1 = d * s_w * g1 + r1 * g0
    h2 = d * d * s_w * g2 + 2 * d * r1 * g1 + r2 * g0
    return 2 * h0 - (1.0 if g >= 1 else q), h1, h2, s_w


def staircase_expected_abs(epsilon: float, period: int, step: int) -> float:
    """E|X| of the discrete staircase, exactly (up to float rounding)."""
    z, h1, _, _ = _staircase_sums(epsilon, period, step)
    return 2 * h1 / z


@lru_cache(maxsize=1024)
def staircase_step(epsilon: float, period: int) -> int:
    """The step g of least E|X| for the period D at ε. The continuous staircase's optimum is
    γD, γ = 1/(1 + e^(ε/2)) (Geng & Viswanath 2016, Thm 3); on the integers E|X| is computed
    in closed form for the integers within 3 of γD and the least taken (ties: the smaller g).
    Any g in [0, D] is ε-DP (see :class:`Staircase`): g only moves E|X|."""
    half = math.exp(-epsilon / 2)  # γ = e^(-ε/2) / (1 + e^(-ε/2)): no overflow at large ε
    centre = round(period * half / (1 + half))
    # g >= 1: g = 0 only lowers f(0) to its neighbours' q (a larger E|X|), and at a large ε
    # (q = 0 in floats) its normaliser would be 0
    candidates = range(max(1, centre - 3), max(1, min(period, centre + 3)) + 1)
    return min(candidates, key=lambda g: (staircase_expected_abs(epsilon, period, g), g))


def staircase_tail(epsilon: float, period: int, step: int, m: int) -> float:
    """P(X >= m) for the discrete staircase, in closed form: for m >= 1 with m = j₀D + r₀,
    the rest of period j₀ (q^j₀ (max(0, g − r₀) + q (D − max(g, r₀)))) plus the periods
    after it (q^(j₀+1) S_w / (1 − q)), over Z; for m <= 0, 1 − P(X >= 1 − m) by symmetry."""
    if m <= 0:
        return 1.0 - staircase_tail(epsilon, period, step, 1 - m)
    z, _, _, s_w = _staircase_sums(epsilon, period, step)
    j, r = divmod(m, period)
    log_qj = -j * epsilon
    if log_qj < -745.0:  # beyond the smallest double
        return 0.0
    qj = math.exp(log_qj)
    q = math.exp(-epsilon)
    rest = qj * (max(0, step - r) + q * (period - max(step, r)))
    after = qj * q * s_w / -math.expm1(-epsilon)
    return (rest + after) / z


@dataclass(frozen=True)
class Staircase(_PureEpsilon):
    """Discrete staircase noise (Geng & Viswanath 2016): pure ε-DP for integer queries of L1
    sensitivity Δ1, with the least E|noise| among ε-DP additive noises for large Δ1 (0.9595 of
    the Laplace's Δ1/ε at ε = 1, 0.92 at ε = 2). The period is D = ⌈Δ1⌉ integer units, the
    step g = :func:`staircase_step` (ε, D); the pmf on ℤ is

        f(m) ∝ e^(-jε)       for |m| in [jD, jD + g)
        f(m) ∝ e^(-(j+1)ε)   for |m| in [jD + g, (j+1)D),        j = 0, 1, 2, ...

    *Proof of ε-DP* (any integer g in [0, D]): f depends on |m| only, is non-increasing in
    |m| (within a period it steps down once by e^(-ε), and the next period starts at
    e^(-(j+1)ε), the value it ended at), and f(|m| + D) = e^(-ε) f(|m|) (the same position one
    period on). For integers m and d with |d| <= D: if |m + d| >= |m|, then
    |m + d| <= |m| + D, so f(m + d) >= f(|m| + D) = e^(-ε) f(m); otherwise f(m + d) >= f(m).
    Either way f(m) / f(m + d) <= e^ε, so two neighbouring integer aggregates (they differ by
    at most ⌊Δ1⌋ <= D) give output distributions within e^ε of each other. The sampler
    realises ε exactly (the float's own rational) and draws exactly on the integers
    (dpsql.privacy.samplers.NoiseSource.discrete_staircase), so nothing rounds this bound.

    ``scale`` is Δ1/ε, the Laplace's at the same charge, for EXPLAIN's "scale" column; the
    interval comes from the staircase's own CDF (:func:`staircase_tail`)."""

    name = "staircase"

    @property
    def period(self) -> int:
        """D = ⌈Δ1⌉ integer units: an integer aggregate moves by at most ⌊Δ1⌋ <= D."""
        return math.ceil(self.l1)

    @property
    def step(self) -> int:
        return staircase_step(self.epsilon, self.period) if self.period else 0

    @property
    def variance(self) -> float:
        if self._silent:
            return 0.0
        z, _, h2, _ = _staircase_sums(self.epsilon, self.period, self.step)
        return 2 * h2 / z

    @property
    def expected_abs(self) -> float:
        if self._silent:
            return 0.0
        return staircase_expected_abs(self.epsilon, self.period, self.step)

    def privacy_map(self, l1: float, l2: float, groups: int = 1) -> Cost:
        """What this noise, drawn independently per group, costs on integer aggregates one
        unit moves by at most ``l1`` in L1 over at most ``groups`` groups (``l2`` is not
        read). Unlike the Laplace's, the staircase's loss is not linear in the change: a
        coordinate moved by d costs up to ε·⌈|d|/D⌉ (f(m)/f(m + d) <= e^(kε) for |d| <= kD:
        k steps of at most D, each within e^ε), even for |d| = 1. With L = ⌊l1⌋ (integers)
        spread over k <= min(groups, L) coordinates, Σ⌈d_i/D⌉ = Σ(⌊(d_i − 1)/D⌋ + 1) <=
        k + ⌊(L − k)/D⌋, largest at k = min(groups, L): so ε·(k + ⌊(L − k)/D⌋). One group
        (an ungrouped query, or G = 1) moved by <= D costs ε; a plan that put the staircase
        on G > 1 groups at period G·p shows G·ε, and the plan check refuses it. No noise
        (D = 0) on a query that can change costs ε = ∞."""
        whole = math.floor(l1)
        if whole == 0:
            return Cost()
        if self.period == 0:
            return Cost(epsilon=math.inf)
        k = min(max(groups, 1), whole)
        return _epsilon_cost(self.epsilon * (k + (whole - k) // self.period))

    def sample(self, source: NoiseSource, size: int) -> np.ndarray:
        if self.period == 0:
            return np.zeros(size, dtype=np.int64)
        return source.discrete_staircase(self.epsilon, self.period, self.step, size)

    def approximate(self, rng: np.random.Generator, size: int) -> np.ndarray:
        """Fast non-cryptographic draws of this noise, for error bars only: the exact
        algorithm's steps on numpy's generator (j geometric, the position's half chosen by
        its mass, a sign; (-, 0) redrawn)."""
        if self._silent:
            return np.zeros(size)
        d, g, eps = self.period, self.step, self.epsilon
        inner = g / (g + (d - g) * math.exp(-eps))
        out = np.empty(size)
        todo = np.arange(size)
        while todo.size:
            n = todo.size
            j = rng.geometric(-math.expm1(-eps), n) - 1
            low = rng.random(n) < inner
            r = np.where(low, rng.integers(0, max(g, 1), n), rng.integers(min(g, d - 1), d, n))
            y = j.astype(float) * d + r
            negative = rng.random(n) < 0.5
            out[todo] = np.where(negative, -y, y)
            todo = todo[negative & (y == 0)]
        return out

    def _tail(self, m: int) -> float:
        if self._silent:
            return 1.0 if m <= 0 else 0.0
        return staircase_tail(self.epsilon, self.period, self.step, m)

    def _guess(self, kind: str, target: float) -> int:
        """The Laplace's quantile at the same scale: the staircase's tail is within a factor
        e^ε of it, so the search moves a few doublings at most."""
        return max(1, math.ceil(self.scale * -math.log(2 * target)))

    def describe(self) -> str:
        """EXPLAIN's words for the noise's shape."""
        return f"staircase noise (period {self.period}, step {self.step})"


def quieter_sum_noise(l1: float, epsilon: float) -> Laplace | Staircase:
    """The pure-ε noise of least E|X| for an integer query of L1 sensitivity ``l1`` at
    ``epsilon``, both charging ε: the staircase where it is strictly quieter (large Δ1), the
    discrete Laplace otherwise (Δ1 of a few units, where the two nearly coincide)."""
    laplace = Laplace(l1=l1, epsilon=epsilon)
    staircase = Staircase(l1=l1, epsilon=epsilon)
    try:
        ours, theirs = staircase.expected_abs, laplace.expected_abs
    except (ArithmeticError, ValueError):  # the closed forms out of float range: keep Laplace
        return laplace
    quieter = math.isfinite(ours) and ours < theirs * (1 - 1e-9)  # not a float tie
    return staircase if quieter else laplace


Mechanism = Laplace | Gaussian | Staircase


# Relative margin kept below δ/G by the fitted keep probability: covers the float error of
# the tail sums (~1e-15 relative) and of the keep draw (a 53-bit uniform: P(u < p) <= p + 2^-53).
_BELOW_MARGIN = 1e-9


def threshold_below(mech: Mechanism, tau: float, delta: float, max_groups: int) -> float:
    """The probability p of keeping a key whose noisy unit count is τ − 1 exactly, so that the
    threshold spends all of its δ instead of what the integer τ happens to spend.

    τ is the smallest integer with P(1 + X >= τ) <= δ/G (:meth:`Laplace.threshold`). A key held
    by one unit alone (exact count 1) is then released with probability

        P(1 + X >= τ) + p · P(1 + X = τ − 1)  =  δ/G · (1 − 1e-9)        (p in [0, 1))

    and by the union bound over the <= G keys one unit creates, with probability <= δ: the
    same (ε, δ) as the integer threshold (whose own tail is often well below δ/G: 4.5e-6 of
    δ = 1e-5 at ε = 1, R = G = 1). Keys present in both neighbours are released as a function
    of their ε-DP noisy count and an independent coin: post-processing. p < 1 because τ − 1
    fails the threshold's test (P(1 + X >= τ − 1) > δ/G)."""
    if not (0 < delta < 1) or max_groups < 1:
        raise ValueError("thresholding needs 0 < delta < 1 and max_groups >= 1")
    target = delta / max_groups * (1 - _BELOW_MARGIN)
    m = int(tau) - 1  # P(1 + X >= τ) = P(X >= m)
    above = mech._tail(m)
    at = mech._tail(m - 1) - above  # P(X = m − 1) = P(1 + X = τ − 1)
    if at <= 0 or above >= target:
        return 0.0
    return min(max((target - above) / at, 0.0), 1.0 - 2.0**-30)
