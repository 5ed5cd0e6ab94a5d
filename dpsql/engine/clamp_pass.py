"""The default clamp's histogram as one pass over a table's in-memory store.

A SUM/AVG/VAR of a column whose policy states no ``clip`` is clamped to a range chosen from a
DP histogram of |x| (dpsql.service.bounds, kind "clip"), bought by the first such query per
analyst, column and data version. Its SQL (dpsql.lower.compile.clamp_histogram_query) keeps, per
privacy unit, the R non-NULL rows of smallest keyed hash ``HASH(stored columns..., secret)``
with a window over the whole table: at 10M rows ~8 s of CPU and 1.4 GiB beside the store. Where
the table's store is held (dpsql.engine.columnar: its rows clustered by unit), the same counts
are one pass here, in chunks of whole units:

- each row's keyed hash is DuckDB's own ``HASH`` recomputed from the stored values: a value's
  hash is MurmurHash64 of its bits (a DOUBLE's -0.0 and NaN made canonical first, a DATE's
  int32 day number zero-extended), NULL's is a constant, the arguments are combined left to
  right as ``((h ^ h >> 32) * K) ^ next``; a text value's hash is asked of DuckDB once per
  distinct value (its string hash is not reimplemented here);
- each row's bin is the SQL's expression, operation for operation: clamp to the declared
  range (NaN to the upper bound, as DuckDB orders it), |x| capped at M, 0 below s, else
  ``floor(ln(a / s) / ln r) + 1`` capped at the last bin;
- per unit, its non-NULL rows within R all count; a unit over R counts the R of smallest
  hash (unsigned, as DuckDB orders UBIGINT), ties being identical rows (same bin) but for a
  64-bit collision.

So the counts are the SQL's, integer for integer, for the same secret (tests/test_clamp_pass.py
compares both). That rests on DuckDB's hash and arithmetic, which a DuckDB version could change:
before its first use in a process the pass is checked against the engine's own SQL on probe
rows of the table's column types (NULLs, NaN, -0.0, infinities, bin edges and the values one
ulp either side) built from literals, never from data; on any difference the SQL runs instead
(logged for the operator). Which path runs is decided by whether a store is ready and that
probe, never by the data's values; the pass visits every row of every unit (a unit over R sorts
its rows' hashes, as the SQL's window sorts them), so its time depends on the table, as the
SQL's does (docs/threat_model.md, "Column programs").
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
from sqlglot import exp

from dpsql.engine import kernel_readiness
from dpsql.engine.api import EngineResult
from dpsql.errors import OperationalError
from dpsql.lower.builders import (
    alias,
    date_literal,
    is_null,
    policy_column,
    select,
    subquery,
    unnest_parameter,
)
from dpsql.lower.row_values import internal_name, number
from dpsql.plan.clamp_spec import ClampHistogram

_log = logging.getLogger("dpsql.engine")

_jit: Any
try:  # pragma: no cover - exercised where numba is installed (pyproject: a dependency)
    import numba

    _jit = numba.njit(cache=True, nogil=True, error_model="numpy")
except ImportError:  # pragma: no cover
    _jit = None

#: DuckDB's hash of NULL (HashOp::NULL_HASH) and the multiplier of its MurmurHash64 and of its
#: combining step
NULL_HASH = 0xBF58476D1CE4E5B9
_MURMUR = 0xD6E8FEB86659FD93
#: how a column's values are hashed: an int64 (BIGINT, BOOLEAN as 0/1), a double's bits, a
#: date's int32 day number, a text value's code into its distinct values' hashes
INT, FLOAT, DATE, TEXT = 0, 1, 2, 3
_MODES = {"int": INT, "bool": INT, "float": FLOAT, "date": DATE, "text": TEXT}
_EXACT = 2**53
#: rows per chunk (whole units): the pass's own memory is ~20 bytes a chunk row
_CHUNK = 1 << 20


def _ro(array: np.ndarray) -> np.ndarray:
    """A read-only view: every input reaches a kernel read-only (one numba signature each,
    compiled once, cached on disk; dpsql.engine.clustered._ro)."""
    view = array.view()
    view.flags.writeable = False
    return view


def available() -> bool:
    return _jit is not None


# -- the kernels ------------------------------------------------------------------------------


def _murmur(x: Any) -> Any:  # pragma: no cover - compiled
    x ^= x >> np.uint64(32)
    x *= np.uint64(_MURMUR)
    x ^= x >> np.uint64(32)
    x *= np.uint64(_MURMUR)
    x ^= x >> np.uint64(32)
    return x


def _mix(  # pragma: no cover - compiled
    h: np.ndarray,
    keys: np.ndarray,
    nulls: np.ndarray,
    mode: int,
    table: np.ndarray,
    first: bool,
) -> None:
    """Fold one column into the rows' running hashes ``h`` (``first``: start them): each
    value's hash by ``mode``, NULL's constant, combined as DuckDB's CombineHashScalar."""
    for i in range(h.shape[0]):
        if nulls[i]:
            e = np.uint64(NULL_HASH)
        else:
            k = keys[i]
            if mode == 1:  # DOUBLE: -0.0 as 0.0, every NaN as the quiet NaN
                if k == np.uint64(0x8000000000000000):
                    k = np.uint64(0)
                elif (k & np.uint64(0x7FF0000000000000)) == np.uint64(0x7FF0000000000000) and (
                    k & np.uint64(0x000FFFFFFFFFFFFF)
                ) != np.uint64(0):
                    k = np.uint64(0x7FF8000000000000)
                e = _murmur(k)
            elif mode == 2:  # DATE: its int32 day number, zero-extended
                e = _murmur(k & np.uint64(0xFFFFFFFF))
            elif mode == 3:
                e = table[np.int64(k)]
            else:
                e = _murmur(k)
        if first:
            h[i] = e
        else:
            a = h[i]
            a ^= a >> np.uint64(32)
            a *= np.uint64(_MURMUR)
            h[i] = a ^ e


