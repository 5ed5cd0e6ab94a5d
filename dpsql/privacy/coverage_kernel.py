"""AVG's confidence set (dpsql.privacy.coverage.ratio_set) compiled, for one quantile row.

The numpy search of :func:`dpsql.privacy.coverage._ratio_set_block` makes ~35 small array
passes a group (the 129-point grid, the point estimate, 16 bisections on each edge), ~0.5 ms
for one group: a quarter of an ungrouped AVG query's CPU in the server. Here the same search
runs as a loop per group, with the same IEEE operations in the same order on the same
doubles, so the set is the same to the last bit (tests/test_coverage_kernel.py checks it equal
to the numpy search on random and edge-case inputs). It is post-processing of released values
with public parameters: nothing here reads data or draws noise.

``np.interp`` is written out as numpy computes it for a strictly increasing grid (the slope of
the cell, ``slope * (x - xs[j]) + qs[j]``, the other end when that is NaN, a grid point's own
value at the point); the caller routes a grid that is not strictly increasing to numpy.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

_jit: Any
try:  # pragma: no cover - exercised where numba is installed (pyproject: a dependency)
    import numba

    _jit = numba.njit(cache=True, nogil=True)
except ImportError:  # pragma: no cover
    _jit = None

_BIG = np.finfo(np.float64).max  # np.nan_to_num's value for +inf


def available() -> bool:
    """Whether the compiled search can run here."""
    return _jit is not None


def ready() -> bool:
    """Whether the compiled search is loaded in this process. The first ask starts loading it
    (compiled, or read from numba's cache) on a thread of its own and says no: the numpy
    search answers meanwhile, equal to the bit, so no release waits for a compile (~10 s of
    CPU in a fresh install). A fact of the process's age, never of the data."""
    if _loaded.is_set():
        return True
    with _loading_lock:
        if available() and not _loading:
            _loading.append(threading.Thread(target=load, name="dpsql-coverage", daemon=True))
            _loading[0].start()
    return False


def load() -> None:
    """Compile (or read from numba's cache) the search now, on tiny inputs."""
    grid = np.array([0.0, 1.0])
    ratio_sets(np.ones(1), np.ones(1), grid, np.ones(2), 1)
    _loaded.set()


_loaded = threading.Event()
_loading: list[threading.Thread] = []
_loading_lock = threading.Lock()


def _interp(x: float, xs: np.ndarray, qs: np.ndarray) -> float:  # pragma: no cover - compiled
    """``np.interp(x, xs, qs)`` for strictly increasing ``xs`` (numpy's arr_interp)."""
    n = xs.shape[0]
    if np.isnan(x):
        return x
    if x < xs[0]:
        return qs[0]
    if x > xs[n - 1]:
        return qs[n - 1]
    lo = 0  # the cell: xs[lo] <= x < xs[lo + 1], or lo = n - 1 at the last point
    hi = n - 1
    if x >= xs[n - 1]:
        lo = n - 1
    else:
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if xs[mid] <= x:
                lo = mid
            else:
                hi = mid
    if lo == n - 1 or xs[lo] == x:
        return qs[lo]
    slope = (qs[lo + 1] - qs[lo]) / (xs[lo + 1] - xs[lo])
    out = slope * (x - xs[lo]) + qs[lo]
    if np.isnan(out):
        out = slope * (x - xs[lo + 1]) + qs[lo + 1]
        if np.isnan(out) and qs[lo] == qs[lo + 1]:
            out = qs[lo]
    return out


def _passes(  # pragma: no cover - compiled
    a: float, b: float, x: float, xs: np.ndarray, qs: np.ndarray
) -> bool:
    """|a − x·b| <= q(x): x is in the group's set (coverage._ratio_set_block's passes)."""
    return abs(a - x * b) <= _interp(x, xs, qs)


def _ratio_sets(  # pragma: no cover - compiled
    a: np.ndarray,
    b: np.ndarray,
    xs: np.ndarray,
    qs: np.ndarray,
    bisections: int,
    low: np.ndarray,
    high: np.ndarray,
) -> None:
    """Per group, _ratio_set_block's hull into ``low`` / ``high`` (see its steps there)."""
    n = xs.shape[0]
    x_lo = xs[0]
    x_hi = xs[n - 1]
    step = xs[1] - xs[0]
    for g in range(a.shape[0]):
        ag = a[g]
        bg = b[g]
        point = ag / bg if bg > 0 else np.nan
        if np.isnan(point):  # np.nan_to_num(point, nan=x_lo), then np.clip
            point = x_lo
        elif point == np.inf:
            point = _BIG
        elif point == -np.inf:
            point = -_BIG
        point = min(max(point, x_lo), x_hi)
        first = -1
        last = -1
        for i in range(n):
            if _passes(ag, bg, xs[i], xs, qs):
                if first < 0:
                    first = i
                last = i
        left = xs[first] if first >= 0 else np.inf
        right = xs[last] if first >= 0 else -np.inf
        if _passes(ag, bg, point, xs, qs):
            if point < left:
                left = point
            if point > right:
                right = point
        found = np.isfinite(left)
        if not found:
            left = x_lo
            right = x_hi
        lo_in = left
        lo_out = max(left - step, x_lo)
        hi_in = right
        hi_out = min(right + step, x_hi)
        for _ in range(bisections):
            mid = (lo_in + lo_out) / 2
            if _passes(ag, bg, mid, xs, qs):
                lo_in = mid
            else:
                lo_out = mid
            mid = (hi_in + hi_out) / 2
            if _passes(ag, bg, mid, xs, qs):
                hi_in = mid
            else:
                hi_out = mid
        low[g] = lo_out if found else x_lo
        high[g] = hi_out if found else x_hi


if _jit is not None:
    _interp = _jit(_interp)
    _passes = _jit(_passes)
    _ratio_sets = _jit(_ratio_sets)


def ratio_sets(
    a: np.ndarray, b: np.ndarray, xs: np.ndarray, qs: np.ndarray, bisections: int
) -> tuple[np.ndarray, np.ndarray]:
    """coverage.ratio_set for a shared quantile row ``qs`` (1-D) over a strictly increasing
    grid ``xs`` of at least two points: (low, high) per group, equal to the numpy search."""
    a = np.ascontiguousarray(a, dtype=np.float64)
    b = np.ascontiguousarray(b, dtype=np.float64)
    low = np.empty(a.shape[0])
    high = np.empty(a.shape[0])
    _ratio_sets(
        a,
        b,
        np.ascontiguousarray(xs, dtype=np.float64),
        np.ascontiguousarray(qs, dtype=np.float64),
        bisections,
        low,
        high,
    )
    return low, high
