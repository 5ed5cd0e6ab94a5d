"""Rényi-DP accountant for the Poisson-subsampled Gaussian mechanism (DP-SGD).

One DP-SGD step adds N(0, (z·Δ)²) noise to a sum over a Poisson sample (rate q) of privacy
units, each contributing a vector of L2 norm <= Δ. Its RDP at order α is that of the pair
μ₀ = N(0, z²), μ₁ = (1 − q)·N(0, z²) + q·N(1, z²) (Mironov, Talwar, Zhang 2019, "Rényi
Differential Privacy of the Sampled Gaussian Mechanism", Thm. 4 and Sec. 3.3):

- integer α: A_α = Σₖ C(α, k) (1 − q)^(α−k) q^k exp((k² − k) / 2z²), exact;
- fractional α: the two convergent series of their Sec. 3.3 (as in TF-Privacy and Opacus),
  summed until the terms fall below e⁻³⁰ of the total;

and ε_RDP(α) = log A_α / (α − 1), composed additively over steps. RDP is converted to
(ε, δ) by the improved conversion of Balle, Barthe, Gaboardi, Hsu, Sato 2020 (Thm. 21; the
same bound is Canonne, Kamath, Steinke 2020, Prop. 12):

    ε = ε_RDP(α) + log((α − 1)/α) − (log δ + log α)/(α − 1),

minimised over the orders; the classic conversion ε_RDP(α) + log(1/δ)/(α − 1) (Mironov 2017,
Prop. 3) is kept to check against published values. Everything is a pure function of public
parameters (q, z, steps, δ), so EXPLAIN can show it and planning stays free.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache

import numpy as np
from scipy import special

#: Orders searched by default: Opacus' list plus powers of two up to 2¹⁶, so that small ε
#: (down to ≈ log(1/δ)/2¹⁶) can be certified at all.
DEFAULT_ORDERS: tuple[float, ...] = (
    tuple(1 + x / 10 for x in range(1, 100))
    + tuple(float(a) for a in range(12, 64))
    + tuple(float(2**k) for k in range(7, 17))
)


def _log_add(a: float, b: float) -> float:
    if a == -math.inf:
        return b
    if b == -math.inf:
        return a
    hi, lo = max(a, b), min(a, b)
    return hi + math.log1p(math.exp(lo - hi))


def _log_sub(a: float, b: float) -> float:
    """log(exp(a) − exp(b)) for a >= b."""
    if b == -math.inf:
        return a
    if b >= a:
        return -math.inf if b == a else math.nan
    return a + math.log(-math.expm1(b - a))


def _log_a_int(q: float, z: float, alpha: int) -> float:
    k = np.arange(alpha + 1, dtype=np.float64)
    log_binom = special.gammaln(alpha + 1) - special.gammaln(k + 1) - special.gammaln(alpha - k + 1)
    terms = log_binom + k * math.log(q) + (alpha - k) * math.log1p(-q) + (k * k - k) / (2 * z * z)
    return float(special.logsumexp(terms))


def _log_a_frac(q: float, z: float, alpha: float) -> float:
    """MTZ 2019 Sec. 3.3: A_α = A₀ + A₁, each an alternating-sign series in i."""
    log_a0 = log_a1 = -math.inf
    z0 = z * z * math.log(1 / q - 1) + 0.5
    i = 0
    while True:
        coef = special.binom(alpha, i)
        log_coef = math.log(abs(coef))
        j = alpha - i
        log_t0 = log_coef + i * math.log(q) + j * math.log1p(-q)
        log_t1 = log_coef + j * math.log(q) + i * math.log1p(-q)
        # 0.5·erfc((i − z0)/(√2 z)) = Φ((z0 − i)/z)
        log_e0 = float(special.log_ndtr((z0 - i) / z))
        log_e1 = float(special.log_ndtr((j - z0) / z))
        log_s0 = log_t0 + (i * i - i) / (2 * z * z) + log_e0
        log_s1 = log_t1 + (j * j - j) / (2 * z * z) + log_e1
        if coef > 0:
            log_a0 = _log_add(log_a0, log_s0)
            log_a1 = _log_add(log_a1, log_s1)
        else:
            log_a0 = _log_sub(log_a0, log_s0)
            log_a1 = _log_sub(log_a1, log_s1)
        i += 1
        if max(log_s0, log_s1) < -30:  # A_α >= 1 (Jensen), so this is relative too
            break
        if i > 100_000:  # pragma: no cover - the series converges long before
            raise ArithmeticError("the fractional-order RDP series did not converge")
    return _log_add(log_a0, log_a1)


def rdp_subsampled_gaussian(q: float, noise_multiplier: float, alpha: float) -> float:
    """ε_RDP(α) of one step of the Poisson-subsampled Gaussian (rate q, std z·Δ)."""
    z = noise_multiplier
    if not (0 <= q <= 1) or not z > 0 or not alpha > 1:
        raise ValueError("need 0 <= q <= 1, noise_multiplier > 0 and alpha > 1")
    if q == 0:
        return 0.0
    if math.isinf(alpha):
        return math.inf
    if q == 1:
        return alpha / (2 * z * z)
    if float(alpha).is_integer():
        log_a = _log_a_int(q, z, int(alpha))
    else:
        log_a = _log_a_frac(q, z, float(alpha))
    return max(0.0, log_a / (alpha - 1))


def compute_rdp(
    q: float, noise_multiplier: float, steps: int, orders: Sequence[float] = DEFAULT_ORDERS
) -> np.ndarray:
    """RDP of ``steps`` compositions at each order (additive composition, Mironov 2017)."""
    return np.array([steps * rdp_subsampled_gaussian(q, noise_multiplier, a) for a in orders])


def rdp_to_epsilon(
    orders: Sequence[float],
    rdp: Sequence[float] | np.ndarray,
    delta: float,
    *,
    improved: bool = True,
) -> tuple[float, float]:
    """(ε, best order) for the RDP curve at ``delta``; ``improved=False`` is the classic bound."""
    if not 0 < delta < 1:
        raise ValueError("delta must be in (0, 1)")
    a = np.asarray(orders, dtype=np.float64)
    r = np.asarray(rdp, dtype=np.float64)
    if improved:
        eps = r + np.log1p(-1 / a) - (math.log(delta) + np.log(a)) / (a - 1)
    else:
        eps = r + math.log(1 / delta) / (a - 1)
    eps = np.where(np.isnan(eps), np.inf, eps)
    best = int(np.argmin(eps))
    return max(0.0, float(eps[best])), float(a[best])


def dpsgd_epsilon(
    q: float,
    noise_multiplier: float,
    steps: int,
    delta: float,
    orders: Sequence[float] = DEFAULT_ORDERS,
) -> float:
    """ε of ``steps`` subsampled-Gaussian steps at ``delta`` (improved conversion)."""
    return rdp_to_epsilon(orders, compute_rdp(q, noise_multiplier, steps, orders), delta)[0]


def epsilon_floor(delta: float, orders: Sequence[float] = DEFAULT_ORDERS) -> float:
    """The smallest ε the conversion can certify at ``delta`` even with no RDP at all."""
    return rdp_to_epsilon(orders, np.zeros(len(orders)), delta)[0]


@lru_cache(maxsize=256)
def calibrate_noise_multiplier(
    epsilon: float, delta: float, q: float, steps: int, *, tolerance: float = 1e-4
) -> float:
    """Smallest noise multiplier z (to relative ``tolerance``) with ε(z) <= ``epsilon``.

    ε(z) decreases in z; we gallop to a bracket, bisect in log z and return the upper end, so
    the returned z always meets the target. Raises ValueError if no z up to 1e4 does.
    """
    if not (epsilon > 0 and math.isfinite(epsilon) and 0 < delta < 1):
        raise ValueError("need epsilon > 0 and 0 < delta < 1")
    if not (0 < q <= 1 and steps >= 1):
        raise ValueError("need 0 < q <= 1 and steps >= 1")

    if epsilon <= epsilon_floor(delta):
        raise ValueError("epsilon is too small for this delta: no noise multiplier reaches it")

    def ok(z: float) -> bool:
        return dpsgd_epsilon(q, z, steps, delta) <= epsilon

    hi = 1.0
    while not ok(hi):
        hi *= 2
        if hi > 1e4:
            raise ValueError("epsilon is too small for these steps: no noise multiplier up to 1e4")
    lo = hi / 2
    while lo > 1e-3 and ok(lo):
        hi, lo = lo, lo / 2
    # Bisect on the orders between the best ones at the bracket's ends (the best order grows
    # with z). Fewer orders can only raise the ε bound, so a z accepted on them is accepted on
    # all orders too: the result always meets the target.
    ends = [rdp_to_epsilon(DEFAULT_ORDERS, compute_rdp(q, z, steps), delta)[1] for z in (lo, hi)]
    first, last = sorted(DEFAULT_ORDERS.index(a) for a in ends)
    near = DEFAULT_ORDERS[max(0, first - 3) : last + 4]
    while hi - lo > tolerance * hi:
        mid = math.sqrt(lo * hi)
        if dpsgd_epsilon(q, mid, steps, delta, near) <= epsilon:
            hi = mid
        else:
            lo = mid
    return hi