def _mix_hash(h: np.ndarray, e: Any) -> None:  # pragma: no cover - compiled
    """Fold one constant's hash ``e`` (the secret's) into every row's running hash."""
    for i in range(h.shape[0]):
        a = h[i]
        a ^= a >> np.uint64(32)
        a *= np.uint64(_MURMUR)
        h[i] = a ^ e


def _bin_floats(  # pragma: no cover - compiled
    values: np.ndarray,
    lower: float,
    upper: float,
    maximum: float,
    smallest: float,
    log_ratio: float,
    last: int,
    out: np.ndarray,
) -> None:
    """The bin of each DOUBLE as the SQL computes it (a NULL's is never read)."""
    for i in range(values.shape[0]):
        x = values[i]
        if x < lower:
            x = lower
        elif x > upper or np.isnan(x):  # DuckDB: NaN above every number
            x = upper
        out[i] = _bin_of(x, maximum, smallest, log_ratio, last)


def _bin_ints(  # pragma: no cover - compiled
    values: np.ndarray,
    lower: float,
    upper: float,
    maximum: float,
    smallest: float,
    log_ratio: float,
    last: int,
    out: np.ndarray,
) -> None:
    """The bin of each BIGINT: clamped to the bounds (below 2^53 in magnitude, so the
    comparisons and the value kept are exact), then CAST AS DOUBLE."""
    for i in range(values.shape[0]):
        v = values[i]
        if v < lower:
            x = lower
        elif v > upper:
            x = upper
        else:
            x = np.float64(v)
        out[i] = _bin_of(x, maximum, smallest, log_ratio, last)


def _bin_of(  # pragma: no cover - compiled
    x: float, maximum: float, smallest: float, log_ratio: float, last: int
) -> Any:
    a = min(abs(x), maximum)
    if a < smallest:
        return 0
    return min(last, np.int64(math.floor(math.log(a / smallest) / log_ratio)) + 1)


