"""The compiled AVG confidence set (dpsql.privacy.coverage_kernel) equals the numpy search to
the bit, on random and edge-case inputs (fixed seeds), and ratio_set routes to it only where
it is numpy's own arithmetic (one quantile row, a strictly increasing grid)."""

import threading

import numpy as np
import pytest

from dpsql.privacy import coverage, coverage_kernel
from dpsql.privacy.coverage import BISECTIONS, _ratio_set_block, pivot_quantiles, ratio_set

pytestmark = pytest.mark.skipif(not coverage_kernel.available(), reason="numba not installed")


def _bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float64).view(np.int64)


def _check(a: np.ndarray, b: np.ndarray, xs: np.ndarray, qs: np.ndarray) -> None:
    with np.errstate(over="ignore", invalid="ignore"):
        want_lo, want_hi = _ratio_set_block(a, b, xs, qs)
    got_lo, got_hi = coverage_kernel.ratio_sets(a, b, xs, qs, BISECTIONS)
    np.testing.assert_array_equal(_bits(got_lo), _bits(want_lo))
    np.testing.assert_array_equal(_bits(got_hi), _bits(want_hi))


def test_equal_to_numpy_on_simulated_pivots() -> None:
    rng = np.random.default_rng(20261207)
    for _ in range(12):
        scale_a, scale_b = rng.uniform(0.5, 500), rng.uniform(0.5, 50)
        lo = rng.uniform(-1000, 0)
        hi = lo + rng.uniform(1e-3, 2000)
        draws_a = rng.laplace(size=2000) * scale_a
        draws_b = np.round(rng.laplace(size=2000) * scale_b)
        xs, qs = pivot_quantiles(draws_a, draws_b, 0.95, lo, hi)
        n = rng.integers(-5, 400, size=64).astype(np.float64)
        mean = rng.uniform(lo - 50, hi + 50, size=64)
        a = np.round(mean * n + rng.laplace(size=64) * scale_a)
        _check(a, n, xs, qs)
        _check(a.astype(np.int64), n.astype(np.int64), xs, qs)  # integer releases


def test_equal_to_numpy_on_edges() -> None:
    rng = np.random.default_rng(7)
    xs = np.linspace(-3.0, 5.0, coverage.PIVOT_GRID)
    qs = rng.uniform(0.0, 4.0, size=xs.size)
    qs[40:60] = 0.0  # flat, zero-width stretches
    big = np.finfo(np.float64).max
    a = np.array([0.0, 1.0, -1.0, 5.0, 1e300, -1e300, np.nan, np.inf, -np.inf, 3.0, 2.0, 7.0])
    b = np.array([0.0, 0.0, -2.0, 1.0, 1e-300, 1e-300, 1.0, 1.0, 1.0, 1.0, big, 1e-9])
    _check(a, b, xs, qs)
    # points exactly on the grid, the grid's ends, and sets that pass nowhere or everywhere
    a = xs[::8] * 10.0
    _check(a, np.full(a.size, 10.0), xs, qs)
    _check(np.full(3, 1e6), np.ones(3), xs, np.zeros(xs.size))  # nothing passes
    _check(np.zeros(3), np.ones(3), xs, np.full(xs.size, 1e9))  # everything passes
    _check(np.zeros(0), np.zeros(0), xs, qs)  # no groups


def test_ratio_set_routes_by_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = coverage_kernel.ratio_sets

    def spy(*args: object) -> tuple[np.ndarray, np.ndarray]:
        calls.append(1)
        return real(*args)  # type: ignore[arg-type]

    coverage_kernel.load()
    monkeypatch.setattr(coverage_kernel, "ratio_sets", spy)
    xs = np.linspace(0.0, 1.0, 9)
    a, b = np.array([0.4, 3.0]), np.array([1.0, 2.0])
    ratio_set(a, b, xs, np.full(9, 0.2))  # one row, increasing grid: compiled
    assert calls == [1]
    ratio_set(a, b, xs, np.full((2, 9), 0.2))  # a row per group (VAR): numpy
    flat = np.full(9, 0.5)  # a degenerate range: every candidate equal, numpy
    lo, hi = ratio_set(a, b, flat, np.full(9, 0.2))
    assert calls == [1]
    want = _ratio_set_block(a, b, flat, np.full(9, 0.2))
    np.testing.assert_array_equal(lo, want[0])
    np.testing.assert_array_equal(hi, want[1])


def test_a_release_never_waits_for_the_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    """Until the search is loaded the numpy search answers (and the load starts on its own
    thread); once loaded, the compiled one: the same set to the bit."""
    calls: list[int] = []
    real = coverage_kernel.ratio_sets
    monkeypatch.setattr(coverage_kernel, "ratio_sets", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(coverage_kernel, "_loaded", threading.Event())  # a fresh process
    monkeypatch.setattr(coverage_kernel, "_loading", [])
    started: list[object] = []
    monkeypatch.setattr(threading.Thread, "start", lambda self: started.append(self))
    xs = np.linspace(0.0, 1.0, 9)
    a, b, qs = np.array([0.4, 3.0]), np.array([1.0, 2.0]), np.full(9, 0.2)
    before = ratio_set(a, b, xs, qs)
    assert calls == [] and len(started) == 1  # numpy answered; the load was started
    coverage_kernel.load()
    after = ratio_set(a, b, xs, qs)
    assert calls == [1, 1]  # the load's own tiny call, then the release's
    np.testing.assert_array_equal(before[0], after[0])
    np.testing.assert_array_equal(before[1], after[1])
