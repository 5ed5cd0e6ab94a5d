"""One pass over unit-clustered rows: the per-unit bounding of a column program, compiled.

A large table held in memory (dpsql.engine.columnar, ``ColumnarTable.unit_starts``) keeps its
rows clustered by privacy unit, the units numbered densely in order. Bounding per unit then
needs no hash table over (unit, group) pairs: each unit's rows are contiguous, so one
sequential pass accumulates a unit's pairs in a small array indexed by group code (reset after
the unit), bounds them (R/n of a pair's rows, G/k of the unit's groups) and adds them to the
group totals. That is the whole plan of ``columnar._per_unit`` (and of the SQL of
``dpsql.lower.compile._bounded`` under rescaling), integer for integer: the same products, the
same quotients truncated toward zero, the same int64 sums, so the result is identical
(tests/test_clustered.py runs both on the same programs).

The loop is compiled by numba when it is installed (a dependency of dpsql); without it
:func:`available` is False and the numpy program runs instead. Nothing here depends on the
values for its control flow beyond the rows themselves: every row of every unit is visited,
a row the WHERE drops weighing 0.
"""

from __future__ import annotations

from typing import Any

import numpy as np

_jit: Any
_inline: Any
try:  # pragma: no cover - exercised where numba is installed (pyproject: a dependency)
    import numba

    # error_model="numpy": no zero-division test and exception path around each / and //
    # (every divisor here is >= 1: a unit's pair count, a pair's rows where it exceeds R,
    # max(n, 1), the grids); the helpers are inlined into the loops (a call per pair and
    # measure was ~5% of the pass)
    _jit = numba.njit(cache=True, nogil=True, error_model="numpy")
    _inline = numba.njit(inline="always", error_model="numpy")
except ImportError:  # pragma: no cover
    _jit = _inline = None

# measure kinds of the kernel: a count of non-NULL values, a centred sum, a centred sum of
# squares (row values, bounded at R/n); a pair's rows cut by R and their mass (the bias
# measures ``dropped`` and ``cut``, dpsql.plan.bias: per pair, never rescaled by R/n); row and
# unit counts are computed from the pairs' row counts
VALUES, SUM, SUMSQ, DROPPED, CUT = 0, 1, 2, 3, 4
_LARGEST = 2**63 - 1
_EXACT = 2**53
#: rows of a kernel's packed ``spec`` (one column per value measure)
_KIND, _GRID, _CENTER, _CENTER2, _SCALE, _CAP, _LOW, _HIGH, _SLOT, _FIXED_ROW, _NULL_ROW = range(11)
_ROWS = 11


def _ro(array: np.ndarray) -> np.ndarray:
    """A read-only view (no copy): numba compiles one kernel per argument type, read-only
    arrays being a type of their own, so every input is passed read-only (one signature,
    compiled once, cached on disk). One already read-only (a store's) is passed as it is: a
    view and its flag cost ~1 µs an argument, a call's largest fixed cost at 20k rows."""
    if not array.flags.writeable:
        return array
    view = array.view()
    view.setflags(write=False)
    return view


def available() -> bool:
    """Whether the compiled kernel can run here."""
    return _jit is not None


def _quot(a: Any, b: Any) -> Any:  # pragma: no cover - compiled
    """``a // b`` truncated toward zero for b > 0 (SQL's integer division). Through float64
    where that is exact (as columnar._quotient: for 0 <= a and b >= 1 with a + b <= 2^53 the
    rounded a / b cannot reach the next integer, so truncating it is its floor), ~5x faster
    than 64-bit division."""
    m = a if a >= 0 else -a
    q = np.int64(np.float64(m) / np.float64(b)) if m + b <= _EXACT else m // b
    return q if a >= 0 else -q