def _count_units(  # pragma: no cover - compiled
    starts: np.ndarray,
    h: np.ndarray,
    bins: np.ndarray,
    nulls: np.ndarray,
    R: int,
    counts: np.ndarray,
) -> None:
    """Per unit (rows ``starts[u]`` .. ``starts[u + 1]``, relative to the chunk), the bins of
    its non-NULL rows: all of them within R, else the R of smallest hash."""
    buf = np.empty(0, dtype=np.uint64)
    where = np.empty(0, dtype=np.int64)
    for u in range(starts.shape[0] - 1):
        lo, hi = starts[u], starts[u + 1]
        n = 0
        for i in range(lo, hi):
            if not nulls[i]:
                n += 1
        if n <= R:
            for i in range(lo, hi):
                if not nulls[i]:
                    counts[bins[i]] += 1
            continue
        if buf.shape[0] < n:
            buf = np.empty(2 * n, dtype=np.uint64)
            where = np.empty(2 * n, dtype=np.int64)
        q = 0
        for i in range(lo, hi):
            if not nulls[i]:
                buf[q] = h[i]
                where[q] = i
                q += 1
        order = np.argsort(buf[:n], kind="mergesort")
        for k in range(R):
            counts[bins[where[order[k]]]] += 1


if _jit is not None:
    _murmur = numba.njit(inline="always")(_murmur)
    _bin_of = numba.njit(inline="always", error_model="numpy")(_bin_of)
    _mix = _jit(_mix)
    _mix_hash = _jit(_mix_hash)
    _bin_floats = _jit(_bin_floats)
    _bin_ints = _jit(_bin_ints)
    _count_units = _jit(_count_units)


def warm_up() -> None:
    """Compile the kernels now (or load them from numba's cache), on tiny arrays, so that no
    first query pays for it (dpsql.engine.columnar.warm_up calls this)."""
    if not available():
        return
    h = np.zeros(2, dtype=np.uint64)
    keys = _ro(np.zeros(2, dtype=np.uint64))
    nulls = _ro(np.zeros(2, dtype=np.bool_))
    _mix(h, keys, nulls, INT, keys, True)
    _mix_hash(h, np.uint64(1))
    bins = np.zeros(2, dtype=np.int64)
    _bin_floats(_ro(np.zeros(2)), 0.0, 1.0, 1.0, 0.5, 0.5, 1, bins)
    _bin_ints(_ro(np.zeros(2, dtype=np.int64)), 0.0, 1.0, 1.0, 0.5, 0.5, 1, bins)
    starts = _ro(np.array([0, 2], dtype=np.int64))
    _count_units(starts, _ro(h), _ro(bins), nulls, 1, np.zeros(2, dtype=np.int64))


# -- the pass ---------------------------------------------------------------------------------


def run(
    stores: dict[str, Any], versions: Any, con: Any, compiled: Any, handle: Any
) -> EngineResult | None:
    """A default clamp's histogram query (``compiled.clamp`` set) as one pass over its table's
    store in ``stores`` (DuckDBEngine.columns), the same counts as its SQL for the same
    secret; None: run the SQL (not such a query, no store ready or a stale one, or a DuckDB
    whose hash or arithmetic the pass does not reproduce). Decided before any value is read.
    ``con``: the engine's connection (a cursor of its own asks DuckDB for the probe's rows and
    each distinct text value's hash)."""
    spec = compiled.clamp
    if spec is None:
        return None
    store = stores.get(spec.table)
    if store is None or store.version != (versions.get(spec.table) or ""):
        return None  # none yet, or stale (DuckDBEngine._run_columns starts the new build)
    if not runnable(store, spec):
        return None
    cursor = con.cursor()
    try:
        if not agrees(cursor, spec):
            return None
        if handle is not None and handle.interrupted:
            raise OperationalError("query cancelled", sqlstate="57014")

        def text_hashes(name: str, labels: Any) -> np.ndarray:
            """DuckDB's hash of each distinct value, kept with the store (labels only)."""
            key = ("text hashes", name)
            held = store.masks.get(key)
            if held is None:
                held = store.masks.setdefault(key, label_hashes(cursor, labels))
            return held

        return result(counts(store, spec, compiled.secret, text_hashes))
    except OperationalError:
        raise
    except Exception:  # a bug, never data: the same uniform failure as an engine error
        raise OperationalError("engine error: ClampPass", hint="please report this query") from None
    finally:
        cursor.close()


