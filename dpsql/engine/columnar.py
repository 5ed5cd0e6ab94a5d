"""A small table's columns in memory, and the column programs (dpsql.lower.local_plan) run on
them: the same exact integers as the plan's SQL, without DuckDB's per-query bind, optimise and
operator costs, which dominate on a few thousand rows.

Loaded once per data version from the engine's own typed table (so the values are DuckDB's,
after its casts), before the connection is sealed. Rows are kept in DuckDB's scan order; text
is held as codes into its sorted distinct values (Python's str order is Unicode code point
order, DuckDB's VARCHAR order is UTF-8 byte order: the same); a date as DuckDB's day number,
its infinities included. The load is total over every value of every declared type, and the
choices that shape a program's work beyond its own text (whether it runs, how it sums) are
made from the policy and the table's declared capacity, not from the values or the row count
(docs/threat_model.md, "Column programs").

Every step mirrors one of the SQL plan (dpsql.lower.compile): the WHERE in SQL's three-valued
logic with DuckDB's comparison rules (NaN equal to itself and above every number; a decimal
literal compared exactly with an integer column), the fixed-point value of each row, the
per-(unit, group) partials, rescaling at R/n and G/k truncated toward zero, the final sums.
Integers stay exact: a program runs only where its static bound (rows times the largest
scaled row value) fits 64 bits, and sums in floating point only below 2^53.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import datetime
import functools
import math
import operator
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from decimal import Decimal
from typing import Any

import numpy as np
from sqlglot import exp

from dpsql.engine import kernel_readiness
from dpsql.engine.api import EngineResult
from dpsql.engine.int_labels import IntLabels
from dpsql.frontend.simple_where import COMPARISONS, KEY_TYPES, iso_date
from dpsql.lower.builders import (
    alias,
    coalesce,
    count_star,
    create_temp_table_as,
    cte,
    day_number,
    distinct_values,
    drop_table,
    is_null,
    left_join,
    named_table,
    numbered,
    order_by,
    policy_column,
    select,
    table_ref,
    with_ctes,
)
from dpsql.lower.compile import render
from dpsql.lower.local_plan import ColumnProgram
from dpsql.lower.row_values import cast, internal_name, number
from dpsql.plan import bias
from dpsql.plan.fixed_point import fixed_point_bounds
from dpsql.plan.measure_kinds import MEASURE_KINDS
from dpsql.plan.values import Measure
from dpsql.policy import ColumnPolicy, TablePolicy

_EXACT_FLOAT = 2**53  # every integer below it is a float64, and so is every partial sum
_EXACT_INT = 2**62  # headroom under 2^63 for a product and a sum


@dataclass(frozen=True)
class Column:
    """One column: ``stored`` (int64, float64, bool, days for a date, and for text its
    ``codes``), ``nulls`` (True where NULL), and for grouping (text, int and bool) ``codes``:
    each row's index into ``labels``, its distinct values in order and None (NULL) last.

    A store's int column (:func:`load_clustered`) holds its codes only (``stored`` None, codes
    of 1, 2 or 4 bytes): its values are its labels at its codes, gathered by range where a
    pass reads them (:meth:`value_slice`), whole only where a program of the numpy fallback
    reads ``values`` (then kept)."""

    kind: str
    stored: np.ndarray | None
    nulls: np.ndarray
    held_codes: np.ndarray | None = None
    labels: Sequence[Any] = ()
    # a store's int unit column (:func:`cluster`): its rows clustered by code, so its codes
    # are runs, (each run's first row and the end, each run's code): one int a unit, not a
    # code a row
    runs: tuple[np.ndarray, np.ndarray] | None = None

    @property
    def categories(self) -> Sequence[Any]:
        """The distinct non-NULL values, in order (a text column's codes index them)."""
        return self.labels[:-1]

    @property
    def coded(self) -> bool:
        """Whether the column has codes (text, int and bool), without making them."""
        return self.held_codes is not None or self.runs is not None

    @functools.cached_property
    def codes(self) -> np.ndarray | None:
        """Every row's code (made from the runs, and kept, the first time it is read whole:
        only a program of the numpy fallback or a WHERE on the unit column reads it so)."""
        if self.runs is None:
            return self.held_codes
        whole = self.code_slice(0, int(self.runs[0][-1]))
        whole.setflags(write=False)
        return whole

    def code_slice(self, lo: int, hi: int) -> np.ndarray:
        """Rows ``lo`` .. ``hi``'s codes."""
        if self.runs is None:
            assert self.held_codes is not None
            return self.held_codes[lo:hi]
        starts, run_codes = self.runs
        first = int(np.searchsorted(starts, lo, side="right")) - 1
        last = int(np.searchsorted(starts, hi, side="left"))
        lengths = np.diff(np.clip(starts[first : last + 1], lo, hi))
        return np.repeat(run_codes[first:last], lengths)

    @functools.cached_property
    def values(self) -> np.ndarray:
        """Every row's value (a NULL's is a placeholder: 0 where gathered from the codes)."""
        if self.stored is not None:
            return self.stored
        whole = self.by_code[self.codes]
        whole.setflags(write=False)
        return whole

    def value_slice(self, lo: int, hi: int) -> np.ndarray:
        """Rows ``lo`` .. ``hi``'s values (a view where they are stored)."""
        if self.stored is not None:
            return self.stored[lo:hi]
        return self.by_code[self.code_slice(lo, hi)]

    @functools.cached_property
    def by_code(self) -> np.ndarray:
        """Each code's value (int64: an int column's labels; NULL's code 0): a test on the
        values is the same test on this, read at each row's code."""
        if isinstance(self.labels, IntLabels):
            return np.append(self.labels.values, 0)
        return np.array([*self.labels[:-1], 0], dtype=np.int64)


@dataclass(frozen=True)
class ColumnarTable:
    """``capacity``: the most rows the table may have (public, declared by the engine): the
    exactness bounds and summing paths of a program are decided from it and the program,
    never from ``rows``, so one unit's rows cannot switch them."""

    name: str
    version: str
    rows: int
    columns: dict[str, Column]
    capacity: int
    # a store (:func:`cluster`): rows clustered by this unit column, its units' first rows
    # (and the end), and per bounded numeric column one row of ``fixed`` each for its fixed
    # point at its declared bounds and at a cut measure's widened ones, and for a clamped
    # measure's excess (``fixed_index``: (role, name, lo, hi) -> row); ``nulls`` one row per
    # column (name -> row): what the compiled pass (dpsql.engine.clustered) reads
    unit: str | None = None
    unit_starts: np.ndarray | None = None
    fixed_rows: FixedRows | None = None
    fixed_index: dict[tuple[str, str, int, int], int] | None = None
    nulls: np.ndarray | None = None
    nulls_index: dict[str, int] | None = None
    # (unit, domain keys) -> the rows a per-unit program may read whatever its WHERE
    masks: dict[Any, np.ndarray] = field(default_factory=dict, compare=False, repr=False)

    @property
    def fixed(self) -> np.ndarray | None:
        """Every row of ``fixed`` (each computed now if not yet: :class:`FixedRows`)."""
        if self.fixed_rows is None:
            return None
        return self.fixed_rows.filled(range(len(self.fixed_rows.matrix)))


class FixedRows:
    """A store's fixed-point rows (one per (role, column, lo, hi) of ``fixed_index``), each
    computed the first time a program reads it: a column no query sums costs no memory (the
    matrix is allocated whole but the system maps a row's pages when it is written). Which
    rows are filled depends on the programs run, never on values; a row is the same integers
    whenever it is filled (each row's value depends on that row of the column alone)."""

    def __init__(
        self, matrix: np.ndarray, compute: list[Callable[[int, int], np.ndarray]],
        nulls: list[np.ndarray], floats: np.ndarray | None = None,
        fused: list[tuple[float, ...] | None] | None = None,
        codes: np.ndarray | None = None,
        lookups: list[tuple[int, int, Callable[[], np.ndarray]] | None] | None = None,
    ) -> None:  # fmt: skip
        self.matrix = matrix
        # the float columns, one row each, and per row of ``matrix`` the (source, row of
        # ``floats``, g, a, b, W) from which the compiled pass computes that row's values
        # itself (dpsql.engine.clustered._fill: the same integers), None where it reads
        # the row: a float column's rows are never filled for the pass (~4 bytes a row each)
        self.floats = floats
        self.fused = fused if fused is not None else [None] * len(compute)
        # nor an int column's: ``codes`` holds the int columns' codes (the store's own,
        # :func:`_code_arena`), and per row ``lookups`` its table's offset and length in
        # ``lut`` and its value at each of its column's codes (the same function of the same
        # value as its filled row), which the pass reads at each row's code instead
        # (clustered._look_up; ``fused`` (3, offset, ...)): the column's domain long, not a
        # row of the table, computed the first time a pass reads it (:meth:`looked_up`)
        self.codes = codes
        self._lookups = lookups if lookups is not None else [None] * len(compute)
        size = max([at + n for at, n, _ in filter(None, self._lookups)] or [0])
        self.lut = np.empty(size, dtype=matrix.dtype)
        self._looked = [False] * len(compute)
        self._compute = compute
        self._nulls = nulls
        self._done = [False] * len(compute)
        self._lock = threading.Lock()
        self._view = matrix.view()
        self._view.flags.writeable = False

    def looked_up(self, rows: Any) -> None:
        """The tables of those of ``rows`` that are an int column's, computed if not yet."""
        wanted = [i for i in rows if self._lookups[i] is not None and not self._looked[i]]
        if wanted:
            with self._lock, np.errstate(all="ignore"):
                for i in wanted:
                    entry = self._lookups[i]
                    if self._looked[i] or entry is None:
                        continue
                    at, n, compute = entry
                    self.lut[at : at + n] = compute()
                    self._looked[i] = True

    def filled(self, rows: Any) -> np.ndarray:
        """The matrix (read-only) with ``rows`` computed."""
        wanted = [i for i in rows if not self._done[i]]
        if wanted:
            with self._lock, np.errstate(all="ignore"):
                for i in wanted:
                    if self._done[i]:
                        continue
                    # in chunks of rows: a chunk's float64 temporaries are 8 MiB, not 5 x 80
                    # MiB at 10M rows
                    total = self.matrix.shape[1]
                    for lo in range(0, total, _FILL_ROWS):
                        hi = min(total, lo + _FILL_ROWS)
                        self.matrix[i, lo:hi] = np.where(
                            self._nulls[i][lo:hi], 0, self._compute[i](lo, hi)
                        )
                    self._done[i] = True
        return self._view


class NotRunnable(Exception):
    """This statement's literals are outside what the evaluator mirrors exactly: run its SQL.
    Raised before any value is read."""


def load(con: Any, table: TablePolicy, version: str, capacity: int) -> ColumnarTable:
    """The stored columns a program may read, from the engine's typed table of at most
    ``capacity`` rows (public: the engine's declared cap, dpsql.engine.duckdb_engine).

    Total: every value of every declared type has a representation here (:func:`_fetched`: a date is
    read as DuckDB's own day number, 'infinity' and '-infinity' included), so whether a table
    is held depends on the policy alone, never on a value one unit holds (issue 25, item 6:
    one 'infinity' date used to make this load fail and the table silently run its SQL, ~3x
    slower on every query). Nothing here catches an error: one that still happens (a bug,
    memory) fails the engine's start, where the operator sees it."""
    _keep_heap_pad()

    rows = _row_count(con, table.name)
    if rows > capacity:
        raise ValueError(f"{rows} rows, more than the declared {capacity}")
    readable = [c for c in table.columns.values() if c.expr is None and c.type in _KINDS]
    if not readable:
        return ColumnarTable(table.name, version, rows, {}, capacity)
    items = [alias(_fetched(c.type, policy_column(c.name)), c.name, quoted=True) for c in readable]
    fetched = con.execute(render(select(items, named_table(table.name)), "duckdb")).fetchnumpy()
    columns = {c.name: _column(c, fetched[c.name]) for c in readable}
    for column in columns.values():  # shared by every query and thread: read-only
        for array in (column.stored, column.nulls, column.codes):
            if array is not None:
                array.setflags(write=False)
    return ColumnarTable(table.name, version, rows, columns, capacity)


def load_clustered(
    con: Any,
    table: TablePolicy,
    version: str,
    capacity: int,
    fetching: Callable[[], None] | None = None,
) -> ColumnarTable:
    """:func:`load` then :func:`cluster`, for a large table: the same arrays, with the codes
    of text, int and bool columns computed by DuckDB (a join to each column's sorted distinct
    values, on all its threads) instead of numpy's ``unique`` (a sort per column, ~5 µs a row
    for text). Fetched by ranges of unit codes (:func:`_unit_ranges`) into arrays allocated
    once, each range clustered by a counting sort of its unit codes (no sort in DuckDB): the
    build's peak is the store plus one range's fetch. A text column's values are never
    fetched, only its codes. ``fetching``: called once the labels are read, before the rows
    are (the engine lowers its build instance's memory limit there)."""
    _keep_heap_pad()
    name = table.name
    rows = _row_count(con, name)
    if rows > capacity:
        raise ValueError(f"{rows} rows, more than the declared {capacity}")
    readable = [c for c in table.columns.values() if c.expr is None and c.type in _KINDS]
    if not readable:
        return cluster(ColumnarTable(table.name, version, rows, {}, capacity), table)
    labels: dict[str, Sequence[Any]] = {}
    keys: list[tuple[str, type]] = []  # what is fetched, and its dtype in the store
    unit = None  # the unit column's index in ``readable`` when it has codes
    for i, c in enumerate(readable):
        if c.type in ("text", "int", "bool"):
            labels[c.name] = _distinct(con, name, c.name, c.type)
            keys.append((f"__c{i}", code_dtype(len(labels[c.name]))))
            if c.name == table.privacy_unit:
                unit = i
        if c.type not in ("text", "int"):  # an int column's values: its labels at its codes
            dtype: type = {"float": np.float64, "bool": np.bool_}.get(c.type, np.int64)
            keys.append((f"__v{i}", dtype))
        keys.append((f"__n{i}", np.bool_))
    # an int unit's codes are kept as runs (cluster), made range by range: never a code a row
    as_runs = unit is not None and readable[unit].type == "int"
    # an int column's codes in one byte array (what the compiled pass looks its fixed points
    # up from: cluster, _code_arena)
    coded = {
        f"__c{i}": c.name for i, c in enumerate(readable)
        if c.type == "int" and not (as_runs and i == unit)
    }  # fmt: skip
    arena, code_at, views = _arena({key: (dtype, rows) for key, dtype in keys if key in coded})
    held: dict[str, np.ndarray] = {
        key: views[key] if key in coded else np.empty(rows, dtype=dtype)
        for key, dtype in keys
        if not key.startswith("__n") and dtype is not np.float64
        and not (as_runs and key == f"__c{unit}")
    }  # fmt: skip
    # the float columns, one row each of one matrix (what the compiled pass reads)
    wide = [key for key, dtype in keys if dtype is np.float64]
    floats = np.empty((len(wide), rows), dtype=np.float64)
    held.update({key: floats[k] for k, key in enumerate(wide)})
    # every column's NULLs, one row each of one matrix (what the compiled pass reads), zeros
    # (pages the system maps on write only) written where a fetched range has a NULL: a
    # column without any costs no memory
    nulls = np.zeros((len(readable), rows), dtype=np.bool_)
    held.update({f"__n{i}": nulls[i] for i in range(len(readable))})
    ranges = _unit_ranges(rows, unit, labels, readable)
    kept = _numbered_codes(con, name, readable, labels) if len(ranges) > 1 else None
    if fetching is not None:
        fetching()
    runs: list[tuple[np.ndarray, np.ndarray]] = []
    try:
        filled = _fetch_ranges(con, name, readable, labels, unit, ranges, kept, keys, held, runs)
    finally:  # (they go with the cursor anyway: an interrupted build may not drop them)
        for temporary in (kept or {}).values():
            with contextlib.suppress(Exception):
                con.execute(render(drop_table(table_ref(temporary)), "duckdb"))
    if filled != rows:
        raise ValueError("the table changed while its store was built")
    columns: dict[str, Column] = {}
    for i, c in enumerate(readable):
        codes = held.pop(f"__c{i}") if c.name in labels and not (as_runs and i == unit) else None
        missing = held.pop(f"__n{i}")
        if as_runs and i == unit:
            unit_runs = _joined_runs(runs, rows)
            columns[c.name] = Column(c.type, None, missing, None, labels[c.name], unit_runs)
            continue
        if c.type in ("text", "int"):
            stored = codes if c.type == "text" else None
            columns[c.name] = Column(c.type, stored, missing, codes, labels[c.name])
            continue
        values = held.pop(f"__v{i}")
        if c.type == "date":
            values[missing] = 0
        columns[c.name] = Column(c.type, values, missing, codes, labels.get(c.name, ()))
    table_ = ColumnarTable(table.name, version, rows, columns, capacity)
    at = {coded[key]: offset for key, offset in code_at.items()}
    return cluster(table_, table, nulls, floats, (arena, at))


def _joined_runs(
    runs: list[tuple[np.ndarray, np.ndarray]], rows: int
) -> tuple[np.ndarray, np.ndarray]:
    """The ranges' runs (``runs``, emptied) as one pair: every run's first row then the end
    (int64), and every run's code. Each piece is copied once into arrays allocated once and
    dropped as it is (concatenating, appending the end and casting made three copies of the
    starts: 240 MiB transient at 100M rows of 10M units)."""
    total = sum(len(first) for first, _ in runs)
    starts = np.empty(total + 1, dtype=np.int64)
    codes = np.empty(total, dtype=runs[0][1].dtype if runs else np.uint8)
    at = 0
    runs.reverse()
    while runs:
        first, code = runs.pop()
        starts[at : at + len(first)] = first
        codes[at : at + len(code)] = code
        at += len(first)
    starts[total] = rows
    return starts, codes


_CODE_SQL: dict[type, str] = {np.uint8: "UTINYINT", np.uint16: "USMALLINT", np.int32: "INT"}


def code_dtype(labels: int) -> type:
    """The narrowest dtype of codes into ``labels`` values (NULL's included): 1 byte a row
    for a domain of up to 256, 2 up to 65,536, else 4 (a store's memory; the arithmetic on
    codes is the same integers whatever their width)."""
    if labels <= 1 << 8:
        return np.uint8
    if labels <= 1 << 16:
        return np.uint16
    return np.int32


def _fetch_ranges(
    con: Any,
    name: str,
    readable: list[Any],
    labels: dict[str, Sequence[Any]],
    unit: int | None,
    ranges: list[tuple[int, int]],
    kept: dict[int, str] | None,
    keys: list[tuple[str, type]],
    held: dict[str, np.ndarray],
    runs: list[tuple[np.ndarray, np.ndarray]],
) -> int:
    """Fetch each range of units into the next rows of ``held`` (no ORDER BY: DuckDB's sort
    held every row a second time beside the fetched arrays; each range is clustered here by
    a counting sort of its unit codes). The unit's codes, where ``held`` has no row for them,
    appended to ``runs`` instead: per range its runs' first rows and codes (the ranges' codes
    ascend, so together they are the whole table's runs). Returns the rows filled."""
    rows = len(held[f"__n{len(readable) - 1}"])
    filled = 0
    for first, last in ranges:
        sql, params = _fetch_sql(name, readable, labels, unit, first, last, kept)
        fetched = dict(con.execute(sql, params).fetchnumpy())
        n = len(fetched[keys[0][0]]) if keys else 0
        if filled + n > rows:
            raise ValueError("the table changed while its store was built")
        order = None
        if unit is not None:
            # the range's own codes from 0, in place, in 4 bytes (codes < 2^27: LARGE_ROWS)
            ranged = np.array(np.ma.getdata(fetched[f"__c{unit}"]), dtype=np.int32)
            ranged -= first
            if f"__c{unit}" not in held:  # kept as runs: the fetched codes are done with
                del fetched[f"__c{unit}"]
            order = _unit_order(ranged, last - first + 1)
            if f"__c{unit}" not in held:  # the runs from each code's count: no sorted copy
                counts = np.bincount(ranged, minlength=last - first + 1)
                present = np.flatnonzero(counts)
                ends = np.cumsum(counts[present])
                dtype = next(d for k, d in keys if k == f"__c{unit}")
                runs.append((ends - counts[present] + filled, (present + first).astype(dtype)))
            del ranged
        for key, dtype in keys:
            if key not in held:
                continue
            data: np.ndarray = np.asarray(np.ma.getdata(fetched.pop(key)), dtype=dtype)
            if key.startswith("__n") and not data.any():
                continue  # no NULL here: the zeros stay unwritten (load_clustered)
            if order is None:
                held[key][filled : filled + n] = data
            else:  # gathered straight into the store's rows (no reordered copy: "clip"
                # is not buffered as "raise" is; ``order`` is a permutation of the range)
                np.take(data, order, out=held[key][filled : filled + n], mode="clip")
            del data
        filled += n
    return filled


def _numbered_codes(
    con: Any, name: str, readable: list[Any], labels: dict[str, Sequence[Any]]
) -> dict[int, str]:
    """Per coded column, its sorted distinct values numbered once, in a temporary table of
    the build's own cursor (dropped after it), which every range's fetch joins: the DISTINCT
    over the whole table is not repeated per range (at 100M rows, 48 ranges, it was most of
    the build)."""
    kept: dict[int, str] = {}
    for i, c in enumerate(readable):
        if c.name not in labels:
            continue
        temporary = f"__dpsql_store_codes_{i}"
        codes = _numbered(policy_column(c.name), name)
        con.execute(render(create_temp_table_as(table_ref(temporary), codes), "duckdb"))
        kept[i] = temporary
    return kept


#: rows fetched from DuckDB at a time when a store is built (whole units): its numpy fetch
#: holds about twice what it returns while it converts, so a fetch of the whole table was the
#: build's peak (10M rows, bench_fast: 2^21 rows a fetch peaked 722 MiB, 2^20 659 MiB, 2^19
#: 627 MiB; each range scans the table's unit column, so fewer rows a fetch cost more CPU)
_FETCH_ROWS = 1 << 20


def _distinct(con: Any, name: str, column: str, kind: str) -> Sequence[Any]:
    """A coded column's sorted distinct non-NULL values, then None (NULL's label). Fetched as
    one array (a list of 1-tuples held ~90 bytes a value: ~0.9 GB for 10M units); a column
    whose values numpy does not hold as integers exactly (a HUGEINT) row by row."""
    values = distinct_values(policy_column(column), named_table(name), "v")
    sql = render(order_by(values, [policy_column(column)]), "duckdb")
    if kind in ("text", "int"):
        fetched = np.ma.getdata(con.execute(sql).fetchnumpy()["v"])
        if kind == "text":
            return (*(str(v) for v in fetched.tolist()), None)
        if fetched.dtype == np.int64:  # one int64 array, not a Python int a value
            return IntLabels(fetched)
        if np.issubdtype(fetched.dtype, np.integer):
            return (*fetched.tolist(), None)
    distinct = con.execute(sql).fetchall()
    if kind == "int":
        return (*(int(r[0]) for r in distinct), None)
    return (*(bool(r[0]) for r in distinct), None)


def _unit_ranges(
    rows: int, unit: int | None, labels: dict[str, Sequence[Any]], readable: list[Any]
) -> list[tuple[int, int]]:
    """Ranges [first, last) of unit codes fetched at a time, about _FETCH_ROWS rows each if
    the units are alike (the number of ranges is the row count's, not the values'); the last
    range also holds the rows of no unit (code ``last``). One range without a coded unit."""
    if unit is None:
        return [(0, 0)]
    units = len(labels[readable[unit].name]) - 1
    parts = max(1, min(units, -(-rows // _FETCH_ROWS)))
    edges = [units * k // parts for k in range(parts + 1)]
    return [(edges[k], edges[k + 1]) for k in range(parts)]


def _fetch_sql(
    name: str,
    readable: list[Any],
    labels: dict[str, Sequence[Any]],
    unit: int | None,
    first: int,
    last: int,
    kept: dict[int, str] | None,
) -> tuple[str, list[Any]]:
    """The fetch of the rows whose unit code is in [first, last) (and the rows of no unit
    with the last range): each coded column's codes by a join to its sorted distinct values
    numbered (in the query, or once per build in the temporary tables ``kept``: then the
    unit's restricted to the range), the other columns' values (a date as its day number) and
    every column's NULL flag."""
    ctes: list[exp.CTE] = []
    joins: list[exp.Join] = []
    items: list[exp.Expression] = []
    params: list[Any] = []
    where: list[exp.Expression] = []
    for i, c in enumerate(readable):
        value = policy_column(c.name, "r")
        if c.name in labels:
            n, d = len(labels[c.name]) - 1, f"d{i}"
            if kept is not None:  # numbered once (_numbered_codes): this range's part
                code = internal_name("code")
                inside: list[exp.Expression] = [
                    exp.GTE(this=code, expression=number(first)),
                    exp.LT(this=code.copy(), expression=number(last)),
                ]
                part = [internal_name("v"), internal_name("code")]
                ctes.append(
                    cte(d, select(part, table_ref(kept[i]), where=inside if i == unit else None))
                )
            else:
                ctes.append(cte(d, _numbered(policy_column(c.name), name)))
            same_value = exp.EQ(this=value.copy(), expression=internal_name("v", d))
            joins.append(left_join(table_ref(d), same_value))
            # fetched in the store's own width (code_dtype): no int64 copy of each range
            width = _CODE_SQL[code_dtype(n + 1)]
            items.append(
                alias(cast(coalesce(internal_name("code", d), number(n)), width), f"__c{i}")
            )
            if i == unit:
                placeholder = exp.Placeholder
                ranged: exp.Expression = exp.And(
                    this=exp.GTE(this=value.copy(), expression=placeholder()),
                    expression=exp.LTE(this=value.copy(), expression=placeholder()),
                )
                params += [labels[c.name][first], labels[c.name][last - 1]]
                if last == n:
                    ranged = exp.Or(this=ranged, expression=is_null(value.copy()))
                where = [exp.Paren(this=ranged)]
        if c.type != "text":
            items.append(alias(_fetched(c.type, value.copy()), f"__v{i}"))
        items.append(alias(is_null(value.copy()), f"__n{i}"))
    query = select(items, table_ref(name, "r", quoted=True), joins=joins, where=where)
    return render(with_ctes(query, ctes), "duckdb"), params


def _numbered(value: exp.Expression, table: str) -> exp.Select:
    """A coded column's distinct non-NULL values ``v`` numbered from 0 in sorted order
    (``code``): its codes, as every fetch joins them."""
    return numbered(distinct_values(value, named_table(table), "v"), "v", "code")


def _row_count(con: Any, table: str) -> int:
    """The table's rows (the engine's cap is checked against it before anything is read)."""
    counted = con.execute(render(select([count_star()], named_table(table)), "duckdb")).fetchone()
    return int(counted[0]) if counted else 0


def _unit_order(codes: np.ndarray, size: int) -> np.ndarray:
    """The rows in order of their unit's dense code (each in [0, ``size``)), stably: a
    counting sort (two passes over the codes), not a comparison sort of 10M rows. Which order
    the rows of one unit keep does not matter (every program bounds a unit's rows whatever
    their order: sums of integers), only that each unit's rows are contiguous."""
    from dpsql.engine import clustered

    if clustered.available():
        return clustered.counting_order(codes, size)
    return np.argsort(codes, kind="stable")


def cluster(
    table: ColumnarTable,
    policy: TablePolicy,
    nulls: np.ndarray | None = None,
    floats: np.ndarray | None = None,
    codes: tuple[np.ndarray, dict[str, int]] | None = None,
) -> ColumnarTable:
    """``table`` as a store for the compiled pass (dpsql.engine.clustered): its rows ordered
    by privacy unit (its dense codes, NULL last; a stable sort, and none when the rows come
    ordered), each unit's first row, the fixed point of every bounded numeric column at its
    declared bounds (dpsql.lower.compile.fixed_point_expr, as :func:`_fixed_point`; each row
    computed when first read: :class:`FixedRows`) and every column's NULLs, one row each
    (``nulls``: that matrix already, the columns' masks its rows; ``floats``: the float
    columns' matrix already; ``codes``: a byte array holding the int columns' codes already
    and each one's offset, :func:`_code_arena`). The same rows as ``table``: every
    program's result is the same integers."""
    unit = policy.privacy_unit
    columns = dict(table.columns)
    if unit is not None and unit in columns and columns[unit].runs is not None:
        unit_starts = columns[unit].runs[0]  # type: ignore[index]  # built clustered
    elif unit is not None and unit in columns:
        ordered = columns[unit].codes
        assert ordered is not None
        if len(ordered) > 1 and bool(np.any(ordered[1:] < ordered[:-1])):
            order = np.argsort(ordered, kind="stable")
            columns = {name: _take(column, order) for name, column in columns.items()}
            nulls = floats = codes = None
            ordered = columns[unit].codes
            assert ordered is not None
        starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])[: len(ordered)]
        unit_starts = np.append(starts.astype(np.int64), len(ordered))
        held = columns[unit]
        if held.kind == "int" and held.stored is None:  # its codes: one a unit, not a row
            runs = (unit_starts, np.ascontiguousarray(ordered[starts]))
            columns[unit] = replace(held, held_codes=None, runs=runs)
        del ordered
    else:
        unit, unit_starts = None, None
    # every column's NULLs, one row each; the columns' own masks become views of its rows
    # (one copy of each mask, not two)
    nulls_index = {name: i for i, name in enumerate(columns)}
    if nulls is None:
        nulls = np.empty((len(columns), table.rows), dtype=np.bool_)
        for i, column in enumerate(columns.values()):
            nulls[i] = column.nulls
        columns = {
            name: replace(column, nulls=nulls[i])
            for i, (name, column) in enumerate(columns.items())
        }
    floats, columns = _float_matrix(columns, floats)
    arena, code_at, columns = _code_arena(columns, policy, codes)
    fixed_rows, fixed_index = _fixed_rows(columns, policy, table.rows, floats, (arena, code_at))
    for array in (nulls, unit_starts, floats, arena):
        if array is not None:
            array.setflags(write=False)
    for column in columns.values():
        for array in (column.stored, column.nulls, column.held_codes, *(column.runs or ())):
            if array is not None:
                array.setflags(write=False)
    return ColumnarTable(
        table.name,
        table.version,
        table.rows,
        columns,
        table.capacity,
        unit,
        unit_starts,
        fixed_rows,
        fixed_index,
        nulls,
        nulls_index,
    )


def _fixed_rows(
    columns: dict[str, Column],
    policy: TablePolicy,
    rows: int,
    floats: np.ndarray,
    codes: tuple[np.ndarray, dict[str, int]],
) -> tuple[FixedRows, dict[tuple[str, str, int, int], int]]:
    """The store's fixed-point rows (:class:`FixedRows`, none computed yet) and their index:
    per bounded numeric column its fixed point at its declared bounds and at a cut measure's
    widened ones, and a clamped measure's excess."""
    float_rows = {
        name: k for k, name in enumerate(c for c in columns if columns[c].kind == "float")
    }
    arena, code_at = codes
    fixed_index: dict[tuple[str, str, int, int], int] = {}
    # each row's values over rows lo .. hi, computed when filled; for a float column's row
    # what the compiled pass computes it from instead (FixedRows.fused), for an int column's
    # its table by code (FixedRows.lookups: its offset, length and values)
    rows_of: list[Callable[[int, int], np.ndarray]] = []
    fused: list[tuple[float, ...] | None] = []
    lookups: list[tuple[int, int, Callable[[], np.ndarray]] | None] = []
    tables = 0  # the tables' length so far

    def add(row: Callable[[int, int], np.ndarray], table: Callable[[], np.ndarray],
            column: Column, name: str, source: tuple[float, ...] | None) -> None:  # fmt: skip
        nonlocal tables
        rows_of.append(row)
        at = code_at.get(name)
        if source is None and at is not None:  # an int column's: looked up at its codes
            n = len(column.labels)
            width = column.held_codes.dtype.itemsize  # type: ignore[union-attr]
            source = (3.0, float(tables), float(at), float(width), 0.0, 0.0)
            lookups.append((tables, n, table))
            tables += n
        else:
            lookups.append(None)
        # a float or an int column's: computed by the pass block by block (clustered._fill),
        # never a full-length row (4 bytes a row each; filled only for numpy's path)
        fused.append(source)

    for name, column in columns.items():
        spec = policy.columns[name]
        if not (spec.numeric and spec.bounded and column.kind in ("int", "float")):
            continue
        lo, hi = fixed_point_bounds(spec.lower, spec.upper, spec.granularity)  # type: ignore[arg-type]
        k = float_rows.get(name)
        g = float(spec.granularity)  # type: ignore[arg-type]
        for a, b in ((lo, hi), bias.measure_range("cut", lo, hi)):
            if max(abs(a), abs(b)) <= 2**53 and ("fixed", name, a, b) not in fixed_index:
                fixed_index[("fixed", name, a, b)] = len(rows_of)
                add(_slice_of(_fixed_point, column, spec, a, b),
                    _by_code(_fixed_point, column, spec, a, b), column, name,
                    (1.0, k, g, float(a), float(b), 0.0) if k is not None else None)  # fmt: skip
        fixed_index[("excess", name, lo, hi)] = len(rows_of)
        width = max(hi - lo, 1)
        bounds = (float(spec.lower), float(spec.upper), float(width))  # type: ignore[arg-type]
        add(_slice_of(_clamp_excess, column, spec, width),
            _by_code(_clamp_excess, column, spec, width), column, name,
            (2.0, k, g, *bounds) if k is not None else None)  # fmt: skip
    # every row lies within its range ([lo, hi], the cut's widened one, or [-W, W] for the
    # excess): int32 when all ranges fit (decided from the policy's bounds), half the memory;
    # each row filled when a program first reads it (FixedRows), and so each table
    ranges = [abs(b) for (_, _, lo_, hi_) in fixed_index for b in (lo_, hi_)]
    widths = [3 * max(hi_ - lo_, 1) for (_, _, lo_, hi_) in fixed_index]
    small = max([*ranges, *widths, 0]) < 2**31 - 1
    fixed = np.empty((len(rows_of), rows), dtype=np.int32 if small else np.int64)
    row_nulls = [columns[name].nulls for (_, name, _, _) in sorted(
        fixed_index, key=fixed_index.__getitem__)]  # fmt: skip
    return FixedRows(fixed, rows_of, row_nulls, floats, fused, arena, lookups), fixed_index


def _code_arena(
    columns: dict[str, Column],
    policy: TablePolicy,
    codes: tuple[np.ndarray, dict[str, int]] | None,
) -> tuple[np.ndarray, dict[str, int], dict[str, Column]]:
    """The codes of every bounded int column held as codes, in one byte array (what the
    compiled pass reads them from, clustered._look_up), each at its offset (a multiple of 8):
    ``codes`` when the build fetched them so already, else copied there, the columns' own
    codes becoming views of it (one copy of each, not two)."""
    names = [
        name for name, c in columns.items()
        if c.kind == "int" and c.held_codes is not None
        and policy.columns[name].numeric and policy.columns[name].bounded
    ]  # fmt: skip
    if codes is not None and all(name in codes[1] for name in names):
        return codes[0], {name: codes[1][name] for name in names}, columns
    held: dict[str, np.ndarray] = {}
    for name in names:
        held_codes = columns[name].held_codes
        assert held_codes is not None
        held[name] = held_codes
    arena, at, views = _arena({name: (a.dtype, len(a)) for name, a in held.items()})
    for name, view in views.items():
        view[:] = held[name]
    copied = {name: replace(columns[name], held_codes=views[name]) for name in names}
    return arena, at, {**columns, **copied}


def _arena(
    shapes: dict[str, tuple[Any, int]],
) -> tuple[np.ndarray, dict[str, int], dict[str, np.ndarray]]:
    """One byte array with room for an array of each of ``shapes`` (name: (dtype, length)),
    unfilled, each one's offset (a multiple of 8: every view aligned) and its view there."""
    at: dict[str, int] = {}
    size = 0
    for name, (dtype, n) in shapes.items():
        at[name] = size
        size += -(-np.dtype(dtype).itemsize * n // 8) * 8
    arena = np.empty(size, dtype=np.uint8)
    views = {
        name: arena[at[name] : at[name] + np.dtype(dtype).itemsize * n].view(dtype)
        for name, (dtype, n) in shapes.items()
    }
    return arena, at, views


def _by_code(
    compute: Callable[..., np.ndarray], column: Column, *args: Any
) -> Callable[[], np.ndarray]:
    """``compute(each code's value, *args)``, NULL's code 0 (its rows are never read: the
    pass skips a NULL, a filled row holds 0 there)."""

    def table() -> np.ndarray:
        values = compute(column.by_code, *args)
        if column.labels and column.labels[-1] is None:
            values[-1] = 0
        return values

    return table


_FILL_ROWS = 1 << 20


def _float_matrix(
    columns: dict[str, Column], floats: np.ndarray | None
) -> tuple[np.ndarray, dict[str, Column]]:
    """The float columns' values as rows of one C-contiguous matrix, in column order (what
    the compiled pass reads; ``floats`` when the build fetched them so already), the
    columns' own arrays becoming views of its rows (one copy of each, not two)."""
    names = [name for name, column in columns.items() if column.kind == "float"]
    if floats is not None and len(floats) == len(names):
        return floats, columns
    if len(names) == 1:  # a view of the one column, no copy
        stored = columns[names[0]].stored
        assert stored is not None
        return np.ascontiguousarray(stored).reshape(1, -1), columns
    rows = len(next(iter(columns.values())).nulls) if columns else 0
    matrix = np.empty((len(names), rows), dtype=np.float64)
    for k, name in enumerate(names):
        matrix[k] = columns[name].stored
    held = {name: replace(columns[name], stored=matrix[k]) for k, name in enumerate(names)}
    return matrix, {**columns, **held}


def _slice_of(
    compute: Callable[..., np.ndarray], column: Column, *args: Any
) -> Callable[[int, int], np.ndarray]:
    """``compute(values of rows lo .. hi, *args)`` (an elementwise function)."""
    return lambda lo, hi: compute(column.value_slice(lo, hi), *args)


def warm_up() -> None:
    """Compile the kernels of dpsql.engine.clustered now (numba compiles on first use, ~1 s
    each unless cached on disk), on tiny arrays, so no query waits for it."""
    from dpsql.engine import clustered

    if not clustered.available():
        return
    one = np.zeros(1, dtype=np.int64)
    nulls = np.zeros((1, 1), dtype=np.bool_)
    weight = np.ones(1, dtype=np.bool_)
    spec = [(clustered.SUM, 0, 0, 0, 1, 0)]
    starts = np.array([0, 1], dtype=np.int64)
    # a store's fixed points: int32 where they fit; group codes: a key's own (code_dtype:
    # uint8, uint16, int32) or combined (int64)
    groups = [np.zeros(1, dtype=t) for t in (np.uint8, np.uint16, np.int32)]
    for dtype in (np.int32, np.int64):
        fixed = np.zeros((1, 1), dtype=dtype)
        for group in (*groups, one):
            clustered.bound_units(
                starts, group, weight, fixed, nulls, spec, one, one, 1, 1, 1, 1, True, one
            )
            clustered.row_sums(group, weight, fixed, nulls, spec, one, one, 1)
    clustered.counting_order(np.zeros(1, dtype=np.int32), 1)
    from dpsql.engine import clamp_pass

    clamp_pass.warm_up()
    kernel_readiness.mark_ready()


def warm_up_later() -> None:
    """:func:`warm_up` on a thread of its own, once per process."""
    import threading

    if _warming:
        return
    _warming.append(threading.Thread(target=warm_up, name="dpsql-kernels", daemon=True))
    _warming[0].start()


_warming: list[Any] = []


def _take(column: Column, order: np.ndarray) -> Column:
    codes = None if column.codes is None else column.codes[order]
    stored = column.stored
    if stored is not None:
        stored = codes if column.codes is stored else stored[order]
    return Column(column.kind, stored, column.nulls[order], codes, column.labels)


# DuckDB's day numbers of DATE 'infinity' and '-infinity' (its date_t: int32 days since
# 1970-01-01, +-(2^31 - 1) for the infinities), above and below every finite date it holds
# (-2^31 + 2 .. 2^31 - 2 days: years 5877641 BC .. 5877642 AD) as DuckDB orders them.
DATE_INFINITY = 2**31 - 1


# How each kind is read: a date as its day number (int64 holds every one; numpy's datetime64,
# through which DuckDB's fetchnumpy goes in microseconds, holds neither infinity nor years past
# ~290,000); the other kinds as they are (BIGINT, DOUBLE with NaN and +-inf, VARCHAR, BOOLEAN:
# numpy holds every value of each).
def _fetched(kind: str, value: exp.Expression) -> exp.Expression:
    """A stored column's value as the store reads it: a date as its day number,
    the rest as they are."""
    return day_number(value, DATE_INFINITY) if kind == "date" else value


_KINDS = ("int", "float", "text", "bool", "date")
_EPOCH = datetime.date(1970, 1, 1)
_HEAP_PAD = 32 << 20
_padded: list[bool] = []


def _keep_heap_pad() -> None:
    """Keep 32 MiB free at the top of this process's heap (glibc's M_TOP_PAD), once.

    By default glibc gives the top of the heap back to the system whenever it frees more than
    128 KiB there, and takes it back at the next allocation: every temporary array of a
    program (~250 KiB on the fixture) then page-faults in afresh, which cost 3x the program's
    own arithmetic (bench_small.py: GROUP BY 1.78 -> 0.60 ms). Elsewhere (no glibc) nothing
    changes."""
    if _padded:
        return
    _padded.append(True)
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(ctypes.c_int(-2), ctypes.c_int(_HEAP_PAD))  # M_TOP_PAD
    except (OSError, AttributeError):
        pass


def _column(spec: ColumnPolicy, fetched: Any) -> Column:
    nulls = np.asarray(np.ma.getmaskarray(fetched), dtype=bool)
    data = np.ma.getdata(fetched)
    if spec.type == "text":
        distinct, inverse = np.unique(np.asarray(data, dtype=object)[~nulls], return_inverse=True)
        codes = np.full(len(nulls), len(distinct), dtype=np.int32)  # NULL: the last code
        codes[~nulls] = inverse
        return Column("text", codes, nulls, codes, (*(str(v) for v in distinct.tolist()), None))
    if spec.type == "date":  # DuckDB's day numbers (_fetched), compared as integers
        return Column("date", np.where(nulls, 0, np.asarray(data, dtype=np.int64)), nulls)
    dtype: type = {"int": np.int64, "float": np.float64, "bool": np.bool_}[spec.type]
    values: np.ndarray = np.array(data, dtype=dtype)
    if spec.type == "float":
        return Column("float", values, nulls)
    distinct, inverse = np.unique(values[~nulls], return_inverse=True)
    dense = np.full(len(values), len(distinct), dtype=np.int32)
    dense[~nulls] = inverse
    return Column(spec.type, values, nulls, dense, (*distinct.tolist(), None))


# -- running a program ----------------------------------------------------------------------


def run(
    program: ColumnProgram,
    table: ColumnarTable,
    policy: TablePolicy,
    swaps: tuple[tuple[str, str], ...] = (),
) -> EngineResult | None:
    """The exact result of ``program`` on ``table``; None (before reading any value) when the
    program's bound does not fit this table or a literal is one the evaluator cannot mirror."""
    assert table.rows <= table.capacity
    if not _fits(program, table.capacity):
        return None
    planned: object = _UNPLANNED
    if any(m.measure_kind.bias for m in program.measures):
        planned = _kernel_spec(program, table)
        if planned is None:
            return None
    try:
        where = _condition(program.where, table, dict(swaps))
    except NotRunnable:
        return None
    # No warnings: x / g overflowing to inf on an extreme value is what DuckDB computes too
    # (and clamps), but a warning is output that only some data produce, and under
    # ``-W error`` it would fail the query on those data only.
    with np.errstate(all="ignore"):
        return _run(program, table, policy, where, planned)


#: :func:`_kernel_spec` not asked yet (:func:`_compiled_pass` asks it)
_UNPLANNED = object()


def _run(
    program: ColumnProgram,
    table: ColumnarTable,
    policy: TablePolicy,
    where: Callable[[int, int], np.ndarray] | None,
    planned: object = _UNPLANNED,
) -> EngineResult:
    static = _static_mask(program, table, policy) if program.unit is not None else None
    if where is not None:
        # by chunks of rows into one array (each row's truth depends on that row alone): the
        # WHERE's masks are a chunk's, not the table's (~5 bytes a row at its peak before)
        selected = np.empty(table.rows, dtype=bool)
        for lo in range(0, table.rows, _FILL_ROWS):
            hi = min(table.rows, lo + _FILL_ROWS)
            part = where(lo, hi)
            selected[lo:hi] = part if static is None else part & static[lo:hi]
    elif static is not None:
        selected = static
    else:
        selected = np.ones(table.rows, dtype=bool)
    # Fixed shapes from here on: every row and every (unit, group) slot is computed, a row
    # the WHERE drops weighing 0, so the time does not depend on which rows it keeps.
    group, size, label = _groups(program.keys, table)
    compiled = _compiled_pass(program, table, group, size, selected, planned)
    if compiled is not None:
        measures, present = compiled
        return _result(program, policy, measures, present, label)
    weight = selected.astype(np.int64)
    values = [_row_values(m, table, policy, weight) for m in program.measures]
    if program.unit is None:
        measures, present = _row_level(program, group, size, weight, values, table.capacity)
    else:
        measures, present = _per_unit(program, table, group, size, weight, values)
    return _result(program, policy, measures, present, label)


def _result(
    program: ColumnProgram,
    policy: TablePolicy,
    measures: list[np.ndarray],
    present: np.ndarray,
    label: Callable[[int], tuple[Any, ...]],
) -> EngineResult:
    if not program.keys:
        return EngineResult([()], [[int(t[0])] for t in measures], ())
    keep = np.flatnonzero(present).tolist()
    types = tuple(KEY_TYPES[policy.columns[k].type] for k in program.keys)
    columns = [[int(x) for x in t[keep].tolist()] for t in measures]
    return EngineResult([label(i) for i in keep], columns, types)


_Spec = tuple[
    list[tuple[int, int, int, int, int, int]], list[int], list[int], list[tuple[int, int]]
]
_NO_CLAMP = (-(2**63), 2**63 - 1)


def _kernel_spec(program: ColumnProgram, table: ColumnarTable) -> _Spec | None:
    """What the compiled pass reads for ``program`` on ``table``: per measure other than row
    and unit counts its (kind, 0, centre, centre², scale, cap), rows of ``fixed`` and
    ``nulls``, and the range a fixed point is clamped to as read; None when it cannot run (no
    kernel, not a store clustered by the program's unit, too many groups, a column without
    the fixed point at the measure's range): decided from the program and the store's layout
    only, before any value is read.

    A fixed point at [lo, hi] is read from the widest of its column's fixed-point rows whose
    range holds [lo, hi] (the bias measures' cut range), clamped to [lo, hi]: the same integer
    as its own row's (rounding is monotone and keeps integers, so for integers a <= lo <= hi
    <= b, clamp(round(clamp(q, a, b)), lo, hi) = round(clamp(q, lo, hi)), NaN going to the top
    in both), and one row of memory serves both."""
    from dpsql.engine import clustered

    if table.fixed_rows is None or table.nulls is None or not clustered.available():
        return None
    if not kernel_readiness.ready():  # not loaded yet: numpy (or the SQL) rather than wait
        return None
    if program.unit is not None and (program.unit != table.unit or table.unit_starts is None):
        return None
    fixed_index = table.fixed_index or {}
    nulls_index = table.nulls_index or {}
    spec: list[tuple[int, int, int, int, int, int]] = []
    fixed_rows: list[int] = []
    null_rows: list[int] = []
    clamps: list[tuple[int, int]] = []
    for m in program.measures:
        kind = m.measure_kind  # what the pass computes for it (MeasureKind: the kernel's)
        if kind.tallied:  # the pass's own row and unit counts
            continue
        if kind.kernel is None:
            return None
        code = getattr(clustered, kind.kernel)
        if not kind.reads:  # a pair's rows (cut by R): no column read
            spec.append((code, 0, 0, 0, m.scale, _bias_cap(program)))
            fixed_rows.append(0)
            null_rows.append(0)
            clamps.append(_NO_CLAMP)
            continue
        if m.column not in nulls_index:
            return None
        null_rows.append(nulls_index[m.column])  # type: ignore[index]
        if kind.reads == "nulls":
            # a rescaled COUNT(col): shares on its fine grid, rounded per unit (grid > 0)
            spec.append((code, m.fine if m.fine > 1 else 0, 0, 0, m.pair_scale, 0))
            fixed_rows.append(0)
            clamps.append(_NO_CLAMP)
            continue
        if kind.reads == "excess":
            held = fixed_index.get(("excess", m.column, m.lo, m.hi))  # type: ignore[arg-type]
            clamp = _NO_CLAMP
        else:
            held = _widest_row(fixed_index, m.column, m.lo, m.hi)  # type: ignore[arg-type]
            clamp = (m.lo, m.hi)
        if held is None:
            return None
        spec.append((code, 0, m.center, m.center2, m.scale, _bias_cap(program)))
        fixed_rows.append(held)
        clamps.append(clamp)
    return spec, fixed_rows, null_rows, clamps


def _widest_row(
    fixed_index: dict[tuple[str, str, int, int], int], column: str, lo: int, hi: int
) -> int | None:
    """The row of ``column``'s widest fixed-point range holding [lo, hi] (None: no such row).
    From the store's layout (the policy's bounds) and the program only."""
    best: tuple[int, int] | None = None
    for (role, name, a, b), row in fixed_index.items():
        holds = role == "fixed" and name == column and a <= lo and hi <= b
        if holds and (best is None or b - a > best[0]):
            best = (b - a, row)
    return None if best is None else best[1]


def _bias_cap(program: ColumnProgram) -> int:
    from dpsql.plan.bias import cap

    return cap(program.max_rows)


def _static_mask(program: ColumnProgram, table: ColumnarTable, policy: TablePolicy) -> np.ndarray:
    """The rows a per-unit program may read whatever its WHERE: a unit, and each domain key
    in its public domain. A property of the table and the policy, kept per (unit, keys) on the
    table (read-only; computed once per data version: the SQL's conditions, as before)."""
    domains = tuple(n for n, d in zip(program.keys, program.key_domains, strict=True) if d)
    key = (program.unit, domains)
    held = table.masks.get(key)
    if held is None:
        # by chunks of rows into one array: a chunk's temporaries (a domain test gathered
        # at each row's code), not the table's (~10 bytes a row at its peak before)
        held = np.empty(table.rows, dtype=bool)
        unit_nulls = table.columns[program.unit].nulls  # type: ignore[index]
        for lo in range(0, table.rows, _FILL_ROWS):
            hi = min(table.rows, lo + _FILL_ROWS)
            part = ~unit_nulls[lo:hi]
            for name in domains:
                part &= _in_domain(table.columns[name], policy.columns[name], lo, hi)
            held[lo:hi] = part
        held.setflags(write=False)
        table.masks[key] = held
    return held


def _compiled_pass(
    program: ColumnProgram,
    table: ColumnarTable,
    group: np.ndarray,
    size: int,
    selected: np.ndarray,
    planned: object = _UNPLANNED,
) -> tuple[list[np.ndarray], np.ndarray] | None:
    """The program by one compiled pass (dpsql.engine.clustered) over a store
    (:func:`cluster`; per unit: clustered by the program's unit): the same (measures, present)
    as :func:`_row_level` / :func:`_per_unit`, and the bias measures' pair and row values as
    the SQL computes them (the ``dropped`` / ``cut`` / ``clamped`` kinds' SQL in
    dpsql.plan.measure_kinds). None (the numpy program runs) when :func:`_kernel_spec` says it
    cannot; ``planned``: its answer already asked (:func:`run`, for a program with bias
    measures: the same program and table, so the same spec)."""
    from dpsql.engine import clustered

    if planned is _UNPLANNED:
        planned = _kernel_spec(program, table)
    if planned is None:
        return None
    assert isinstance(planned, tuple)
    spec, fixed_rows, null_rows, clamps = planned
    assert table.fixed_rows is not None and table.nulls is not None
    reads = (clustered.SUM, clustered.SUMSQ, clustered.CUT)  # the others read no value
    held = table.fixed_rows
    fused = [
        held.fused[r] if s[0] in reads else None for r, s in zip(fixed_rows, spec, strict=True)
    ]
    held.looked_up(r for r, f in zip(fixed_rows, fused, strict=True) if f is not None)
    if len(held.matrix):  # the rows this program reads and does not compute, filled if not yet
        fixed = held.filled(sorted({r for r, f, s in zip(fixed_rows, fused, spec, strict=True)
                                    if s[0] in reads and f is None}))  # fmt: skip
    else:
        fixed = np.zeros((1, 1), dtype=np.int64)  # never read
    sources = [f or () for f in fused]
    rows_f = np.array(fixed_rows, dtype=np.int64)
    rows_n = np.array(null_rows, dtype=np.int64)
    if program.unit is not None:
        rows_out, units_out, values_out, some = clustered.bound_units(
            table.unit_starts,  # type: ignore[arg-type]
            group,
            selected,
            fixed,
            table.nulls,
            spec,
            rows_f,
            rows_n,
            size,
            program.max_rows,
            program.max_groups,
            program.count_scale,
            program.group_scaling,
            _store_offsets(program, table),
            clamps,
            held.floats,
            sources,
            held.codes,
            held.lut,
        )
    else:
        rows_out, values_out = clustered.row_sums(
            group, selected, fixed, table.nulls, spec, rows_f, rows_n, size, clamps,
            held.floats, sources, held.codes, held.lut,
        )  # fmt: skip
        units_out, some = rows_out, rows_out
    measures: list[np.ndarray] = []
    j = 0
    for m in program.measures:
        kind = m.measure_kind
        if kind.tallied:  # per pair: the pairs kept (units), else the rows kept
            measures.append(units_out if kind.per_pair else rows_out)
        else:
            measures.append(values_out[j])
            j += 1
    return measures, some > 0


def _store_offsets(program: ColumnProgram, table: ColumnarTable) -> np.ndarray:
    """Per unit of the store, in its order, the rounding offset of :func:`unit_offsets`
    (zeros when the program rounds no count); computed once per table, unit column and grid
    and kept on it read-only (a gather over every unit: ~1 ms a million, each query)."""
    assert table.unit_starts is not None
    grid = _rounding_grid(program)
    key = ("store offsets", program.unit, grid)
    held = table.masks.get(key)
    if held is None:
        if not grid:
            held = np.zeros(len(table.unit_starts) - 1, dtype=np.int64)
        else:
            column = table.columns[program.unit]  # type: ignore[index]
            if column.runs is not None:  # each unit's code, one a unit (cluster)
                firsts = column.runs[1]
            else:
                assert column.codes is not None
                firsts = column.codes[table.unit_starts[:-1]]
            # per code, not kept: only this order of them is (8 bytes a unit less held)
            offsets = unit_offsets(table, program.unit, grid, keep=False)  # type: ignore[arg-type]
            held = np.ascontiguousarray(offsets[firsts], dtype=np.int64)
            del offsets
        held.setflags(write=False)
        table.masks[key] = held
    return held


def _rounding_grid(program: ColumnProgram) -> int:
    """The fine grid of the program's rounded counts (all share it: row bound 1), 0: none."""
    return next((m.fine for m in program.measures if m.fine > 1), 0)


#: measure kinds only the compiled pass computes (the bias measures: MeasureKind.bias,
#: dpsql.plan.bias); the numpy program does not
KERNEL_ONLY = tuple(name for name, kind in MEASURE_KINDS.items() if kind.bias)


def _fits(program: ColumnProgram, capacity: int) -> bool:
    """Whether every product and sum of the program stays below 2^62 on any table of at most
    ``capacity`` rows: decided from the policy and the text, never from the table's own rows
    (one unit's rows could otherwise move a program to its SQL).

    With C = capacity, R, G, and per measure b = its row bound and s its scale (s = the count
    scale, b = 1, for counts): a pair's raw sum is at most C·b, times s·min(n, R) at most
    C·b·s·R; its partial at most R·b·s, times G/k's numerator at most R·b·s·G; a group's total
    over at most C units at most C·R·b·s. Every one is at most C·R·G·b·s."""
    factor = max(program.max_rows, 1) * max(program.max_groups, 1)
    for m in program.measures:
        if capacity * max(m.row_bound, 1) * max(m.pair_scale, 1) * factor >= _EXACT_INT:
            return False
    return capacity * factor * max(program.count_scale, 1) < _EXACT_INT


def _row_level(
    program: ColumnProgram,
    group: np.ndarray,
    size: int,
    weight: np.ndarray,
    values: list[np.ndarray | None],
    capacity: int,
) -> tuple[list[np.ndarray], np.ndarray]:
    """Per group: COUNT(*), COUNT(col) and SUM(value) of its kept rows; and which groups have
    any (sums summed in the way ``capacity``, not the table's rows, allows)."""
    rows = _sum_by(group, weight, size, capacity)
    measures = []
    for m, v in zip(program.measures, values, strict=True):
        bound = capacity * max(m.row_bound, 1)
        measures.append(rows if v is None else _sum_by(group, v, size, bound))
    return measures, rows > 0


def _per_unit(
    program: ColumnProgram,
    table: ColumnarTable,
    group: np.ndarray,
    size: int,
    weight: np.ndarray,
    values: list[np.ndarray | None],
) -> tuple[list[np.ndarray], np.ndarray]:
    """Pairs (unit, group) with their row count n and partials, capped at R rows (partials at
    R/n), then with G/k group scaling, then summed per group (dpsql.lower.compile._bounded).

    The pairs are every slot of units x groups where that is small (a dense grid), else every
    pair the table holds: a pair with no kept row has n = 0 and adds nothing."""
    unit = table.columns[program.unit]  # type: ignore[index]
    assert unit.codes is not None
    capacity = table.capacity  # the bounds that choose how to sum: public (ColumnarTable)
    # int64 before the product: codes are int32 (units x groups may pass 2^31)
    slots = _Slots(unit.codes.astype(np.int64) * size + group, len(unit.labels), size, table.rows)
    n = slots.count(weight)
    some = (n > 0).astype(np.int64)
    divisor = np.maximum(n, 1)  # a pair with no row has nothing to divide
    R, G = program.max_rows, program.max_groups
    capped = np.minimum(n, R)
    partials: list[np.ndarray | None] = []
    for m, v in zip(program.measures, values, strict=True):
        if v is None:
            partials.append(None)
            continue
        bound = capacity * max(m.row_bound, 1)
        raw = slots.total(v, bound)
        scale = m.pair_scale
        partials.append(_quotient(raw * (scale * capped), divisor, bound * scale * R))
    counts: np.ndarray = capped
    units_per_pair: np.ndarray = some
    if program.group_scaling:
        k = np.maximum(slots.per_unit(some), 1)
        kept = np.minimum(k, G)
        cs = program.count_scale
        counts = _quotient(capped * cs * kept, k, R * cs * G)
        units_per_pair = some * _quotient(cs * kept, k, cs * G)
        partials = [
            None
            if p is None
            else _quotient(p * kept, k, R * max(m.row_bound, 1) * max(m.pair_scale, 1) * G)
            for m, p in zip(program.measures, partials, strict=True)
        ]
    grid = _rounding_grid(program)
    if grid:
        # counts' fine shares back to integers per unit (dpsql.lower.compile.rounded_counts)
        offsets = unit_offsets(table, program.unit, grid)  # type: ignore[arg-type]
        for i, m in enumerate(program.measures):
            if m.fine <= 1:
                continue
            kind = m.measure_kind
            if kind.tallied and kind.per_pair:
                units_per_pair = slots.rounded(units_per_pair, offsets, m.fine)
            elif kind.tallied:
                counts = slots.rounded(counts, offsets, m.fine)
            else:
                partials[i] = slots.rounded(partials[i], offsets, m.fine)  # type: ignore[arg-type]
    present = slots.per_group(some) > 0
    measures = []
    for m, p in zip(program.measures, partials, strict=True):
        kind = m.measure_kind
        if kind.tallied:  # per pair: the units, else the rows
            measures.append(slots.per_group(units_per_pair if kind.per_pair else counts))
        else:
            measures.append(slots.per_group(p))  # type: ignore[arg-type]
    return measures, present


class _Slots:
    """The (unit, group) pairs of a per-unit program, and sums over them: a dense grid of
    units x groups where that is at most _DENSE_SLOTS per table row (sums along its axes),
    else the distinct pairs of the table (sums by code)."""

    def __init__(self, pair_code: np.ndarray, units: int, size: int, rows: int) -> None:
        self.size = size
        self.units = units
        slots = units * size
        self.dense = slots <= _DENSE_SLOTS * max(rows, 1024) and slots <= _DENSE_MOST
        if self.dense:
            self.codes, self.slots = pair_code, slots
        else:
            pairs, self.codes = np.unique(pair_code, return_inverse=True)
            self.slots = len(pairs)
            self.pair_unit, self.pair_group = pairs // size, pairs % size

    def count(self, weight: np.ndarray) -> np.ndarray:
        """Kept rows per pair (``weight`` 0 or 1 per row): an integer count, a row the WHERE
        drops sent to one slot past the end."""
        dropped = self.codes + (1 - weight) * (self.slots - self.codes)
        return np.bincount(dropped, minlength=self.slots + 1)[: self.slots].astype(np.int64)

    def total(self, values: np.ndarray, bound: int) -> np.ndarray:
        """Per pair, the exact sum of its rows' ``values``."""
        return _sum_by(self.codes, values, self.slots, bound)

    def per_unit(self, x: np.ndarray) -> np.ndarray:
        """Per pair, the sum of ``x`` over its unit's pairs."""
        if self.dense:
            return np.repeat(x.reshape(self.units, self.size).sum(axis=1), self.size)
        return np.bincount(self.pair_unit, weights=x).astype(np.int64)[self.pair_unit]

    def rounded(self, x: np.ndarray, offsets: np.ndarray, grid: int) -> np.ndarray:
        """Per pair, its unit's fine shares ``x`` (>= 0, on ``grid``) rounded to integers by
        systematic rounding over the unit's pairs in group-code order (the keys ascending,
        NULL last: the SQL's window order), ``offsets`` per unit code (U_u in [0, grid)):
        c = (A + U) // grid - (A - x + U) // grid with A the running sum of x in the unit."""
        if self.dense:
            shares = x.reshape(self.units, self.size)
            running = np.cumsum(shares, axis=1)
            off = offsets[: self.units, None]
            out = (running + off) // grid - (running - shares + off) // grid
            return out.reshape(-1)
        total = np.cumsum(x)
        first = np.r_[True, self.pair_unit[1:] != self.pair_unit[:-1]]
        before = np.repeat((total - x)[first], np.diff(np.r_[np.flatnonzero(first), len(x)]))
        running = total - before
        off = offsets[self.pair_unit]
        return (running + off) // grid - (running - x + off) // grid

    def per_group(self, x: np.ndarray) -> np.ndarray:
        """Per group, the exact int64 sum of ``x`` over its pairs."""
        if self.dense:
            return x.reshape(self.units, self.size).sum(axis=0)
        return _sum_by(self.pair_group, x, self.size, 2**62)


# (unit, group) slots counted densely up to this many per table row, and in all (each dense
# temporary is 8 bytes a slot: at most 16 MiB)
_DENSE_SLOTS = 8
_DENSE_MOST = 1 << 21


def unit_offsets(table: ColumnarTable, unit: str, grid: int, keep: bool = True) -> np.ndarray:
    """Per unit code of an integer unit column, the rounding offset U_u = ((u mod grid) ·
    ROUNDING_MULTIPLIER) mod grid (dpsql.lower.compile.unit_offset: the same integers; NULL 0),
    computed once per table and kept on it (read-only), unless not ``keep`` (the store keeps
    them in its units' order instead: :func:`_store_offsets`)."""
    from dpsql.plan.values import ROUNDING_MULTIPLIER

    key = ("offsets", unit, grid)
    held = table.masks.get(key)
    if held is None:
        column = table.columns[unit]
        ids = np.asarray(column.labels[:-1], dtype=np.int64)
        # in place in one array: the same int64 operations, without their five temporaries
        # of 8 bytes a unit (80 MiB each at 10M units)
        held = np.empty(len(ids) + 1, dtype=np.int64)
        np.remainder(ids, grid, out=held[:-1])
        del ids
        held[:-1] *= ROUNDING_MULTIPLIER
        held[:-1] %= grid
        held[-1] = 0
        held.setflags(write=False)
        if keep:
            table.masks[key] = held
    return held


def _quotient(numerator: np.ndarray, denominator: np.ndarray, bound: int) -> np.ndarray:
    """``numerator // denominator`` truncated toward zero (SQL's integer division), for
    positive denominators and |numerator| <= ``bound``.

    Below 2^52 through float64, exactly: for integers 0 <= a and b >= 1 with a + b <= 2^53 the
    rounded a / b cannot reach the next integer, so its floor is a // b (numpy's int64
    division is ~4x slower)."""
    magnitude = np.abs(numerator)
    if bound < 2**52:
        quotient = np.floor(magnitude / denominator).astype(np.int64)
    else:
        quotient = magnitude // denominator
    return quotient * np.sign(numerator)


def _sum_by(codes: np.ndarray, values: np.ndarray, size: int, bound: int) -> np.ndarray:
    """Exact int64 sums of ``values`` per code: in float64 where every partial sum is below
    2^53 in magnitude (``bound``), else sorted by code and reduced in int64 (the codes are
    the table's, so the sort's time does not depend on the WHERE either)."""
    if bound < _EXACT_FLOAT:
        return np.rint(np.bincount(codes, weights=values, minlength=size)).astype(np.int64)
    out = np.zeros(size, dtype=np.int64)
    if len(codes):
        order = np.argsort(codes, kind="stable")
        ordered = codes[order]
        starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
        out[ordered[starts]] = np.add.reduceat(values[order].astype(np.int64), starts)
    return out


# -- keys -------------------------------------------------------------------------------------


def _groups(
    keys: tuple[str, ...], table: ColumnarTable
) -> tuple[np.ndarray, int, Callable[[int], tuple[Any, ...]]]:
    """Each row's group code, the number of codes, and the key values of a code (SQL NULL as
    None), over every row of the table.

    Codes combine the keys' own codes in mixed radix while the product of their label counts
    stays small; past that they are re-densified after each key."""
    per_key: list[tuple[Sequence[Any], np.ndarray]] = []
    for name in keys:
        column = table.columns[name]
        assert column.codes is not None  # key columns: text, int, bool
        per_key.append((column.labels, column.codes))
    size = math.prod(len(labels) for labels, _ in per_key)
    if len(per_key) == 1:  # one key: its own codes (the mixed radix below, without a copy)
        ((labels, codes),) = per_key
        return codes, size, lambda c: (labels[c],)
    code = np.zeros(table.rows, dtype=np.int64)
    if size <= max(4 * table.rows, 4096):
        for labels, codes in per_key:
            code = code * len(labels) + codes

        def mixed(c: int) -> tuple[Any, ...]:
            out = []
            for labels, _ in reversed(per_key):
                c, digit = divmod(c, len(labels))
                out.append(labels[digit])
            return tuple(reversed(out))

        return code, size, mixed
    combined: list[tuple[Any, ...]] = [()]
    for labels, codes in per_key:
        distinct, inverse = np.unique(code * len(labels) + codes, return_inverse=True)
        code = inverse.astype(np.int64)
        combined = [
            (*combined[d // len(labels)], labels[d % len(labels)]) for d in distinct.tolist()
        ]
    return code, len(combined), combined.__getitem__


# -- row values -------------------------------------------------------------------------------


def _row_values(
    m: Measure, table: ColumnarTable, policy: TablePolicy, weight: np.ndarray
) -> np.ndarray | None:
    """Each row's integer contribution (0 for NULL and for a row the WHERE drops), or None
    for a count of rows or units (the kind's object says which value: MeasureKind.reads; the
    bias measures are the compiled pass's only, KERNEL_ONLY)."""
    kind = m.measure_kind
    if kind.tallied:
        return None
    column = table.columns[m.column]  # type: ignore[index]
    if kind.reads == "nulls":
        return weight * ~column.nulls
    spec = policy.columns[m.column]  # type: ignore[index]
    fixed = _fixed_point(column.values, spec, m.lo, m.hi)
    centred = fixed - m.center if m.center else fixed
    value = centred * centred - m.center2 if kind.squared else centred
    return np.where(column.nulls, 0, value) * weight


def _fixed_point(values: np.ndarray, spec: ColumnPolicy, lo: int, hi: int) -> np.ndarray:
    """dpsql.lower.compile.fixed_point_expr: ``CAST(ROUND(clamp(CAST(x AS DOUBLE) / g, lo, hi))
    AS BIGINT)``, NaN clamped to ``hi`` (DuckDB orders it above every number), ROUND half away
    from zero; an int column on grid 1 is clamped only."""
    if spec.type == "int" and spec.granularity == 1:
        return np.clip(values.astype(np.int64), lo, hi)
    quotient = values.astype(np.float64) / float(spec.granularity)
    clamped = np.where(np.isnan(quotient) | (quotient > hi), float(hi), quotient)
    clamped = np.where(clamped < lo, float(lo), clamped)
    whole = np.trunc(clamped)
    rounded = whole + np.trunc(2.0 * (clamped - whole))  # |fraction| >= 1/2 steps outward
    return rounded.astype(np.int64)


def _clamp_excess(values: np.ndarray, spec: ColumnPolicy, width: int) -> np.ndarray:
    """The ``clamped`` kind's row value as its SQL computes it (dpsql.plan.measure_kinds,
    _clamp_excess): ``CAST(ROUND(clamp((x - clamp(x, lower, upper)) / g, -W, W)) AS BIGINT)``
    in doubles, NaN clamped to ``upper`` then its excess (NaN) to W, ROUND half away from
    zero."""
    x = values.astype(np.float64)
    lower, upper = float(spec.lower), float(spec.upper)  # type: ignore[arg-type]
    inside = np.where(x < lower, lower, np.where(np.isnan(x) | (x > upper), upper, x))
    quotient = (x - inside) / float(spec.granularity)
    w = float(width)
    clamped = np.where(np.isnan(quotient) | (quotient > w), w, quotient)
    clamped = np.where(clamped < -w, -w, clamped)
    whole = np.trunc(clamped)
    return (whole + np.trunc(2.0 * (clamped - whole))).astype(np.int64)


# -- the WHERE ----------------------------------------------------------------------------------

# a condition's value per row: (true, false); a row where neither holds is NULL
Truth = tuple[np.ndarray, np.ndarray]


def _condition(
    where: exp.Expression | None, table: ColumnarTable, swaps: dict[str, str]
) -> Callable[[int, int], np.ndarray] | None:
    """The WHERE as a function giving the truth of rows lo .. hi (SQL keeps only TRUE rows):
    built first, reading no value, so that a literal it cannot mirror raises NotRunnable
    here. Every test is elementwise: a range's truth is that of its rows alone."""
    if where is None:
        return None
    build = _Builder(table, swaps)
    evaluate = build(where)
    return lambda lo, hi: evaluate(lo, hi)[0]


class _Builder:
    def __init__(self, table: ColumnarTable, swaps: dict[str, str]):
        self.table = table
        self.swaps = swaps

    def __call__(self, node: exp.Expression) -> Callable[[int, int], Truth]:
        if isinstance(node, exp.Paren):
            return self(node.this)
        if isinstance(node, exp.And):
            a, b = self(node.this), self(node.expression)
            return lambda lo, hi: _and(a(lo, hi), b(lo, hi))
        if isinstance(node, exp.Or):
            a, b = self(node.this), self(node.expression)
            return lambda lo, hi: _or(a(lo, hi), b(lo, hi))
        if isinstance(node, exp.Not):
            a = self(node.this)
            return lambda lo, hi: a(lo, hi)[::-1]  # type: ignore[return-value]
        if isinstance(node, exp.Boolean):
            value = bool(node.this)
            return lambda lo, hi: (np.full(hi - lo, value), np.full(hi - lo, not value))
        if isinstance(node, exp.Column):
            column = self._column(node)

            def boolean(lo: int, hi: int) -> Truth:
                x, known = column.value_slice(lo, hi), ~column.nulls[lo:hi]
                return x & known, ~x & known

            return boolean
        if isinstance(node, exp.Is):
            column = self._column(node.this)
            return lambda lo, hi: (column.nulls[lo:hi], ~column.nulls[lo:hi])
        if isinstance(node, COMPARISONS):
            op: type = type(node)
            left, right = node.this, node.expression
            if not isinstance(left, exp.Column):
                op, left, right = _FLIPPED[op], right, left
            return self._compare(op, left, right)
        if isinstance(node, exp.Between):
            low = self._compare(exp.GTE, node.this, node.args["low"])
            high = self._compare(exp.LTE, node.this, node.args["high"])
            return lambda lo, hi: _and(low(lo, hi), high(lo, hi))
        if isinstance(node, exp.In):
            if (member := self._member(node)) is not None:
                return member
            parts = [self._compare(exp.EQ, node.this, item) for item in node.expressions]

            def member(lo: int, hi: int) -> Truth:
                out = parts[0](lo, hi)
                for part in parts[1:]:
                    out = _or(out, part(lo, hi))
                return out

            return member
        raise NotRunnable

    def _member(self, node: exp.In) -> Callable[[int, int], Truth] | None:
        """``column IN (literal, ...)`` as one membership test over the column, linear in rows
        plus values: an OR of one comparison per value held a mask per value (100,000 values
        over 20,000 rows took 2 GB and 18 s). The same literals as :meth:`_compare` accept
        (the same NotRunnable otherwise), with the same matches: an integer column matches a
        value only if it is whole, a text column through its sorted codes, NaN never. None:
        a kind without its own membership test (the comparisons are ORed)."""
        if node.args.get("query") is not None or node.args.get("unnest") is not None:
            return None
        column = self._column(node.this)
        kind = column.kind
        if kind not in ("int", "float", "text", "date"):
            return None
        keys: list[Any] = []
        for item in node.expressions:
            if kind == "int":
                value = self._number(item)
                if abs(value) >= 2**62:
                    raise NotRunnable
                if int(value) == value:
                    keys.append(int(value))
            elif kind == "float":
                value = self._number(item)
                if len(value.as_tuple().digits) > 15:
                    raise NotRunnable
                keys.append(float(value))
            elif kind == "text":
                if not isinstance(item, exp.Literal) or not item.is_string:
                    raise NotRunnable
                text = str(item.this)
                low = bisect.bisect_left(column.categories, text)
                keys.extend(range(low, bisect.bisect_right(column.categories, text)))
            else:
                day = iso_date(item)
                if day is None:
                    raise NotRunnable
                keys.append((day - _EPOCH).days)
        if kind == "int" and column.coded:  # the codes whose value is wanted
            x = column.code_slice
            held = np.isin(column.by_code, np.array(keys, dtype=np.int64))
            wanted = np.flatnonzero(held)
        else:
            x = column.value_slice
            wanted = np.array(keys, dtype=column.values.dtype)
        nulls = column.nulls

        def truth(lo: int, hi: int) -> Truth:
            holds = np.isin(x(lo, hi), wanted)
            known = ~nulls[lo:hi]
            return holds & known, ~holds & known

        return truth

    def _column(self, node: exp.Expression) -> Column:
        if not isinstance(node, exp.Column) or node.name not in self.table.columns:
            raise NotRunnable
        return self.table.columns[node.name]

    def _compare(
        self, op: type, column_node: exp.Expression, literal: exp.Expression
    ) -> Callable[[int, int], Truth]:
        column = self._column(column_node)
        test = _LITERAL_TESTS[column.kind](self, op, column, literal)
        nulls = column.nulls

        def truth(lo: int, hi: int) -> Truth:
            holds = test(lo, hi)
            known = ~nulls[lo:hi]
            return holds & known, ~holds & known

        return truth

    def _number(self, literal: exp.Expression) -> Decimal:
        negative = isinstance(literal, exp.Neg)
        if negative:
            literal = literal.this
        if not isinstance(literal, exp.Literal) or literal.is_string:
            raise NotRunnable
        text = self.swaps.get(str(literal.this), str(literal.this))
        if not _plain_number(text):
            raise NotRunnable
        value = Decimal(text)
        return -value if negative else value

    def _int_test(self, op: type, column: Column, literal: exp.Expression) -> _Test:
        """An integer column against a number, exactly (DuckDB compares an integer with a
        decimal as decimals): ``x > 2.5`` is ``x > 2``, ``x = 2.5`` holds for no x."""
        value = self._number(literal)
        if abs(value) >= 2**62:
            raise NotRunnable
        whole = int(value)
        exact = whole == value
        floor = whole if (exact or value > 0) else whole - 1
        ceil = floor if exact else floor + 1
        if column.coded:
            return _ranged(
                _int_code_test(op, column.categories, whole, exact, floor, ceil),
                column.code_slice,
            )
        tests: dict[type, Callable[[np.ndarray], Any]] = {
            exp.EQ: (lambda x: x == whole) if exact else (lambda x: np.zeros(len(x), dtype=bool)),
            exp.NEQ: (lambda x: x != whole) if exact else (lambda x: np.ones(len(x), dtype=bool)),
            exp.GT: lambda x: x > floor,
            exp.GTE: lambda x: x >= ceil,
            exp.LT: lambda x: x < ceil,
            exp.LTE: lambda x: x <= floor,
        }
        return _ranged(tests[op], column.value_slice)

    def _float_test(self, op: type, column: Column, literal: exp.Expression) -> _Test:
        """A DOUBLE column against a number: as doubles, NaN equal to itself and above all."""
        value = self._number(literal)
        digits = len(value.as_tuple().digits)
        if digits > 15:  # beyond 15 digits a decimal's DOUBLE may depend on how it is cast
            raise NotRunnable
        number = float(value)
        tests: dict[type, Callable[[np.ndarray], Any]] = {
            exp.EQ: lambda x: (x == number) & ~np.isnan(x),
            exp.NEQ: lambda x: (x != number) | np.isnan(x),
            exp.GT: lambda x: (x > number) | np.isnan(x),
            exp.GTE: lambda x: (x >= number) | np.isnan(x),
            exp.LT: lambda x: (x < number) & ~np.isnan(x),
            exp.LTE: lambda x: (x <= number) & ~np.isnan(x),
        }
        return _ranged(tests[op], column.value_slice)

    def _text_test(self, op: type, column: Column, literal: exp.Expression) -> _Test:
        """A text column against a string, through its sorted codes (NULL's, the last, is
        masked by the caller)."""
        if not isinstance(literal, exp.Literal) or not literal.is_string:
            raise NotRunnable
        value = str(literal.this)
        categories = column.categories
        low = bisect.bisect_left(categories, value)  # codes < low hold values < literal
        high = bisect.bisect_right(categories, value)  # codes >= high hold values > literal
        tests: dict[type, Callable[[np.ndarray], Any]] = {
            exp.EQ: lambda x: (x >= low) & (x < high),
            exp.NEQ: lambda x: (x < low) | (x >= high),
            exp.GT: lambda x: x >= high,
            exp.GTE: lambda x: x >= low,
            exp.LT: lambda x: x < low,
            exp.LTE: lambda x: x < high,
        }
        return _ranged(tests[op], column.value_slice)

    def _date_test(self, op: type, column: Column, literal: exp.Expression) -> _Test:
        """A date column against an ISO date literal (DuckDB casts the string to DATE): days."""
        day = iso_date(literal)
        if day is None:
            raise NotRunnable
        compare, x, value = _ORDER[op], column.value_slice, (day - _EPOCH).days
        return lambda lo, hi: compare(x(lo, hi), value)

    def _bool_test(self, op: type, column: Column, literal: exp.Expression) -> _Test:
        if not isinstance(literal, exp.Boolean) or op not in (exp.EQ, exp.NEQ):
            raise NotRunnable
        value = bool(literal.this)
        x = column.value_slice
        if op is exp.EQ:
            return lambda lo, hi: x(lo, hi) == value
        return lambda lo, hi: x(lo, hi) != value


#: a literal test: the truth of rows lo .. hi (NULLs masked by the caller)
_Test = Callable[[int, int], Any]


def _ranged(test: Callable[[np.ndarray], Any], read: Callable[[int, int], np.ndarray]) -> _Test:
    """``test`` on rows lo .. hi as ``read`` gives them (values or codes)."""
    return lambda lo, hi: test(read(lo, hi))


_LITERAL_TESTS: dict[str, Callable[..., _Test]] = {
    "int": _Builder._int_test,
    "float": _Builder._float_test,
    "text": _Builder._text_test,
    "bool": _Builder._bool_test,
    "date": _Builder._date_test,
}
_ORDER: dict[type, Callable[[Any, Any], Any]] = {
    exp.EQ: operator.eq,
    exp.NEQ: operator.ne,
    exp.GT: operator.gt,
    exp.GTE: operator.ge,
    exp.LT: operator.lt,
    exp.LTE: operator.le,
}
_FLIPPED: dict[type, type] = {
    exp.EQ: exp.EQ,
    exp.NEQ: exp.NEQ,
    exp.GT: exp.LT,
    exp.GTE: exp.LTE,
    exp.LT: exp.GT,
    exp.LTE: exp.GTE,
}


def _plain_number(text: str) -> bool:
    """Digits with at most one point: what DuckDB reads as an integer or a DECIMAL literal."""
    whole, _, fraction = text.partition(".")
    return whole.isdigit() and (not fraction or fraction.isdigit()) and len(whole) <= 18


def _and(a: Truth, b: Truth) -> Truth:
    return a[0] & b[0], a[1] | b[1]


def _or(a: Truth, b: Truth) -> Truth:
    return a[0] | b[0], a[1] & b[1]


def _int_code_test(
    op: type, categories: Sequence[Any], whole: int, exact: bool, floor: int, ceil: int
) -> Callable[[np.ndarray], Any]:
    """:meth:`_Builder._int_test` on an int column's codes into its sorted distinct values
    ``categories`` (Python ints, compared exactly with the integer bounds): x > floor is
    code >= the number of values <= floor, and so on (NULL's code, the last, is masked by the
    caller). The same truth per row, without reading the values."""
    below_ceil = bisect.bisect_left(categories, ceil)  # codes < it: values < ceil
    upto_floor = bisect.bisect_right(categories, floor)  # codes < it: values <= floor
    if op in (exp.EQ, exp.NEQ):
        if not exact:
            value = op is exp.NEQ
            return lambda codes: np.full(len(codes), value)
        low = bisect.bisect_left(categories, whole)
        high = bisect.bisect_right(categories, whole)
        if op is exp.EQ:
            return lambda codes: (codes >= low) & (codes < high)
        return lambda codes: (codes < low) | (codes >= high)
    tests: dict[type, Callable[[np.ndarray], Any]] = {
        exp.GT: lambda codes: codes >= upto_floor,
        exp.GTE: lambda codes: codes >= below_ceil,
        exp.LT: lambda codes: codes < below_ceil,
        exp.LTE: lambda codes: codes < upto_floor,
    }
    return tests[op]


def _in_domain(column: Column, spec: ColumnPolicy, lo: int, hi: int) -> np.ndarray:
    """dpsql.lower.compile._domain_condition on the key column's rows ``lo`` .. ``hi``: its
    declared values, or its bounds, or not NULL; OR NULL where the column is nullable. An int
    column's test is made on its distinct values and read at each row's code (the same truth
    per row)."""
    coded = column.kind == "int" and column.coded
    nulls = column.nulls[lo:hi]
    if spec.values is not None:
        if column.kind == "text":
            wanted = [i for i, v in enumerate(column.categories) if v in set(spec.values)]
            inside = np.isin(column.value_slice(lo, hi), np.array(wanted, dtype=np.int64))
        elif coded:
            inside = np.isin(column.by_code, np.array(list(spec.values)))[column.code_slice(lo, hi)]
        else:
            inside = np.isin(column.value_slice(lo, hi), np.array(list(spec.values)))
        inside &= ~nulls
    elif spec.numeric and spec.bounded:
        values = column.by_code if coded else column.value_slice(lo, hi)
        inside = (values >= spec.lower) & (values <= spec.upper)
        if coded:
            inside = inside[column.code_slice(lo, hi)]
        inside &= ~nulls
    else:
        inside = ~nulls
    return inside | nulls if spec.nullable else inside
