"""Exact samplers: goodness of fit against the exact pmf, moments, symmetry, sources.

Statistical tests use fixed seeds (SeededNoise runs the same exact algorithms as SecureNoise,
only the byte stream differs), so each is deterministic; the stated tolerances are what a
correct sampler passes with overwhelming probability for a random seed (p-value floors of
1e-4, moment checks at 5 standard errors).
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from scipy import stats

from dpsql.privacy.samplers import (
    _SCALAR_MAX,
    ByteStream,
    SecureNoise,
    SeededNoise,
    ZeroNoise,
    _ExactSampler,
    bernoulli_exp_scalar,
    default_source,
    gaussian_sigma2,
    laplace_scale,
)

N = 200_000
P_FLOOR = 1e-4  # χ² / KS p-value below which a fixed-seed test fails


# --- exact reference distributions ----------------------------------------------------------


def laplace_cdf(scale: float, k: np.ndarray) -> np.ndarray:
    """P(X <= k) for the discrete Laplace at the realised scale (closed form)."""
    q = math.exp(-1 / float(laplace_scale(scale)))
    k = np.asarray(k, dtype=np.float64)
    upper = 1 - q ** (np.maximum(k, 0) + 1) / (1 + q)
    lower = q ** (-np.minimum(k, -1)) / (1 + q)
    return np.where(k >= 0, upper, lower)


def gaussian_pmf(sigma: float) -> tuple[np.ndarray, np.ndarray]:
    """Support and pmf of the discrete Gaussian at the realised σ², summed directly."""
    s2 = float(gaussian_sigma2(sigma))
    width = math.ceil(14 * math.sqrt(s2)) + 3
    k = np.arange(-width, width + 1)
    w = np.exp(-(k.astype(np.float64) ** 2) / (2 * s2))
    return k, w / w.sum()


def chi2_pvalue(draws: np.ndarray, cdf) -> float:
    """χ² test on ~50 equiprobable integer bins (edges from the exact cdf, bins with expected
    count < 5 merged into their neighbour)."""
    lo, hi = int(draws.min()) - 1, int(draws.max()) + 1
    span = np.arange(lo, hi + 1)
    if span.size > 400_000:  # wide distributions: bin on a coarse grid of candidate edges
        span = np.unique(np.linspace(lo, hi, 400_000).astype(np.int64))
    c = cdf(span)
    levels = np.arange(1, 50) / 50
    edges = np.unique(span[np.minimum(np.searchsorted(c, levels), span.size - 1)])
    probs = np.diff(np.concatenate([[0.0], cdf(edges), [1.0]]))
    observed = np.bincount(np.searchsorted(edges, draws, side="left"), minlength=probs.size)
    expected = probs * draws.size
    # merge small bins
    obs_m, exp_m = [], []
    o_acc = e_acc = 0.0
    for o, e in zip(observed, expected, strict=True):
        o_acc += o
        e_acc += e
        if e_acc >= 5:
            obs_m.append(o_acc)
            exp_m.append(e_acc)
            o_acc = e_acc = 0.0
    if e_acc:
        obs_m[-1] += o_acc
        exp_m[-1] += e_acc
    assert len(exp_m) >= 2, "degenerate test: choose a larger sample or scale"
    exp_m = np.array(exp_m) * (sum(obs_m) / sum(exp_m))  # renormalise float rounding
    return float(stats.chisquare(obs_m, exp_m).pvalue)


def gaussian_cdf(sigma: float):
    k, p = gaussian_pmf(sigma)
    c = np.cumsum(p)

    def cdf(x: np.ndarray) -> np.ndarray:
        x = np.asarray(x)
        i = np.searchsorted(k, x, side="right") - 1
        return np.where(i < 0, 0.0, c[np.clip(i, 0, k.size - 1)])

    return cdf


# --- goodness of fit ------------------------------------------------------------------------


@pytest.mark.parametrize("scale", [0.3, 0.9, 1.0, 2.5, 30.0, 1000.0, 123456.7])
def test_discrete_laplace_fits_exact_pmf(scale: float) -> None:
    draws = SeededNoise(1).discrete_laplace(scale, N)
    assert draws.dtype == np.int64 and draws.shape == (N,)
    assert chi2_pvalue(draws, lambda k: laplace_cdf(scale, k)) > P_FLOOR


@pytest.mark.parametrize("sigma", [0.3, 0.8, 1.0, 3.7, 30.0, 1000.0, 20000.0])
def test_discrete_gaussian_fits_exact_pmf(sigma: float) -> None:
    draws = SeededNoise(2).discrete_gaussian(sigma, N)
    assert draws.dtype == np.int64 and draws.shape == (N,)
    assert chi2_pvalue(draws, gaussian_cdf(sigma)) > P_FLOOR


def test_small_scale_point_masses() -> None:
    """Scale < 1: compare each of -2..2 with its exact probability (bins not merged)."""
    scale = 0.5
    draws = SeededNoise(3).discrete_laplace(scale, N)
    q = math.exp(-1 / float(laplace_scale(scale)))
    for k in range(-2, 3):
        p = (1 - q) / (1 + q) * q ** abs(k)
        se = math.sqrt(p * (1 - p) / N)
        assert abs(np.mean(draws == k) - p) < 5 * se


def test_chi2_detects_a_wrong_distribution() -> None:
    """The test has power: rounded continuous Laplace noise of the same scale fails it."""
    scale = 2.0
    wrong = np.rint(np.random.default_rng(4).laplace(0, scale, N)).astype(np.int64)
    assert chi2_pvalue(wrong, lambda k: laplace_cdf(scale, k)) < P_FLOOR


# --- moments and symmetry -------------------------------------------------------------------


def _assert_variance(draws: np.ndarray, variance: float) -> None:
    x = draws.astype(np.float64)
    fourth = float(np.mean(x**4))
    se = math.sqrt(max(fourth - variance**2, 1e-12) / x.size)
    assert abs(float(np.mean(x**2)) - variance) < 5 * se


@pytest.mark.parametrize("scale", [0.4, 1.0, 30.0, 2000.0])
def test_discrete_laplace_mean_variance_symmetry(scale: float) -> None:
    draws = SeededNoise(5).discrete_laplace(scale, N)
    q = math.exp(-1 / float(laplace_scale(scale)))
    variance = 2 * q / (1 - q) ** 2
    assert abs(draws.mean()) < 5 * math.sqrt(variance / N)
    _assert_variance(draws, variance)
    pos, neg = int(np.sum(draws > 0)), int(np.sum(draws < 0))
    assert stats.binomtest(pos, pos + neg).pvalue > P_FLOOR


@pytest.mark.parametrize("sigma", [0.4, 1.0, 30.0, 2000.0])
def test_discrete_gaussian_mean_variance_symmetry(sigma: float) -> None:
    draws = SeededNoise(6).discrete_gaussian(sigma, N)
    k, p = gaussian_pmf(sigma)
    variance = float(np.sum(k.astype(np.float64) ** 2 * p))
    assert abs(draws.mean()) < 5 * math.sqrt(variance / N)
    _assert_variance(draws, variance)
    pos, neg = int(np.sum(draws > 0)), int(np.sum(draws < 0))
    assert stats.binomtest(pos, pos + neg).pvalue > P_FLOOR


def test_huge_scales_use_the_same_algorithm() -> None:
    """σ beyond the int64 fast path (Python-integer path) and a huge Laplace scale."""
    n = 4000
    g = SeededNoise(7).discrete_gaussian(1e9, n).astype(np.float64)
    assert abs(g.mean()) < 5 * 1e9 / math.sqrt(n)
    assert abs(g.std() / 1e9 - 1) < 5 / math.sqrt(2 * n)
    lap = SeededNoise(8).discrete_laplace(1e12, n).astype(np.float64)
    assert abs(np.mean(np.abs(lap)) / 1e12 - 1) < 5 / math.sqrt(n)


# --- the Bernoulli primitives ---------------------------------------------------------------


@pytest.mark.parametrize(("num", "den"), [(0, 1), (1, 3), (2, 3), (1, 1), (7, 2), (25, 4)])
def test_bernoulli_exp_frequency(num: int, den: int) -> None:
    src = SeededNoise(9)
    n = 100_000
    p = math.exp(-num / den)
    for dtype in (np.int64, object):  # int64 fast path and the Python-integer path
        draws = src._bernoulli_exp(np.full(n, num, dtype=dtype), den)
        assert abs(draws.mean() - p) <= 5 * math.sqrt(p * (1 - p) / n) + 1e-12


def test_lazy_tie_resolution_is_exact() -> None:
    """Prefixes that the 16-bit tables cannot decide are finished with more bits of U.

    γ = 1/3: the prefix 21845 straddles x_1 = 1/3, and P(U < 1/3 | prefix) = 2^16/3 − 21845 =
    1/3 exactly (x_2 = 1/18 is below the cell). The prefix 0 contains every x_k below 2^-16:
    γ = 1/64 has x_3 = 2^-18/6 inside it, so the count must go on past the table's last
    threshold: P(count >= 3 | U < 2^-16) = 2^16 x_3 = 1/24.
    """
    src = SeededNoise(10)
    n = 30_000
    hits = sum(src._lazy_count_below(21845, 16, Fraction(1, 3)) for _ in range(n))
    assert abs(hits / n - 1 / 3) < 5 * math.sqrt(2 / 9 / n)
    counts = np.array([src._lazy_count_below(0, 16, Fraction(1, 64)) for _ in range(n)])
    assert counts.min() >= 2  # x_1, x_2 >= 2^-16: U below both for sure
    p = 1 / 24
    assert abs(np.mean(counts >= 3) - p) < 5 * math.sqrt(p * (1 - p) / n)


def test_uniform_below_is_uniform() -> None:
    draws = SeededNoise(11)._uniform_below(N, 1001)
    assert draws.min() >= 0 and draws.max() <= 1000
    assert stats.chisquare(np.bincount(draws, minlength=1001)).pvalue > P_FLOOR


# --- realised parameters --------------------------------------------------------------------


@pytest.mark.parametrize("x", [1e-3, 0.1, 0.3, 1.0, 1 / 3, math.pi, 1000.0, 1e6 + 0.1, 1e12])
def test_realised_parameters_round_up_and_stay_close(x: float) -> None:
    r = laplace_scale(x)
    assert r >= Fraction(x) and float(r / Fraction(x)) - 1 <= (2**-31 if x >= 2**-10 else 1e-6)
    s2 = gaussian_sigma2(x)
    assert s2 >= Fraction(x) ** 2
    tolerance = 2**-23 if x >= 1 else 1e-4  # tiny σ lose bits to keep 2taq < 2^54
    assert float(s2 / Fraction(x) ** 2) - 1 <= tolerance


def test_simple_scales_are_exact() -> None:
    assert laplace_scale(0.25) == Fraction(1, 4)
    assert laplace_scale(1000.0) == 1000
    # 1/10 lies *below* the float 0.1 (= 0.1000000000000000055...), so it is not eligible
    assert Fraction(0.1) <= laplace_scale(0.1) < Fraction(0.1) * (1 + 2**-31)
    assert laplace_scale(0.3) == Fraction(3, 10)  # the float 0.3 lies below 3/10


@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan])
def test_invalid_scales_are_refused(bad: float) -> None:
    with pytest.raises(ValueError):
        SeededNoise(0).discrete_laplace(bad, 3)
    with pytest.raises(ValueError):
        SeededNoise(0).discrete_gaussian(bad, 3)


# --- sources --------------------------------------------------------------------------------


def test_secure_noise_varies() -> None:
    src = SecureNoise()
    a, b = src.discrete_laplace(10.0, 200), src.discrete_laplace(10.0, 200)
    assert not np.array_equal(a, b)
    assert len(np.unique(a)) > 10
    assert len(np.unique(src.discrete_gaussian(10.0, 200))) > 10
    assert isinstance(default_source(), SecureNoise)


def test_seeded_noise_is_reproducible() -> None:
    for method, arg in (("discrete_laplace", 7.5), ("discrete_gaussian", 7.5), ("laplace", 1.0)):
        a = getattr(SeededNoise(42), method)(arg, 1000)
        b = getattr(SeededNoise(42), method)(arg, 1000)
        c = getattr(SeededNoise(43), method)(arg, 1000)
        assert np.array_equal(a, b) and not np.array_equal(a, c)


def test_zero_noise_is_zeros() -> None:
    z = ZeroNoise()
    for draws in (z.discrete_laplace(3.0, 5), z.discrete_gaussian(3.0, 5)):
        assert draws.dtype == np.int64 and not draws.any() and draws.shape == (5,)
    for draws in (z.uniform(4), z.laplace(1.0, 4), z.gaussian(1.0, 4), z.cauchy(4)):
        assert not draws.any()
    assert not z.gumbel(1.0, 4).any()


def test_empty_draws() -> None:
    src = SeededNoise(0)
    assert src.discrete_laplace(3.0, 0).shape == (0,)
    assert src.discrete_gaussian(3.0, 0).shape == (0,)


# --- continuous helpers (selection scores only) ---------------------------------------------


@pytest.mark.parametrize(
    ("method", "args", "dist"),
    [
        ("uniform", (), stats.uniform()),
        ("laplace", (2.0,), stats.laplace(scale=2.0)),
        ("gaussian", (3.0,), stats.norm(scale=3.0)),
        ("cauchy", (), stats.cauchy()),
        ("gumbel", (1.5,), stats.gumbel_r(scale=1.5)),
    ],
)
def test_continuous_helpers(method: str, args: tuple, dist) -> None:
    draws = getattr(SeededNoise(12), method)(*args, 50_000)
    assert draws.dtype == np.float64 and np.all(np.isfinite(draws))
    assert stats.kstest(draws, dist.cdf).pvalue > P_FLOOR


def test_keyed_bernoulli_exp_frequencies() -> None:
    """The table path used when γ takes few values (small t, small σ), integer parts included."""
    gammas = (Fraction(0), Fraction(1, 3), Fraction(5, 2), Fraction(7, 7))
    n = 60_000
    keys = np.repeat(np.arange(len(gammas)), n)
    draws = SeededNoise(15)._bernoulli_exp_keyed(keys, gammas)
    for i, g in enumerate(gammas):
        p = math.exp(-float(g))
        got = draws[keys == i].mean()
        assert abs(got - p) <= 5 * math.sqrt(p * (1 - p) / n) + 1e-12


@pytest.mark.parametrize("tiny", [1e-10, 1e-300, 5e-324])
def test_tiny_scales_give_zero_noise_without_overflow(tiny: float) -> None:
    """Realised parameters stay >= the request even for denormal scales; the noise is then 0
    with overwhelming probability (e.g. P(X != 0) < 2e-9 for the Gaussian at σ² = 2^-52)."""
    src = SeededNoise(16)
    assert not src.discrete_laplace(tiny, 1000).any()
    assert not src.discrete_gaussian(tiny, 1000).any()
    assert laplace_scale(tiny) >= Fraction(tiny)
    assert gaussian_sigma2(tiny) >= Fraction(tiny) ** 2


# --- the scalar path (calls for at most _SCALAR_MAX draws: one query's noise) ---------------


def _scalar_draws(method: str, arg: float, seed: int, calls: int = 5000, size: int = 8):
    """Many small calls, as the pipeline makes them (one per measure and query)."""
    src = SeededNoise(seed)
    return np.concatenate([getattr(src, method)(arg, size) for _ in range(calls)])


def test_small_calls_take_the_scalar_path(monkeypatch: pytest.MonkeyPatch) -> None:
    def vectorised(*args: object) -> None:
        raise AssertionError("vectorised path used for a small call")

    monkeypatch.setattr(_ExactSampler, "_discrete_laplace_ts", vectorised)
    src = SeededNoise(20)
    for size in (1, 5, _SCALAR_MAX):
        assert src.discrete_laplace(7.0, size).shape == (size,)
        assert src.discrete_gaussian(7.0, size).dtype == np.int64
    with pytest.raises(AssertionError):
        src.discrete_laplace(7.0, _SCALAR_MAX + 1)


@pytest.mark.parametrize("scale", [0.3, 1.0, 2.5, 30.0, 123456.7])
def test_scalar_discrete_laplace_fits_exact_pmf(scale: float) -> None:
    draws = _scalar_draws("discrete_laplace", scale, 21)  # 40,000 draws
    assert draws.dtype == np.int64
    assert chi2_pvalue(draws, lambda k: laplace_cdf(scale, k)) > P_FLOOR


@pytest.mark.parametrize("sigma", [0.3, 3.7, 1000.0])
def test_scalar_discrete_gaussian_fits_exact_pmf(sigma: float) -> None:
    draws = _scalar_draws("discrete_gaussian", sigma, 22, calls=2500)  # 20,000 draws
    assert chi2_pvalue(draws, gaussian_cdf(sigma)) > P_FLOOR


@pytest.mark.parametrize("scale", [0.4, 30.0])
def test_scalar_discrete_laplace_moments_and_point_masses(scale: float) -> None:
    """Mean, variance, sign balance (5 standard errors), and P(0), P(±1) at 5 s.e."""
    draws = _scalar_draws("discrete_laplace", scale, 23)
    n = draws.size
    q = math.exp(-1 / float(laplace_scale(scale)))
    variance = 2 * q / (1 - q) ** 2
    assert abs(draws.mean()) < 5 * math.sqrt(variance / n)
    _assert_variance(draws, variance)
    for k in (-1, 0, 1):
        p = (1 - q) / (1 + q) * q ** abs(k)
        assert abs(np.mean(draws == k) - p) < 5 * math.sqrt(p * (1 - p) / n)


@pytest.mark.parametrize(("num", "den"), [(0, 1), (1, 2), (1, 3), (1, 1), (7, 2), (1, 64)])
def test_scalar_bernoulli_exp_frequency(num: int, den: int) -> None:
    """Bernoulli(exp(-γ)) one draw at a time; 1/2 and 1/64 put thresholds exactly on the
    32-bit grid (the comparison must treat U = x as U >= x)."""
    rb = ByteStream(np.random.Generator(np.random.PCG64(24)).bytes, 4096)
    n = 60_000
    p = math.exp(-num / den)
    hits = sum(bernoulli_exp_scalar(rb, num, den) for _ in range(n))
    assert abs(hits / n - p) <= 5 * math.sqrt(p * (1 - p) / n) + 1e-12


def test_scalar_path_huge_and_tiny_scales() -> None:
    src = SeededNoise(25)
    lap = np.concatenate([src.discrete_laplace(1e12, 4) for _ in range(1000)])
    assert abs(np.mean(np.abs(lap.astype(np.float64))) / 1e12 - 1) < 5 / math.sqrt(lap.size)
    for tiny in (1e-10, 5e-324):
        assert not src.discrete_laplace(tiny, 5).any()
        assert not src.discrete_gaussian(tiny, 5).any()
    with pytest.raises(ValueError):
        src.discrete_laplace(2.0**60, 1)  # the same refusal as the vectorised path
    with pytest.raises(ValueError):
        src.discrete_laplace(2.0**60, 0)