def runnable(store: Any, spec: ClampHistogram) -> bool:
    """Whether ``store`` (a dpsql.engine.columnar.ColumnarTable) holds what the pass reads:
    every stored column, clustered by the spec's unit. From the policy and the store's
    shape only."""
    if not available() or not kernel_readiness.ready() or spec.kind not in ("int", "float"):
        return False  # no kernel, or not loaded yet (its SQL rather than wait), or a kind not held
    if max(abs(spec.lower), abs(spec.upper)) >= _EXACT:
        return False  # a bound a DOUBLE does not hold exactly: the SQL's casts, not mirrored
    if not all(name in store.columns for name, _ in spec.stored):
        return False
    if spec.unit is None:
        return True
    return store.unit == spec.unit and store.unit_starts is not None


def counts(store: Any, spec: ClampHistogram, secret: int, text_hashes: Any) -> np.ndarray:
    """The histogram's exact counts (one per bin) over ``store``; ``text_hashes(column,
    labels)`` gives DuckDB's hash of each distinct text value (uint64, in the labels' order).
    In chunks of whole units: the pass's own arrays are a chunk's, not the table's."""
    rows = store.rows
    tables = _text_tables(store, spec, text_hashes)
    out = np.zeros(spec.bins, dtype=np.int64)
    if spec.unit is None:
        nulls = store.columns[spec.column].nulls
        for lo in range(0, rows, _CHUNK):
            hi = min(rows, lo + _CHUNK)
            bins = _row_bins(store, spec, lo, hi)
            out += np.bincount(bins[~nulls[lo:hi]], minlength=spec.bins)
        return out
    starts = store.unit_starts
    for first, last in _chunks(starts):
        lo, hi = int(starts[first]), int(starts[last])
        h = _row_hashes(store, spec, secret, tables, lo, hi)
        bins = _row_bins(store, spec, lo, hi)
        rel = np.ascontiguousarray(starts[first : last + 1] - lo, dtype=np.int64)
        nulls = _ro(store.columns[spec.column].nulls[lo:hi])
        _count_units(_ro(rel), _ro(h), _ro(bins), nulls, spec.rows, out)
    return out


def _text_tables(store: Any, spec: ClampHistogram, text_hashes: Any) -> dict[str, np.ndarray]:
    """Per text column, DuckDB's hash of each code's value, NULL's last (the NULL code)."""
    return {
        name: np.append(
            np.asarray(text_hashes(name, store.columns[name].categories), dtype=np.uint64),
            np.uint64(NULL_HASH),
        )
        for name, kind in spec.stored
        if kind == "text"
    }


def _scalar_hash(value: int) -> np.uint64:
    """MurmurHash64 of a non-negative integer literal (INTEGER or BIGINT: the same bits)."""
    m = (1 << 64) - 1
    x = value & m
    x ^= x >> 32
    x = (x * _MURMUR) & m
    x ^= x >> 32
    x = (x * _MURMUR) & m
    x ^= x >> 32
    return np.uint64(x)


def _chunks(starts: np.ndarray) -> list[tuple[int, int]]:
    """Ranges of units (first, past the last) of about _CHUNK rows each (a larger unit
    alone)."""
    out = []
    units = len(starts) - 1
    first = 0
    while first < units:
        last = int(np.searchsorted(starts, int(starts[first]) + _CHUNK, side="right")) - 1
        last = min(max(last, first + 1), units)
        out.append((first, last))
        first = last
    return out


def result(counted: np.ndarray) -> EngineResult:
    """The SQL's result shape: one row (b, c) per non-empty bin."""
    bins = np.flatnonzero(counted)
    return EngineResult([(int(b),) for b in bins], [[int(counted[b]) for b in bins]], ("BIGINT",))


# -- the probe: is DuckDB's SQL what the pass computes? ---------------------------------------

_checked: dict[tuple[Any, ...], bool] = {}
_checked_lock = threading.Lock()

_PROBES: dict[str, list[Any]] = {
    "int": [0, 1, -1, 7, -7, 2**31 - 1, 2**31, -(2**31), 2**40 + 3, -(2**62), 2**63 - 1, None],
    "float": [
        0.0,
        -0.0,
        1.5,
        -2.25,
        math.nan,
        -math.nan,
        math.inf,
        -math.inf,
        5e-324,
        1e300,
        -1e-300,
        None,
    ],
    "date": [0, 1, -1, 19_000, -719_528, 2**31 - 1, -(2**31 - 1), None],
    "bool": [True, False, None],
    "text": ["", "a", "émile", "zz top", "x" * 40, None],
}
_SQL = {"int": "BIGINT", "float": "DOUBLE", "date": "INT", "bool": "BOOLEAN",
        "text": "VARCHAR"}  # fmt: skip