def _muldiv(a: Any, f: Any, n: Any) -> Any:  # pragma: no cover - compiled
    """``(a * f) // n`` truncated toward zero, exactly, for 0 <= f and n > 0 (compile._fraction,
    whose 128-bit branch this is where a * f would not fit 64 bits: a = q n + r, so
    a f // n = q f + r f // n with r f < n f)."""
    m = a if a >= 0 else -a
    if f == 0 or m <= _LARGEST // f:
        return _quot(a * f, n)
    q = (m // n) * f + (m % n) * f // n
    return q if a >= 0 else -q


def _shift(d: Any) -> Any:  # pragma: no cover - compiled
    """log2(d) when d > 0 is a power of two (every fine grid is: plan.rescale_factor), else -1."""
    if d <= 0 or d & (d - 1) != 0:
        return -1
    s = 0
    while (1 << s) < d:
        s += 1
    return s


def _floordiv(x: Any, d: Any, shift: Any) -> Any:  # pragma: no cover - compiled
    """``x // d`` (floor, any sign): an arithmetic shift when ``shift`` = log2(d) >= 0 (the
    same integer: x >> s is floor(x / 2^s) for every int64), else a 64-bit division, several
    times slower and, per pair, most of the rounding's cost."""
    return x >> shift if shift >= 0 else x // d


def _order_pairs(  # pragma: no cover - compiled
    touched: np.ndarray, t: int, seen: np.ndarray, size: int
) -> None:
    """Put the unit's ``t`` group codes ``touched[:t]`` in ascending order (the rounding's
    order), in place, with no allocation (np.sort's copy per unit was a quarter of the pass):
    read off ``seen`` when the codes are few (one look per code), else an insertion sort (a
    unit's few pairs) or an in-place sort. Which one depends on the table's rows only (t
    counts the unit's pairs whatever the WHERE keeps), as the pass's other work does."""
    if size <= 4 * t + 32:
        q = 0
        for s in range(size):
            if seen[s]:
                touched[q] = s
                q += 1
    elif t <= 32:
        for i in range(1, t):
            v = touched[i]
            j = i - 1
            while j >= 0 and touched[j] > v:
                touched[j + 1] = touched[j]
                j -= 1
            touched[j + 1] = v
    else:
        touched[:t].sort()


def _fixed(x: Any, g: Any, a: Any, b: Any) -> Any:  # pragma: no cover - compiled
    """columnar._fixed_point of one float: CAST(ROUND(clamp(x / g, a, b)) AS BIGINT), NaN to
    ``b``, ROUND half away from zero: the same IEEE division, comparisons and truncations in
    the same order (numba compiles without fastmath), so the same integer."""
    c = x / g
    c = c if c <= b else b  # NaN (no order) and above: b; one select, no branch
    c = a if c < a else c
    whole = np.trunc(c)
    return np.int64(whole + np.trunc(2.0 * (c - whole)))  # half away from zero


def _excess(x: Any, g: Any, a: Any, b: Any, w: Any) -> Any:  # pragma: no cover - compiled
    """columnar._clamp_excess of one float: ROUND(clamp((x - clamp(x, a, b)) / g, -w, w)),
    NaN clamped to ``b`` then its excess (NaN) to ``w`` (the same steps: the same integer;
    a value inside [a, b] gives (x - x) / g = 0)."""
    inside = x if x <= b else b  # NaN and above: b (selects, as _fixed)
    inside = a if x < a else inside
    c = (x - inside) / g
    c = c if c <= w else w
    c = -w if c < -w else c
    whole = np.trunc(c)
    return np.int64(whole + np.trunc(2.0 * (c - whole)))


def _fill(  # pragma: no cover - compiled
    floats: np.ndarray,
    codes: np.ndarray,
    lut: np.ndarray,
    fused: np.ndarray,
    buf: np.ndarray,
    b0: Any,
    b1: Any,
) -> None:
    """Rows ``b0`` .. ``b1`` of each fixed-point row the pass computes (``fused[j, 0]`` 1:
    columnar._fixed_point with g, a, b = ``fused[j, 2:5]`` of the float column ``floats[fused[j,
    1]]``; 2: columnar._clamp_excess with g, lower, upper, W = ``fused[j, 2:6]``; 3: an int
    column's, :func:`_look_up`; 0: none) into ``buf[j, :b1 - b0]``: one flat loop each over a
    block of rows, which the compiler vectorises (~0.5 ns a row; computed row by row inside
    the pass it cost ~5). No full-length row of fixed points exists (4 bytes a row each, 800
    MiB at 100M)."""
    for j in range(fused.shape[0]):
        source = fused[j, 0]
        if source == 0.0:
            continue
        if source == 3.0:
            _look_up(codes, lut, fused[j], buf[j], b0, b1)
            continue
        # slices indexed by the loop's own counter: no negative-index test per row, which
        # kept the loop from being vectorised (~7 ns a row instead of ~0.5)
        x = floats[np.int64(fused[j, 1])][b0:b1]
        out = buf[j]
        g, a, b, w = fused[j, 2], fused[j, 3], fused[j, 4], fused[j, 5]
        if source == 1.0:
            for r in range(x.shape[0]):
                out[r] = _fixed(x[r], g, a, b)
        else:
            for r in range(x.shape[0]):
                out[r] = _excess(x[r], g, a, b, w)


def _look_up(  # pragma: no cover - compiled
    codes: np.ndarray, lut: np.ndarray, source: np.ndarray, out: np.ndarray, b0: Any, b1: Any
) -> None:
    """An int column's fixed points (or clamp excesses) of rows ``b0`` .. ``b1`` into ``out``:
    each row's value at its code in the column's table (``lut[o + code]``, o = ``source[1]``;
    columnar.FixedRows computes that table once from the column's labels, the same function
    of the same value, so the same integer as its filled row), its codes read from the byte
    array ``codes`` at ``source[2]``, ``source[3]`` bytes a code (the store's own codes, no
    copy). A gather from a table of the column's domain, not a row of 4 bytes a row."""
    o = np.int64(source[1])
    at = np.int64(source[2])
    width = np.int64(source[3])
    n = b1 - b0
    if width == 1:
        c1 = codes[at + b0 : at + b1]
        for r in range(n):
            out[r] = np.int64(lut[o + np.int64(c1[r])])
    elif width == 2:
        c2 = codes[at + 2 * b0 : at + 2 * b1].view(np.uint16)
        for r in range(n):
            out[r] = np.int64(lut[o + np.int64(c2[r])])
    else:
        c4 = codes[at + 4 * b0 : at + 4 * b1].view(np.int32)
        for r in range(n):
            out[r] = np.int64(lut[o + np.int64(c4[r])])


#: rows of a block of computed fixed points (:func:`_fill`): a source's block is 16 KiB,
#: in the core's cache while the pass reads it (an argument of the kernels, not a constant
#: compiled in: tests cut units with blocks of a few rows)
_BLOCK = 2048


def _fused_values(  # pragma: no cover - compiled
    floats: np.ndarray, codes: np.ndarray, lut: np.ndarray, fused: np.ndarray, out: np.ndarray
) -> None:
    """Every row's value of each source of ``fused`` (tests: the very integers of the rows
    columnar.FixedRows fills), by the passes' own :func:`_fill`."""
    _fill(floats, codes, lut, fused, out, 0, out.shape[1])


def _clamped(v: Any, low: Any, high: Any) -> Any:  # pragma: no cover - compiled
    """``v`` clamped to [low, high] (a fixed point read from a wider range's row: the same
    integer as the row at [low, high], see columnar._kernel_spec)."""
    return low if v < low else (high if v > high else v)


def _rounded(running: Any, w: Any, off: Any, d: Any, shift: Any) -> Any:  # pragma: no cover
    """The integer count of a share ``w`` whose unit's running sum is now ``running``:
    (A + U) // d - (A - w + U) // d (dpsql.lower.compile.rounded_counts)."""
    return _floordiv(running + off, d, shift) - _floordiv(running - w + off, d, shift)


def _bound_units(  # pragma: no cover - compiled
    starts: np.ndarray, group: np.ndarray, weight: np.ndarray, fixed: np.ndarray,
    floats: np.ndarray, codes: np.ndarray, lut: np.ndarray, fused: np.ndarray,
    nulls: np.ndarray, offsets: np.ndarray, spec: np.ndarray, knobs: np.ndarray, out: np.ndarray,
) -> None:  # fmt: skip
    """Per unit (rows ``starts[u]`` .. ``starts[u + 1]``), per group code: the kept rows n and
    each measure's raw sum; then as columnar._per_unit: capped = min(n, R), partial =
    raw·scale·capped / max(n, 1); under group scaling with k the unit's non-empty pairs and
    kept = min(k, G): counts capped·cs·kept / k, units cs·kept / k, partials p·kept / k (all
    truncated toward zero), summed per group. Fine shares (row and unit counts under group
    scaling, a measure with a grid > 0) rounded per unit as dpsql.lower.compile.rounded_counts
    does: over the unit's pairs by group code, A the running sum of the shares w and U =
    ``offsets[u]``, (A + U) // F - (A - w + U) // F. Fixed shapes: every row is accumulated
    with its weight (0 where the WHERE drops it) and every pair bounded, so the work depends on
    the table, not on which rows the WHERE keeps (docs/threat_model.md, "Column programs").
    Packed (:func:`_prepared`); a unit's rows accumulated here, not in an inlined helper (each
    array passed to one was counted in and out per unit: ~40% of the pass at 4 rows a unit)."""
    M = spec.shape[1]
    kinds, grids, centers, centers2 = spec[_KIND], spec[_GRID], spec[_CENTER], spec[_CENTER2]
    scales, caps, lows, highs = spec[_SCALE], spec[_CAP], spec[_LOW], spec[_HIGH]
    slots, fixed_rows, null_rows = spec[_SLOT], spec[_FIXED_ROW], spec[_NULL_ROW]
    size, R, G, count_scale = knobs[0], knobs[1], knobs[2], knobs[3]
    group_scaling, block = knobs[4] != 0, knobs[5]
    values_out, rows_out, units_out, some_out = out[:M], out[M], out[M + 1], out[M + 2]
    buf, b0, b1 = _blocks(fused, slots, group.shape[0], block)
    n_loc, seen = np.zeros(size, dtype=np.int64), np.zeros(size, dtype=np.bool_)
    acc = np.zeros((M, size), dtype=np.int64)
    touched = np.empty(size, dtype=np.int64)
    running = np.zeros(M, dtype=np.int64)
    count_shift = _shift(count_scale)
    grid_shifts = np.empty(M, dtype=np.int64)
    rounds = group_scaling  # rounded row and unit counts
    for j in range(M):
        grid_shifts[j] = _shift(grids[j])
        rounds = rounds or grids[j] > 0
    for u in range(starts.shape[0] - 1):
        t = 0
        for i in range(starts[u], starts[u + 1]):
            if i >= b1:
                b0, b1 = i, min(group.shape[0], i + block)
                _fill(floats, codes, lut, fused, buf, b0, b1)
            w = np.int64(weight[i])
            s = group[i]
            if not seen[s]:
                seen[s] = True
                touched[t] = s
                t += 1
            n_loc[s] += w
            for j in range(M):
                kind = kinds[j]
                if kind == 3 or nulls[null_rows[j], i]:
                    continue
                if kind == 0:
                    acc[j, s] += w
                else:
                    slot = slots[j]
                    at = np.uint64(i - b0)
                    v = buf[slot, at] if slot >= 0 else np.int64(fixed[fixed_rows[j], i])
                    x = _clamped(v, lows[j], highs[j]) - centers[j]
                    if kind == 2:
                        acc[j, s] += w * (x * x - centers2[j])
                    else:
                        acc[j, s] += w * x
        k = 0
        for q in range(t):
            if n_loc[touched[q]] > 0:
                k += 1
        kept = min(k, G)
        divisor_k = max(k, 1)
        # a quotient whose divisor divides it exactly is computed as the product it is
        scaled_groups = group_scaling and kept != k
        unit_share = _quot(count_scale * kept, divisor_k) if group_scaling else 1
        if rounds:  # the rounding's order: the unit's pairs by group code (else any order)
            _order_pairs(touched, t, seen, size)
        off = offsets[u]
        run_rows = np.int64(0)
        run_units = np.int64(0)
        for j in range(M):
            running[j] = 0
        for q in range(t):
            s = touched[q]
            n = n_loc[s]
            some = np.int64(1) if n > 0 else np.int64(0)
            capped = min(n, R)
            some_out[s] += some
            if group_scaling:  # counts on the fine grid, rounded per unit
                w = some * unit_share
                run_units += w
                units_out[s] += _rounded(run_units, w, off, count_scale, count_shift)
                w = (
                    _quot(capped * count_scale * kept, divisor_k)
                    if scaled_groups
                    else capped * count_scale
                )
                run_rows += w
                rows_out[s] += _rounded(run_rows, w, off, count_scale, count_shift)
            else:
                units_out[s] += some
                rows_out[s] += capped
            for j in range(M):
                kind = kinds[j]
                if kind >= 3:  # the rows R cuts, capped at C, in the fine grid (a pair value)
                    if capped == n:  # R cuts nothing: the products below are 0 (any grid)
                        acc[j, s] = 0
                        continue
                    cut = min(max(n - R, 0), caps[j]) * scales[j]
                    p = cut if kind == 3 else _muldiv(acc[j, s], cut, max(n, 1))
                elif capped == n:
                    p = acc[j, s] * scales[j]
                else:
                    p = _quot(acc[j, s] * (scales[j] * capped), n)
                if scaled_groups:
                    p = _quot(p * kept, divisor_k)
                if grids[j] > 0:  # a count's fine share, rounded per unit
                    running[j] += p
                    p = _rounded(running[j], p, off, grids[j], grid_shifts[j])
                values_out[j, s] += p
                acc[j, s] = 0
            n_loc[s] = 0
            seen[s] = False


def _row_sums(  # pragma: no cover - compiled
    group: np.ndarray,
    weight: np.ndarray,
    fixed: np.ndarray,
    floats: np.ndarray,
    codes: np.ndarray,
    lut: np.ndarray,
    fused: np.ndarray,
    nulls: np.ndarray,
    spec: np.ndarray,
    knobs: np.ndarray,
    out: np.ndarray,
) -> None:
    """Row-level (columnar._row_level): per group code, the kept rows and each measure's sum
    of its rows' values (every row visited, a dropped one weighing 0); ``spec``, ``knobs``
    and ``out`` as :func:`_bound_units` packs them."""
    M = spec.shape[1]
    kinds, centers, centers2 = spec[_KIND], spec[_CENTER], spec[_CENTER2]
    lows, highs, slots = spec[_LOW], spec[_HIGH], spec[_SLOT]
    fixed_rows, null_rows = spec[_FIXED_ROW], spec[_NULL_ROW]
    block = knobs[5]
    values_out, rows_out = out[:M], out[M]
    buf, _, b1 = _blocks(fused, slots, group.shape[0], block)
    step = block if b1 == 0 else b1  # blocks of computed fixed points, or one of every row
    for lo in range(0, group.shape[0], step):
        hi = min(group.shape[0], lo + step)
        if b1 == 0:
            _fill(floats, codes, lut, fused, buf, lo, hi)
        for r in range(hi - lo):  # r: an offset into the block, never negative
            i = lo + r
            w = np.int64(weight[i])
            s = group[i]
            rows_out[s] += w
            for j in range(M):
                if nulls[null_rows[j], i]:
                    continue
                kind = kinds[j]
                if kind == 0:
                    values_out[j, s] += w
                else:
                    slot = slots[j]
                    v = buf[slot, r] if slot >= 0 else np.int64(fixed[fixed_rows[j], i])
                    x = _clamped(v, lows[j], highs[j]) - centers[j]
                    if kind == 2:
                        values_out[j, s] += w * (x * x - centers2[j])
                    else:
                        values_out[j, s] += w * x


def _blocks(  # pragma: no cover - compiled
    fused: np.ndarray, slots: np.ndarray, rows: int, block: int
) -> Any:
    """The block buffer of the fixed points the pass computes (:func:`_fill`, one row per
    source of ``fused``) and the block's rows (b0, b1): with none computed, one block of
    every row (never refilled, no buffer), else blocks of ``block`` rows, none filled yet."""
    computed = False
    for j in range(slots.shape[0]):
        computed = computed or slots[j] >= 0
    if not computed:
        return np.zeros((fused.shape[0], 1), dtype=np.int64), 0, max(rows, 1)
    return np.zeros((fused.shape[0], block), dtype=np.int64), 0, 0


def _counting_order(codes: np.ndarray, size: int) -> np.ndarray:  # pragma: no cover - compiled
    """Row indexes sorted by code in [0, size), stably (a counting sort)."""
    starts = np.zeros(size + 1, dtype=np.int64)
    for i in range(codes.shape[0]):
        starts[codes[i] + 1] += 1
    for c in range(size):
        starts[c + 1] += starts[c]
    out = np.empty(codes.shape[0], dtype=np.int64)
    for i in range(codes.shape[0]):
        c = codes[i]
        out[starts[c]] = i
        starts[c] += 1
    return out


if _jit is not None:
    _counting_order = _jit(_counting_order)
    _quot = _inline(_quot)
    _muldiv = _inline(_muldiv)
    _shift = _jit(_shift)
    _floordiv = _inline(_floordiv)
    _rounded = _inline(_rounded)
    _clamped = _inline(_clamped)
    _fixed = _inline(_fixed)
    _excess = _inline(_excess)
    # inlined: an opaque call inside the unit loop cost the pass ~20% (bound_units 422 vs
    # 347 ms at 10M against the rows read; inlined 294)
    _look_up = _inline(_look_up)
    _fill = _inline(_fill)
    _blocks = _inline(_blocks)
    _fused_values = _jit(_fused_values)
    _order_pairs = _jit(_order_pairs)
    _bound_units = _jit(_bound_units)
    _row_sums = _jit(_row_sums)


def bound_units(
    starts: np.ndarray,
    group: np.ndarray,
    weight: np.ndarray,
    fixed: np.ndarray,
    nulls: np.ndarray,
    measures: list[tuple[int, int, int, int, int, int]],
    fixed_rows: np.ndarray,
    null_rows: np.ndarray,
    size: int,
    R: int,
    G: int,
    count_scale: int,
    group_scaling: bool,
    offsets: np.ndarray,
    clamps: list[tuple[int, int]] | None = None,
    floats: np.ndarray | None = None,
    fused: list[tuple[float, ...]] | None = None,
    codes: np.ndarray | None = None,
    lut: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Run the kernel; ``measures``: per value measure (kind, grid, centre, centre², scale,
    cap), its value read from row ``fixed_rows[j]`` of ``fixed`` unless row ``null_rows[j]``
    of ``nulls`` marks it NULL; grid > 0: a count whose fine shares (on that grid) are
    rounded per unit, with ``offsets`` per unit in the store's order (0s where none is);
    ``clamps``: per measure, [low, high] its value is clamped to as read (None: not clamped);
    ``fused``: per measure (source, row of ``floats``, g, a, b, W), source 1 or 2 for a fixed
    point the pass computes from ``floats`` instead of reading ``fixed`` (:func:`_fill`: once
    per block for every measure with the same source), or (3, offset in ``lut``, offset in
    ``codes``, bytes a code, 0, 0) for an int column's, looked up at its codes
    (:func:`_look_up`; ``lut`` of ``fixed``'s dtype).
    Returns per group: bounded row counts, unit counts, each value
    measure's total (one row each) and the number of non-empty pairs."""
    spec, table, knobs = _prepared(
        measures, fixed_rows, null_rows, clamps, fused, (size, R, G, count_scale, group_scaling)
    )
    m = spec.shape[1]
    out = np.zeros((m + 3, size), dtype=np.int64)  # the values' rows, rows, units, some
    codes, lut = _lookups(codes, lut, fixed.dtype)
    _bound_units(
        _ro(starts),
        _ro(group),
        _ro(weight),
        _ro(fixed),
        _NO_FLOATS if floats is None else _ro(floats),
        codes,
        lut,
        table,
        _ro(nulls),
        _ro(np.ascontiguousarray(offsets, dtype=np.int64)),
        spec,
        knobs,
        out,
    )
    return out[m], out[m + 1], out[:m], out[m + 2]


def counting_order(codes: np.ndarray, size: int) -> np.ndarray:
    """The row indexes in order of ``codes`` (each in [0, size)), stably: a counting sort.
    Codes read as int32 (a store's are below 2^27 rows: 4 bytes a row, not 8)."""
    return _counting_order(_ro(np.ascontiguousarray(codes, dtype=np.int32)), int(size))


def row_sums(
    group: np.ndarray,
    weight: np.ndarray,
    fixed: np.ndarray,
    nulls: np.ndarray,
    measures: list[tuple[int, int, int, int, int, int]],
    fixed_rows: np.ndarray,
    null_rows: np.ndarray,
    size: int,
    clamps: list[tuple[int, int]] | None = None,
    floats: np.ndarray | None = None,
    fused: list[tuple[float, ...]] | None = None,
    codes: np.ndarray | None = None,
    lut: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Run the row-level kernel (``measures``, ``clamps``, ``floats``, ``fused``, ``codes``
    and ``lut`` as for :func:`bound_units`):
    per group, the kept rows and each value measure's total (one row each)."""
    spec, table, knobs = _prepared(measures, fixed_rows, null_rows, clamps, fused, (size,))
    m = spec.shape[1]
    out = np.zeros((m + 1, size), dtype=np.int64)  # the values' rows, then rows
    codes, lut = _lookups(codes, lut, fixed.dtype)
    _row_sums(
        _ro(group),
        _ro(weight),
        _ro(fixed),
        _NO_FLOATS if floats is None else _ro(floats),
        codes,
        lut,
        table,
        _ro(nulls),
        spec,
        knobs,
        out,
    )
    return out[m], out[:m]


#: kernels' packed arguments per program (:func:`_prepared`): a known shape's are built once
_PREPARED: dict[tuple[Any, ...], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
_PREPARED_MAX = 512


def _prepared(
    measures: list[tuple[int, int, int, int, int, int]],
    fixed_rows: np.ndarray,
    null_rows: np.ndarray,
    clamps: list[tuple[int, int]] | None,
    fused: list[tuple[float, ...]] | None,
    scalars: tuple[int | bool, ...],
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The kernel's packed read-only arguments: ``spec`` (the measures' rows, :data:`_ROWS`:
    kind, grid, centre, centre², scale, cap, clamp low and high, the slot of its computed
    fixed point in ``fused``'s table, its rows of ``fixed`` and ``nulls``), the table of
    distinct computed sources (:func:`_fused`) and ``knobs`` (``scalars`` padded to six, the
    block last). Kept per arguments (from the program and the store's layout, never a value):
    a known shape's are not built again (building and viewing ~20 small arrays was a
    quarter of a 20k-row pass)."""
    key = (
        tuple(measures), fixed_rows.tobytes(), null_rows.tobytes(),
        None if clamps is None else tuple(clamps), None if fused is None else tuple(fused),
        scalars, _BLOCK,
    )  # fmt: skip
    held = _PREPARED.get(key)
    if held is not None:
        return held
    m = len(measures)
    spec = np.empty((_ROWS, m), dtype=np.int64)
    spec[_KIND : _CAP + 1] = np.array(measures, dtype=np.int64).reshape(m, 6).T
    spec[_LOW], spec[_HIGH] = _bounds(clamps, m)
    table, spec[_SLOT] = _fused(fused, m)
    spec[_FIXED_ROW], spec[_NULL_ROW] = fixed_rows, null_rows
    knobs = np.zeros(6, dtype=np.int64)
    knobs[: len(scalars)] = [int(x) for x in scalars]
    knobs[5] = _BLOCK
    held = (_ro(spec), _ro(table), _ro(knobs))
    if len(_PREPARED) >= _PREPARED_MAX:
        _PREPARED.clear()
    _PREPARED[key] = held
    return held


def _bounds(clamps: list[tuple[int, int]] | None, m: int) -> tuple[np.ndarray, np.ndarray]:
    """Per measure its clamp's low and high (the whole int64 range where none)."""
    pairs = clamps if clamps is not None else [(-_LARGEST - 1, _LARGEST)] * m
    both = np.array(pairs, dtype=np.int64).reshape(m, 2)
    return np.ascontiguousarray(both[:, 0]), np.ascontiguousarray(both[:, 1])


def _fused(fused: list[tuple[float, ...]] | None, m: int) -> tuple[np.ndarray, np.ndarray]:
    """The distinct sources of ``fused`` as rows (source, row, g, a, b, W) of float64 (one
    row of zeros where none: computes nothing) and per measure its source's row there, -1
    where it reads ``fixed``: two measures of one fixed-point row (a SUM and AVG's sum, the
    bias measures' cut) share one computed block."""
    sources: list[tuple[float, ...]] = []
    slots = np.full(m, -1, dtype=np.int64)
    for j, entry in enumerate(fused or ()):
        if entry:
            if entry not in sources:
                sources.append(entry)
            slots[j] = sources.index(entry)
    table = np.zeros((max(len(sources), 1), 6), dtype=np.float64)
    for i, entry in enumerate(sources):
        table[i, : len(entry)] = entry
    return table, slots


def fused_values(
    floats: np.ndarray | None,
    fused: list[tuple[float, ...]],
    rows: int,
    codes: np.ndarray | None = None,
    lut: np.ndarray | None = None,
) -> np.ndarray:
    """Each ``fused`` source's value on every row (int64, one row each, in order: each a
    distinct source): what the passes compute in place of a row of fixed points (tests
    compare them)."""
    out = np.zeros((len(fused), rows), dtype=np.int64)
    table, _ = _fused(fused, len(fused))
    codes, lut = _lookups(codes, lut, lut.dtype if lut is not None else np.int64)
    _fused_values(_NO_FLOATS if floats is None else _ro(floats), codes, lut, _ro(table), out)
    return out


def _lookups(
    codes: np.ndarray | None, lut: np.ndarray | None, dtype: Any
) -> tuple[np.ndarray, np.ndarray]:
    """The int columns' code bytes and tables of fixed points (:func:`_look_up`), dummies
    where none: the table of ``dtype`` (a kernel's fixed points' own: one compiled signature
    each, as without a table)."""
    if codes is None or len(codes) == 0:
        codes = _NO_CODES
    if lut is None or len(lut) == 0:
        lut = _no_lut(np.dtype(dtype))
    if lut.dtype != dtype:
        raise TypeError("a table of fixed points has its rows' dtype")
    return _ro(codes), _ro(lut)


def _no_lut(dtype: np.dtype) -> np.ndarray:
    """A table of fixed points of ``dtype`` standing for none (read-only, one per dtype)."""
    held = _NO_LUTS.get(dtype)
    if held is None:
        held = _NO_LUTS[dtype] = _ro(np.zeros(1, dtype=dtype))
    return held


# the dummies standing for no float columns, no int columns' codes, no tables (read-only)
_NO_FLOATS = _ro(np.zeros((1, 1), dtype=np.float64))
_NO_CODES = _ro(np.zeros(8, dtype=np.uint8))
_NO_LUTS: dict[np.dtype, np.ndarray] = {}
