"""Noise sources: where the random integers added to exact aggregates come from.

Every release draws through a :class:`NoiseSource`; the pipeline never touches a random
generator directly, so the exact CSPRNG samplers, a seeded source for statistical tests and
the "no noise" test hook are interchangeable.

Scales are in *noise units*: aggregates are integers (counts, or sums in fixed point at the
plan's granularity), so the integer samplers return int64 arrays.

Exactness. ``discrete_laplace`` and ``discrete_gaussian`` are Algorithms 1-3 of Canonne, Kamath
and Steinke, "The Discrete Gaussian for Differential Privacy" (NeurIPS 2020): the parameter is a
rational, every decision is a Bernoulli with a rational or exp(-rational) probability, and each
Bernoulli(n/d) is decided by comparing n/d with a uniform real drawn lazily, one random byte
(base-256 digit) at a time, in integer arithmetic. Given uniform random bytes the output
distribution is exactly the stated pmf — no floating point is involved. Vectorisation changes
only the order in which independent draws are made. Draws from rejected proposals are discarded
by position, never by value, so accepted outputs stay i.i.d. Calls for at most ``_SCALAR_MAX``
draws (one query's noise) run the same algorithms one draw at a time in Python integers, on
bytes fetched in chunks for that call only: ~5-10 us per draw instead of ~300 us of numpy
overhead per call.

Realised parameters. A float ``scale``/``sigma`` is first converted to the exact rational that is
sampled: :func:`laplace_scale` and :func:`gaussian_sigma2` round *up* (never down, so the privacy
guarantee computed from the requested float still holds) to a rational with a bounded
denominator; the relative increase is below 2**-31 (Laplace scale >= 2**-10) and 2**-23
(Gaussian σ², σ >= 1).
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable
from fractions import Fraction
from functools import lru_cache
from typing import Protocol

import numpy as np
from scipy import special

RandomBytes = Callable[[int], bytes]

# Integers handled in int64 arithmetic must satisfy den < 2**_DEN_BITS so that `num << 8` with
# num <= den stays below 2**63; larger ones fall back to Python integers (object arrays).
_DEN_BITS = 54
_PRECISION_BITS = 20  # minimum precision of the realised Laplace scale
_GROUPED = 32  # parameters taking <= this many values are sampled value by value (tables)
_GAUSS_BITS = 24  # σ²/t is realised as a/q with a ≈ 2**24: relative rounding <= 2**-24


class NoiseSource(Protocol):
    """Draws integer noise. ``scale``/``sigma`` are floats > 0; ``size`` >= 0."""

    def discrete_laplace(self, scale: float, size: int) -> np.ndarray:
        """i.i.d. draws with P(k) ∝ exp(-|k| / scale), k ∈ ℤ."""
        ...

    def discrete_gaussian(self, sigma: float, size: int) -> np.ndarray:
        """i.i.d. draws with P(k) ∝ exp(-k² / (2 σ²)), k ∈ ℤ."""
        ...

    def discrete_staircase(self, epsilon: float, period: int, step: int, size: int) -> np.ndarray:
        """i.i.d. draws with P(k) ∝ e^(-jε) for |k| in [jD, jD + g) and e^(-(j+1)ε) for |k|
        in [jD + g, (j+1)D), j >= 0, D = ``period``, g = ``step`` (the discrete staircase:
        dpsql.privacy.mechanisms.Staircase)."""
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

    def discrete_staircase(self, epsilon: float, period: int, step: int, size: int) -> np.ndarray:
        return np.zeros(size, dtype=np.int64)

    def uniform(self, size: int) -> np.ndarray:
        return np.zeros(size, dtype=np.float64)

    def laplace(self, scale: float, size: int) -> np.ndarray:
        return np.zeros(size, dtype=np.float64)

    def gaussian(self, sigma: float, size: int) -> np.ndarray:
        return np.zeros(size, dtype=np.float64)

    def cauchy(self, size: int) -> np.ndarray:
        return np.zeros(size, dtype=np.float64)

    def gumbel(self, scale: float, size: int) -> np.ndarray:
        return np.zeros(size, dtype=np.float64)


# --- realised parameters ---------------------------------------------------------------------


def _check_positive(name: str, value: float) -> Fraction:
    if not (isinstance(value, int | float | np.floating | np.integer) and math.isfinite(value)):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    return Fraction(float(value))


def _round_up(x: Fraction, max_den: int) -> Fraction:
    """A rational >= x with denominator <= max_den, within 1/max_den of x (usually much closer)."""
    if x.denominator <= max_den:
        return x
    near = x.limit_denominator(max_den)
    return near if near >= x else Fraction(math.ceil(x * max_den), max_den)


@lru_cache(maxsize=1024)
def laplace_scale(scale: float) -> Fraction:
    """The exact scale t/s that ``discrete_laplace(scale, ·)`` realises.

    The float's exact value when its denominator is <= N, N = max(2**20, ⌊2**32 / scale⌋);
    otherwise :meth:`Fraction.limit_denominator` (N) if that lies above ``scale``, else
    ⌈scale·N⌉/N. Always >= ``scale``, with relative excess below 2**-31 for scales in
    [2**-10, 2**50] (the numerator t stays near 2**32, which keeps the uniform draws short).
    """
    x = _check_positive("scale", scale)
    return _round_up(x, max(1 << _PRECISION_BITS, math.floor((1 << 32) / x)))


@lru_cache(maxsize=1024)
def _gaussian_params(sigma: float) -> tuple[int, int, int]:
    """(t, a, q) with t = ⌊σ⌋ + 1 and realised σ² = t·a/q >= σ², q a power of two.

    Writing σ²/t = a/q keeps every quantity of the rejection step an integer of moderate size:
    γ = (|Y| − σ²/t)² / (2σ²) = (q|Y| − a)² / (2taq).
    """
    s2 = _check_positive("sigma", sigma) ** 2
    t = math.floor(float(sigma)) + 1
    c = s2 / t
    # a = ceil(c·q) ≈ 2**24 for precision, but keep D = 2taq below 2**_DEN_BITS when possible.
    log2_c = c.numerator.bit_length() - c.denominator.bit_length()  # within 1 of log2(c)
    k = max(0, _GAUSS_BITS - log2_c)
    while k > 0 and 2 * t * math.ceil(c * (1 << k)) * (1 << k) >= 1 << _DEN_BITS:
        k -= 1
    q = 1 << k
    return t, math.ceil(c * q), q


def gaussian_sigma2(sigma: float) -> Fraction:
    """The exact variance parameter σ² that ``discrete_gaussian(sigma, ·)`` realises (>= σ²)."""
    t, a, q = _gaussian_params(sigma)
    return Fraction(t * a, q)


_TIE = 2


@lru_cache(maxsize=128)
def _exp_table(num: int, den: int) -> np.ndarray:
    """For γ = num/den in [0, 1] and each 16-bit prefix u of a uniform U: whether
    K = 1 + #{k : U < γ^k/k!} is odd (1) or even (0), or _TIE when the prefix cannot tell
    (some γ^k/k! lies strictly inside the cell [u, u+1)/2^16; thresholds below 2^-16 all lie in
    the cell u = 0)."""
    u = np.arange(1 << 16, dtype=np.int64)
    count = np.zeros(u.size, dtype=np.int64)
    tie = np.zeros(u.size, dtype=bool)
    x = Fraction(1)
    for k in range(1, 64):
        x = x * Fraction(num, den * k)
        # U < x for sure iff u + 1 <= 2^16 x; U >= x for sure iff u >= 2^16 x.
        floor = math.floor(x * 2**16)
        count += u + 1 <= floor
        if x * 2**16 != floor:
            tie |= u == floor
        if floor == 0:  # every later threshold is in the cell u = 0 as well
            break
    table = np.where(tie, _TIE, (count % 2 == 0).astype(np.int64)).astype(np.int8)
    table.flags.writeable = False
    return table


def _gaussian_acceptance(t: int, sigma2: float) -> float:
    """P(a Lap_ℤ(t) proposal is accepted) = tanh(1/2t) e^(-σ²/2t²) Σ_y e^(-y²/2σ²), used only
    to size the batches of proposals (never to decide anything)."""
    sigma = math.sqrt(sigma2)
    if sigma > 50:
        total = sigma * math.sqrt(2 * math.pi)  # Poisson summation; error e^(-2π²σ²)
    else:
        y = np.arange(-math.ceil(40 * sigma) - 2, math.ceil(40 * sigma) + 3)
        total = float(np.exp(-(y**2) / (2 * sigma2)).sum())
    return math.tanh(1 / (2 * t)) * math.exp(-sigma2 / (2 * t * t)) * total


@lru_cache(maxsize=32)
def _exp_tables(gammas: tuple[Fraction, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Stacked :func:`_exp_table` s for the fractional parts of several γ, and ⌊γ⌋."""
    table = np.stack([_exp_table(g.numerator % g.denominator, g.denominator) for g in gammas])
    table.flags.writeable = False
    whole = np.array([g.numerator // g.denominator for g in gammas], dtype=np.int64)
    return table, whole


def _check_exact_scale(t: int, s: int) -> None:
    """Refuse a discrete Laplace scale t/s beyond the exact sampler's integers (both paths)."""
    if t >= 1 << _DEN_BITS:
        raise ValueError(f"discrete Laplace scale {t}/{s} is too large for the exact sampler")


def staircase_parameters(epsilon: float, period: int, step: int) -> tuple[int, int]:
    """(p, q) with ε = p/q exactly (the float's own rational: nothing is rounded, so the
    sampler's ratio e^(-ε) is the one the privacy map states), after checking the period D >= 1
    and the step 0 <= g <= D, and that its draws stay in the exact sampler's integers: its
    magnitude is the discrete Laplace's at scale D/ε (j geometric of ratio e^(-ε), times D),
    so it is held to that Laplace's range (:func:`check_laplace_drawable`). ValueError
    otherwise, before any draw: a plan's check (size 0) refuses it before the charge, as it
    does the Laplace, instead of a draw overflowing after it."""
    eps = _check_positive("epsilon", epsilon)
    if not (isinstance(period, int) and isinstance(step, int) and period >= 1):
        raise ValueError(f"the staircase needs an integer period >= 1, got {period!r}")
    if not 0 <= step <= period:
        raise ValueError(f"the staircase's step must be in [0, {period}], got {step!r}")
    check_laplace_drawable(period / epsilon)
    return eps.numerator, eps.denominator


def check_laplace_drawable(scale: float) -> None:
    """ValueError unless ``discrete_laplace(scale, ·)`` can draw (a finite scale > 0 whose
    realised rational fits the exact sampler): the check a planner runs before the charge, so
    that no draw after it can refuse. Decided by the scale alone, in O(1)."""
    r = laplace_scale(scale)
    _check_exact_scale(r.numerator, r.denominator)


# --- few draws: the same algorithms, one draw at a time, in Python integers -------------------

_SCALAR_MAX = 32  # calls for at most this many draws take the scalar path (numpy's fixed
# per-operation cost dominates small batches: ~300 us per call against ~15 us per scalar draw)


class ByteStream:
    """Uniform random bytes for one call, fetched from the source in chunks.

    Bytes left over when the call returns are dropped by position (never by value), so the
    draws stay exact and i.i.d.; nothing is kept between calls (threads and ``fork`` share a
    source safely, as with the vectorised path).
    """

    __slots__ = ("_buf", "_chunk", "_fetch", "_pos")

    def __init__(self, fetch: RandomBytes, chunk: int) -> None:
        self._fetch = fetch
        self._chunk = chunk
        self._buf = b""
        self._pos = 0

    def take(self, n: int) -> int:
        """The next ``n`` bytes as a big-endian unsigned integer."""
        pos = self._pos
        if pos + n > len(self._buf):
            self._buf = self._buf[pos:] + self._fetch(max(self._chunk, n))
            pos = 0
        self._pos = pos + n
        return int.from_bytes(self._buf[pos : pos + n], "big")


def _bernoulli_exp_unit(rb: ByteStream, p: int, q: int) -> bool:
    """Bernoulli(exp(-p/q)) for 0 <= p <= q: CKS Algorithm 1 as one lazy uniform U.

    K = min{k >= 1 : U >= γ^k/k!} (the events U < γ^k/k! are nested; see
    :meth:`_ExactSampler._bernoulli_exp_const`), returned as [K odd]. U starts with 32 random
    bits and gains 8 more while a comparison with the exact rational γ^k/k! = num/den is
    undecided.
    """
    u = rb.take(4)
    nbits = 32
    count = 0
    num = den = 1
    k = 0
    while True:
        k += 1
        num *= p
        den *= q * k
        while True:  # U ∈ [u, u + 1) / 2^nbits
            scaled = num << nbits
            if (u + 1) * den <= scaled:  # U < γ^k/k! for sure
                count += 1
                break
            if u * den >= scaled:  # U >= γ^k/k! for sure: K = count + 1
                return not count & 1
            u = (u << 8) | rb.take(1)
            nbits += 8


def bernoulli_exp_scalar(rb: ByteStream, p: int, q: int) -> bool:
    """Bernoulli(exp(-p/q)) for p >= 0: ⌊p/q⌋ Bernoulli(exp(-1)) and one for the rest."""
    whole, frac = divmod(p, q)
    if not _bernoulli_exp_unit(rb, frac, q):
        return False
    # all() stops at the first failure; range is lazy even for a huge ⌊p/q⌋ (tiny scales).
    return all(_bernoulli_exp_unit(rb, 1, 1) for _ in range(whole))


def uniform_below_scalar(rb: ByteStream, t: int) -> int:
    """Uniform on {0, ..., t-1}: the low ⌈log2 t⌉ bits of whole bytes, rejected while >= t."""
    bits = (t - 1).bit_length()
    if bits == 0:
        return 0
    nbytes = (bits + 7) // 8
    mask = (1 << bits) - 1
    while True:
        u = rb.take(nbytes) & mask
        if u < t:
            return u


def _geometric_scalar(rb: ByteStream, t: int, s: int) -> int:
    """One exact draw of Y >= 0 with P(Y = y) ∝ e^(-y·s/t) (the magnitude of CKS Algorithm 2):
    for t <= s a count of Bernoulli(e^(-s/t)) successes, else ⌊(U + t·V)/s⌋ with U uniform on
    {0..t-1} kept with probability e^(-U/t) (redrawn otherwise) and V geometric of ratio e^(-1)."""
    if t <= s:
        y = 0
        while bernoulli_exp_scalar(rb, s, t):
            y += 1
        return y
    while True:
        u = uniform_below_scalar(rb, t)
        if _bernoulli_exp_unit(rb, u, t):
            break
    v = 0
    while _bernoulli_exp_unit(rb, 1, 1):
        v += 1
    return (u + t * v) // s


def _laplace_scalar(rb: ByteStream, t: int, s: int) -> int:
    """One exact draw from Lap_ℤ(t/s), the algorithm of :meth:`_ExactSampler._discrete_laplace_ts`
    (CKS Algorithm 2): Y = |Z| geometric with ratio e^(-s/t), a sign byte's low bit, (-, 0)
    rejected."""
    while True:
        y = _geometric_scalar(rb, t, s)
        if rb.take(1) & 1:
            if y:
                return -y
        else:
            return y


def _staircase_scalar(rb: ByteStream, p: int, q: int, period: int, step: int) -> int:
    """One exact draw from the discrete staircase at ε = p/q (period D, step g): the
    magnitude is j·D + r with j geometric of ratio e^(-ε) (:func:`_geometric_scalar`) and r
    uniform on {0..D-1}, kept if r < g and otherwise with probability e^(-ε) (redrawn when
    not kept), so P(r) ∝ 1 or e^(-ε); j and r are independent because the weight of j·D + r
    is e^(-jε)·w(r). A sign byte's low bit, (-, 0) rejected so that 0 is counted once."""
    while True:
        j = _geometric_scalar(rb, q, p)
        while True:
            r = uniform_below_scalar(rb, period)
            if r < step or bernoulli_exp_scalar(rb, p, q):
                break
        y = j * period + r
        if rb.take(1) & 1:
            if y:
                return -y
        else:
            return y


def _gaussian_scalar(rb: ByteStream, t: int, a: int, q: int) -> int:
    """One exact draw from the discrete Gaussian with σ² = t·a/q (CKS Algorithm 3): propose
    Y ~ Lap_ℤ(t), accept with probability exp(-(q|Y| − a)²/(2taq))."""
    den = 2 * t * a * q
    while True:
        y = _laplace_scalar(rb, t, 1)
        d = q * abs(y) - a
        if bernoulli_exp_scalar(rb, d * d, den):
            return y


# --- exact samplers over a stream of uniform random bytes ------------------------------------


class _ExactSampler:
    """Exact samplers (Canonne–Kamath–Steinke 2020) fed by a source of uniform random bytes."""

    def __init__(self, random_bytes: RandomBytes) -> None:
        self._random_bytes = random_bytes

    # -- raw randomness --

    def _words(self, n: int, dtype: type[np.unsignedinteger]) -> np.ndarray:
        width = np.dtype(dtype).itemsize
        return np.frombuffer(self._random_bytes(n * width), dtype=dtype)

    def _bits(self, n: int) -> np.ndarray:
        """n fair coin flips as a bool array."""
        raw = np.frombuffer(self._random_bytes((n + 7) // 8), dtype=np.uint8)
        return np.unpackbits(raw, count=n).astype(bool)

    def _uniform_below(self, n: int, t: int) -> np.ndarray:
        """n uniform integers in {0, ..., t-1} (t < 2**63), by masking and rejection."""
        if t == 1:
            return np.zeros(n, dtype=np.int64)
        k = (t - 1).bit_length()
        dtype = next(
            d for d in (np.uint8, np.uint16, np.uint32, np.uint64) if np.dtype(d).itemsize * 8 >= k
        )
        mask = dtype((1 << k) - 1)
        out = (self._words(n, dtype) & mask).astype(np.int64)
        todo = np.flatnonzero(out >= t)
        while todo.size:
            w = (self._words(todo.size, dtype) & mask).astype(np.int64)
            out[todo] = w
            todo = todo[w >= t]
        return out

    # -- Bernoulli with rational probability --

    def _bernoulli(self, num: np.ndarray, den: int | np.ndarray) -> np.ndarray:
        """Bernoulli(num/den) elementwise, 0 <= num <= den: compare num/den with a uniform real
        whose base-256 digits are drawn only while they tie with the digits of num/den."""
        shifted = num << 8
        digit = shifted // den
        u = self._words(len(num), np.uint8)
        out = u < digit
        idx = np.flatnonzero(u == digit)
        if not idx.size:
            return out
        d = den[idx] if isinstance(den, np.ndarray) else den
        rest = shifted[idx] - digit[idx] * d
        while idx.size:  # ties: about 1 in 256 per digit
            shifted = rest << 8
            digit = shifted // d
            u = self._words(idx.size, np.uint8)
            out[idx] = u < digit
            tie = np.flatnonzero(u == digit)
            if isinstance(d, np.ndarray):
                d = d[tie]
            idx, rest = idx[tie], shifted[tie] - digit[tie] * d
        return out

    def _lazy_count_below(self, prefix: int, nbits: int, gamma: Fraction) -> int:
        """#{k >= 1 : U < γ^k/k!} for γ in [0, 1], where the uniform real U is known to start
        with the ``nbits``-bit ``prefix``; more bytes of U are drawn while a comparison is
        undecided. The thresholds decrease, so counting stops at the first one U exceeds."""
        count = 0
        x = Fraction(1)
        while True:
            x = x * gamma / (count + 1)
            p, q = x.numerator, x.denominator
            while True:  # U ∈ [prefix, prefix + 1) / 2^nbits
                if (prefix + 1) * q <= p << nbits:
                    count += 1
                    break
                if prefix * q >= p << nbits:
                    return count
                prefix = (prefix << 8) | self._random_bytes(1)[0]
                nbits += 8

    def _bernoulli_exp_const(self, n: int, num: int, den: int) -> np.ndarray:
        """n draws of Bernoulli(exp(-γ)) for one rational γ = num/den in [0, 1].

        CKS Algorithm 1 returns [K odd] for K = min{k >= 1 : Bernoulli(γ/k) = 0}, so
        P(K > k) = γ^k / k!. The same K is min{k : U >= γ^k/k!} for a single uniform U, since
        these events are nested. The first 16 bits of U decide through a table built from the
        exact thresholds; when they cannot (about 1 draw in 10^4) more bits of U are drawn
        and compared with the exact rationals.
        """
        table = _exp_table(num, den)
        u = self._words(n, np.uint16)
        out = table[u]
        for i in np.flatnonzero(out == _TIE):
            count = self._lazy_count_below(int(u[i]), 16, Fraction(num, den))
            out[i] = count % 2 == 0  # K = count + 1 odd
        return out.astype(bool)

    def _bernoulli_exp_keyed(self, keys: np.ndarray, gammas: tuple[Fraction, ...]) -> np.ndarray:
        """Bernoulli(exp(-gammas[key])) elementwise, for a parameter taking few values: one
        table lookup per draw (the method of :meth:`_bernoulli_exp_const`), then the ⌊γ⌋
        Bernoulli(exp(-1)) factors."""
        table, whole = _exp_tables(gammas)
        u = self._words(keys.size, np.uint16)
        out = table[keys, u]
        for i in np.flatnonzero(out == _TIE):
            count = self._lazy_count_below(int(u[i]), 16, gammas[keys[i]] - whole[keys[i]])
            out[i] = count % 2 == 0
        out = out.astype(bool)
        need = whole[keys]
        live = np.flatnonzero(out & (need > 0))
        j = 1
        while live.size:
            ok = self._bernoulli_exp_const(live.size, 1, 1)
            out[live] = ok
            j += 1
            live = live[ok & (need[live] >= j)]
        return out

    def _bernoulli_exp_frac(self, num: np.ndarray, den: int | np.ndarray) -> np.ndarray:
        """Bernoulli(exp(-num/den)) elementwise for 0 <= num/den <= 1 (CKS Algorithm 1).

        K <- 1; while Bernoulli(γ/K): K <- K+1; return K odd. Bernoulli(γ/K) is drawn as
        Bernoulli(1/K) AND Bernoulli(γ), which keeps the integers as small as den.
        """
        go = self._bernoulli(num, den)
        out = ~go  # stopped at K = 1: odd
        idx = np.flatnonzero(go)
        k = 2
        while idx.size:
            go = self._bernoulli_words_1_over(idx.size, k)
            sub = np.flatnonzero(go)
            d = den[idx[sub]] if isinstance(den, np.ndarray) else den
            go[sub] = self._bernoulli(num[idx[sub]], d)
            if k % 2 == 1:
                out[idx[~go]] = True
            idx = idx[go]
            k += 1
        return out

    def _bernoulli_words_1_over(self, n: int, k: int) -> np.ndarray:
        """n draws of Bernoulli(1/k), k >= 2."""
        return self._bernoulli(np.ones(n, dtype=np.int64), k)

    def _bernoulli_exp(self, num: np.ndarray, den: int) -> np.ndarray:
        """Bernoulli(exp(-num/den)), num >= 0: ⌊γ⌋ Bernoulli(exp(-1)) and one for the rest."""
        whole = num // den
        out = self._bernoulli_exp_frac(num - whole * den, den)
        live = np.flatnonzero(out & (whole > 0))
        j = 1
        while live.size:  # the j-th Bernoulli(exp(-1)) for those with ⌊γ⌋ >= j still alive
            ok = self._bernoulli_exp_const(live.size, 1, 1)
            out[live] = ok
            j += 1
            live = live[ok & (whole[live] >= j)]
        return out

    def _geometric_exp_const(self, n: int, num: int, den: int) -> np.ndarray:
        """P(V = v) ∝ exp(-v·num/den), v >= 0: count successes of Bernoulli(exp(-num/den))."""
        v = np.zeros(n, dtype=np.int64)
        idx = np.arange(n)
        while idx.size:
            idx = idx[self._bernoulli_exp_n(idx.size, num, den)]
            v[idx] += 1
        return v

    def _bernoulli_exp_n(self, n: int, num: int, den: int) -> np.ndarray:
        """n draws of Bernoulli(exp(-num/den)), num/den >= 0: one for the fractional part,
        then ⌊num/den⌋ Bernoulli(exp(-1)) for those still alive."""
        whole, frac = divmod(num, den)
        ok = self._bernoulli_exp_const(n, frac, den)
        for _ in range(whole):
            sub = np.flatnonzero(ok)
            if not sub.size:
                break
            ok[sub] = self._bernoulli_exp_const(sub.size, 1, 1)
        return ok

    # -- discrete Laplace and Gaussian --

    def _discrete_laplace_ts(self, t: int, s: int, size: int) -> np.ndarray:
        """Exact draws from Lap_ℤ(t/s), P(k) ∝ exp(-|k|·s/t) (CKS Algorithm 2), t < 2**54.

        Y = |Z| is geometric with ratio e^(-s/t). For t <= s (scale <= 1) it is drawn directly
        as a count of Bernoulli(e^(-s/t)) successes; otherwise as ⌊X/s⌋ with X = U + t·V
        geometric with ratio e^(-1/t), U geometric on {0..t-1} (uniform, kept with probability
        e^(-U/t)) and V geometric with ratio e^(-1). A sign bit is attached and (-, 0) rejected.
        """
        _check_exact_scale(t, s)
        direct = t <= s
        accept_u = 1.0 if direct else -math.expm1(-1.0) / (t * -math.expm1(-1.0 / t))
        ratio = s / t if s.bit_length() - t.bit_length() < 1000 else math.inf
        accept = accept_u * (1 - 0.5 * -math.expm1(-ratio))  # P(not (B = 1, Y = 0))
        out = np.empty(size, dtype=np.int64)
        filled = 0
        while filled < size:
            need = size - filled
            tries = int(need / accept * 1.02) + 16
            y = self._geometric_ts(t, s, tries)
            negative = self._bits(y.size)
            keep = ~(negative & (y == 0))  # so that 0 is not counted twice
            z = np.where(negative, -y, y)[keep][:need]
            out[filled : filled + z.size] = z
            filled += z.size
        return out

    def _geometric_ts(self, t: int, s: int, tries: int) -> np.ndarray:
        """Up to ``tries`` i.i.d. draws (fewer: rejected proposals are dropped by position) of
        Y >= 0 with P(Y = y) ∝ e^(-y·s/t), by the method of :meth:`_discrete_laplace_ts`."""
        if t <= s:
            return self._geometric_exp_const(tries, s, t)
        u = self._uniform_below(tries, t)
        if t <= _GROUPED:
            u = u[self._bernoulli_exp_keyed(u, tuple(Fraction(v, t) for v in range(t)))]
        else:
            u = u[self._bernoulli_exp_frac(u, t)]
        return (u + t * self._geometric_exp_const(u.size, 1, 1)) // s

    def discrete_staircase(self, epsilon: float, period: int, step: int, size: int) -> np.ndarray:
        """i.i.d. draws from the discrete staircase at ε (exactly the float's rational p/q),
        period D and step g (:func:`_staircase_scalar`'s algorithm; vectorised for more than
        ``_SCALAR_MAX`` draws and D < 2^40, where j·D + r stays in int64)."""
        p, q = staircase_parameters(epsilon, period, step)
        if size <= _SCALAR_MAX or period >= 1 << 40 or q >= 1 << _DEN_BITS:
            rb = ByteStream(self._random_bytes, 48 * size + 32)
            draws = [_staircase_scalar(rb, p, q, period, step) for _ in range(size)]
            return np.array(draws, dtype=np.int64)
        out = np.empty(size, dtype=np.int64)
        filled = 0
        while filled < size:
            need = size - filled
            j = self._geometric_ts(q, p, int(need * 1.7) + 16)  # P(keep a proposal) >= 0.63
            r = self._uniform_below(j.size, period)
            todo = np.flatnonzero(r >= step)
            while todo.size:  # r >= g is kept with probability e^(-ε), else redrawn
                todo = todo[~self._bernoulli_exp_n(todo.size, p, q)]
                r[todo] = self._uniform_below(todo.size, period)
                todo = todo[r[todo] >= step]
            if j.size and int(j.max()) > ((1 << 62) - period) // period:
                raise OverflowError("staircase noise beyond 2^62 units")
            y = j * period + r
            negative = self._bits(y.size)
            z = np.where(negative, -y, y)[~(negative & (y == 0))][:need]
            out[filled : filled + z.size] = z
            filled += z.size
        return out

    def discrete_laplace(self, scale: float, size: int) -> np.ndarray:
        """i.i.d. draws with P(k) ∝ exp(-|k| / r), r = :func:`laplace_scale` (scale) >= scale."""
        r = laplace_scale(scale)
        t, s = r.numerator, r.denominator
        if size <= _SCALAR_MAX:
            _check_exact_scale(t, s)
            rb = ByteStream(self._random_bytes, 32 * size + 32)
            return np.array([_laplace_scalar(rb, t, s) for _ in range(size)], dtype=np.int64)
        return self._discrete_laplace_ts(t, s, size)

    def discrete_gaussian(self, sigma: float, size: int) -> np.ndarray:
        """i.i.d. draws with P(k) ∝ exp(-k²/(2σ²)), σ² = :func:`gaussian_sigma2` (sigma) (CKS
        Algorithm 3: propose Y ~ Lap_ℤ(t), accept with probability exp(-(|Y| − σ²/t)²/(2σ²)))."""
        t, a, q = _gaussian_params(sigma)
        if size <= _SCALAR_MAX:
            _check_exact_scale(t, 1)  # the Laplace proposal's scale
            rb = ByteStream(self._random_bytes, 48 * size + 32)
            return np.array([_gaussian_scalar(rb, t, a, q) for _ in range(size)], dtype=np.int64)
        out = np.empty(size, dtype=np.int64)
        filled = 0
        accept = _gaussian_acceptance(t, float(Fraction(t * a, q)))
        while filled < size:
            need = size - filled
            tries = int(need / accept * 1.02) + 16
            y = self._discrete_laplace_ts(t, 1, tries)
            z = y[self._gaussian_accept(np.abs(y), t, a, q)]
            z = z[:need]
            out[filled : filled + z.size] = z
            filled += z.size
        return out

    def _gaussian_accept(self, m: np.ndarray, t: int, a: int, q: int) -> np.ndarray:
        """Bernoulli(exp(-(q·m − a)²/(2taq))) for proposals |Y| = m, in int64 where the
        integers fit and in Python integers (object arrays) for huge σ or extreme proposals."""
        den = 2 * t * a * q
        accept = np.empty(m.size, dtype=bool)
        rest = np.arange(m.size)
        if t <= _GROUPED // 16 and den < 1 << _DEN_BITS:  # small σ: |Y| takes few values
            few = m < 16 * t
            gammas = tuple(Fraction((q * v - a) ** 2, den) for v in range(16 * t))
            accept[few] = self._bernoulli_exp_keyed(m[few], gammas)
            rest = np.flatnonzero(~few)
        m = m[rest]
        fits = m < ((1 << 31) + a) // q if den < 1 << _DEN_BITS else np.zeros(m.size, dtype=bool)
        for part, dtype in ((np.flatnonzero(fits), np.int64), (np.flatnonzero(~fits), object)):
            if part.size:
                d = m[part].astype(dtype) * q - a
                accept[rest[part]] = self._bernoulli_exp(d * d, den)
        return accept

    # -- continuous draws (selection scores only; never added to a released aggregate) --

    def _open_uniform(self, size: int) -> np.ndarray:
        """float64 uniform on (0, 1): 53 random bits, centred in their cell."""
        return ((self._words(size, np.uint64) >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53

    def uniform(self, size: int) -> np.ndarray:
        return (self._words(size, np.uint64) >> np.uint64(11)).astype(np.float64) * 2.0**-53

    def laplace(self, scale: float, size: int) -> np.ndarray:
        u = self._open_uniform(size) - 0.5
        return -scale * np.sign(u) * np.log1p(-2.0 * np.abs(u))

    def gaussian(self, sigma: float, size: int) -> np.ndarray:
        return sigma * special.ndtri(self._open_uniform(size))

    def cauchy(self, size: int) -> np.ndarray:
        return np.tan(np.pi * (self._open_uniform(size) - 0.5))

    def gumbel(self, scale: float, size: int) -> np.ndarray:
        return -scale * np.log(-np.log(self._open_uniform(size)))


class SeededNoise(_ExactSampler):
    """Deterministic noise for statistical tests with fixed seeds. Not for releases.

    The same exact algorithms as :class:`SecureNoise`, fed by a seeded PCG64 byte stream.
    """

    def __init__(self, seed: int) -> None:
        super().__init__(np.random.Generator(np.random.PCG64(seed)).bytes)


class OsRandomBlocks:
    """``os.urandom``, fetched a block at a time per thread: the same uniform bytes, each handed
    out once, in fewer system calls.

    Why: a query's noise takes a few small fetches (one per measure, plus the secret), and
    ``os.urandom`` releases the GIL around its ``getrandom`` call; in the server, with a dozen
    query threads waiting for the GIL, each release cost the thread a hand-over and a wait to
    get it back (~4 such calls a query). A block of :data:`BLOCK` bytes serves ~15 queries of
    one thread.

    Each thread has its own block (a byte is never given to two callers, so no lock), and a
    forked child drops every block it inherited (``os.register_at_fork``, and the block's pid
    checked on every call): a child never draws the bytes its parent draws. A request of more
    than half a block goes straight to ``os.urandom``. The bytes are the CSPRNG's own, in
    order, so every sampler's output distribution is unchanged.
    """

    BLOCK = 4096

    def __init__(self) -> None:
        self._local = threading.local()

    def forget(self) -> None:
        """Drop every thread's block (called in a forked child)."""
        self._local = threading.local()

    def __call__(self, n: int) -> bytes:
        if n > self.BLOCK // 2:
            return os.urandom(n)
        local = self._local
        pid = os.getpid()
        buf: bytes = getattr(local, "buf", b"")
        pos: int = getattr(local, "pos", 0)
        if pos + n > len(buf) or getattr(local, "pid", None) != pid:
            buf, pos = os.urandom(self.BLOCK), 0
            local.buf, local.pid = buf, pid
        local.pos = pos + n
        return buf[pos : pos + n]


# One per process: every SecureNoise draws from it (the pipeline's per-query secret is still
# drawn by secrets.randbits; random_bits is the way to move it here).
os_random_bytes = OsRandomBlocks()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=os_random_bytes.forget)


def random_bits(k: int) -> int:
    """A uniform integer of ``k`` bits from the OS CSPRNG (:data:`os_random_bytes`): what
    ``secrets.randbits(k)`` gives, without a system call of its own."""
    nbytes = (k + 7) // 8
    return int.from_bytes(os_random_bytes(nbytes), "big") >> (nbytes * 8 - k)


class SecureNoise(_ExactSampler):
    """Noise for real releases: every random byte comes from the OS CSPRNG (``os.urandom``),
    fetched in blocks per thread (:class:`OsRandomBlocks`: each byte used once, never shared
    with another thread or a forked child), so the source is safe to share between threads
    and across ``fork``.
    """

    def __init__(self) -> None:
        super().__init__(os_random_bytes)


def default_source() -> NoiseSource:
    return SecureNoise()