def agrees(con: Any, spec: ClampHistogram) -> bool:
    """Whether the pass computes this DuckDB's keyed hash and bins on probe rows of the spec's
    column types (literals only: no data is read), once per process and shape."""
    key = (spec.stored, spec.kind, spec.lower, spec.upper, spec.maximum, spec.smallest,
           spec.log_ratio, spec.bins, spec.bin_of)  # fmt: skip
    with _checked_lock:
        known = _checked.get(key)
    if known is not None:
        return known
    try:
        ok = _probe(con, spec)
    except Exception as exc:  # a DuckDB without a function used here: the SQL runs
        _log.warning("clamp histogram pass not used (%s): its SQL runs", type(exc).__name__)
        ok = False
    if not ok:
        _log.warning("clamp histogram pass differs from this DuckDB's SQL: its SQL runs")
    with _checked_lock:
        _checked[key] = ok
    return ok


def _edges(spec: ClampHistogram) -> list[float]:
    """Every bin edge and the doubles within 2 ulps of it, both signs, and the bounds."""
    tops = [spec.smallest * math.exp(spec.log_ratio * i) for i in range(spec.bins)]
    out: list[float] = []
    for e in [*tops, spec.maximum, spec.smallest, float(spec.lower), float(spec.upper)]:
        v = e
        for _ in range(3):
            out += [v, -v]
            v = math.nextafter(v, math.inf)
        v = e
        for _ in range(2):
            v = math.nextafter(v, -math.inf)
            out += [v, -v]
    return out


def _probe(con: Any, spec: ClampHistogram) -> bool:
    """Run the SQL's keyed hash and bin on probe rows and the pass's on the same values."""
    values: list[Any] = [*_edges(spec), math.nan, math.inf, -math.inf, 0.0, -0.0, None]
    if spec.kind == "int":
        near = {
            int(v) + d
            for v in values
            if v is not None and math.isfinite(v)
            for d in (-1, 0, 1)
            if abs(int(v) + d) < 2**63
        }
        values = [*sorted(near), None, 2**63 - 1, -(2**63) + 1]
    n = max(len(values), *(len(v) for v in _PROBES.values()))
    columns: dict[str, list[Any]] = {}
    for name, kind in spec.stored:
        base = values if name == spec.column else _PROBES[kind]
        columns[name] = [base[i % len(base)] for i in range(n)]
    secret = 0x2545F4914F6CDD1D
    fetched = con.execute(
        _probe_query(spec, secret).sql(dialect="duckdb"), [columns[name] for name, _ in spec.stored]
    ).fetchall()
    want_h = np.array([r[0] for r in fetched], dtype=np.uint64)
    want_b = [None if r[2] else int(r[1]) for r in fetched]
    store = _probe_store(columns, spec)
    tables = _text_tables(store, spec, lambda _, labels: label_hashes(con, labels))
    got_h = _row_hashes(store, spec, secret, tables, 0, n)
    got_b = _row_bins(store, spec, 0, n)
    nulls = store.columns[spec.column].nulls
    got = [None if nulls[i] else int(got_b[i]) for i in range(n)]
    return bool(np.array_equal(got_h, want_h)) and got == want_b


def _probe_query(spec: ClampHistogram, secret: int) -> exp.Select:
    """The SQL's keyed hash, bin (the compiler's, as the spec carries it) and NULL flag of
    the probe rows: one unnest of each column's parameter, zipped; a date from its day number
    (its infinities included)."""
    cells: list[exp.Expression] = []
    typed: list[exp.Expression] = []
    for i, (name, kind) in enumerate(spec.stored):
        cells.append(alias(unnest_parameter(_SQL[kind], i + 1), f"p{i}"))
        cell: exp.Expression = internal_name(f"p{i}")
        if kind == "date":
            # DuckDB's day numbers of its infinities (columnar.DATE_INFINITY)
            infinite = [(2**31 - 1, "infinity"), (-(2**31 - 1), "-infinity")]
            cell = exp.Case(
                ifs=[
                    exp.If(
                        this=exp.EQ(this=cell.copy(), expression=number(day)),
                        true=date_literal(text),
                    )
                    for day, text in infinite
                ],
                default=exp.Add(this=date_literal("1970-01-01"), expression=cell.copy()),
            )
        typed.append(alias(cell, name, quoted=True))
    hashed = [policy_column(name) for name, _ in spec.stored]
    items = [
        exp.Anonymous(this="HASH", expressions=[*hashed, number(secret)]),
        spec.bin_of.copy(),  # the compiler's bin (dpsql.lower.compile), as the spec carries it
        is_null(policy_column(spec.column)),
    ]
    rows = select(typed, subquery(exp.Select(expressions=cells), None))
    return select(items, subquery(rows, None))


def label_hashes(con: Any, labels: Any) -> np.ndarray:
    """DuckDB's hash of each text value, in order (one query)."""
    if not labels:
        return np.zeros(0, dtype=np.uint64)
    row = con.execute("SELECT list_transform($1::VARCHAR[], lambda v: hash(v))", [list(labels)])
    fetched = row.fetchone()
    return np.array(fetched[0], dtype=np.uint64)


@dataclass(frozen=True)
class _ProbeColumn:
    values: np.ndarray
    nulls: np.ndarray
    codes: np.ndarray | None
    categories: tuple[Any, ...]

    def value_slice(self, lo: int, hi: int) -> np.ndarray:
        return self.values[lo:hi]


@dataclass(frozen=True)
class _ProbeStore:
    rows: int
    columns: dict[str, _ProbeColumn]


def _probe_store(columns: dict[str, list[Any]], spec: ClampHistogram) -> _ProbeStore:
    held = {}
    for name, kind in spec.stored:
        raw = columns[name]
        nulls = np.array([v is None for v in raw], dtype=np.bool_)
        codes = None
        cats: tuple[Any, ...] = ()
        if kind == "text":
            cats = tuple(sorted({v for v in raw if v is not None}))
            codes = np.array([len(cats) if v is None else cats.index(v) for v in raw])
            values = codes
        elif kind == "float":
            values = np.array([0.0 if v is None else v for v in raw], dtype=np.float64)
        else:
            values = np.array([0 if v is None else int(v) for v in raw], dtype=np.int64)
        held[name] = _ProbeColumn(values, nulls, codes, cats)
    return _ProbeStore(len(next(iter(columns.values()))), held)


def _row_hashes(
    store: Any,
    spec: ClampHistogram,
    secret: int,
    tables: dict[str, np.ndarray],
    lo: int,
    hi: int,
) -> np.ndarray:
    """Rows ``lo`` .. ``hi``'s keyed hashes: HASH(stored columns..., secret) as DuckDB's."""
    h = np.empty(hi - lo, dtype=np.uint64)
    none = np.zeros(1, dtype=np.uint64)
    for j, (name, kind) in enumerate(spec.stored):
        col = store.columns[name]
        src = col.codes[lo:hi] if kind == "text" else col.value_slice(lo, hi)
        dtype = np.float64 if kind == "float" else np.int64
        keys = np.ascontiguousarray(src, dtype=dtype).view(np.uint64)
        table = tables.get(name, none)
        _mix(h, _ro(keys), _ro(col.nulls[lo:hi]), _MODES[kind], _ro(table), j == 0)
    _mix_hash(h, _scalar_hash(secret))
    return h


def _row_bins(store: Any, spec: ClampHistogram, lo: int, hi: int) -> np.ndarray:
    """Rows ``lo`` .. ``hi``'s bins (a NULL's is computed on its placeholder, never read)."""
    values = store.columns[spec.column].value_slice(lo, hi)
    out = np.empty(hi - lo, dtype=np.int64)
    if spec.kind == "float":
        _bin_floats(
            _ro(np.ascontiguousarray(values, dtype=np.float64)), float(spec.lower),
            float(spec.upper), spec.maximum, spec.smallest, spec.log_ratio, spec.bins - 1, out,
        )  # fmt: skip
    else:
        _bin_ints(
            _ro(np.ascontiguousarray(values, dtype=np.int64)), float(spec.lower),
            float(spec.upper),
            spec.maximum, spec.smallest, spec.log_ratio, spec.bins - 1, out,
        )  # fmt: skip
    return out
