"""The store's memory layout (dpsql.engine.columnar.load_clustered, issue 28 items 3-4): codes
as narrow as their domain, an int column held as codes only (its values its labels at its
codes), NULL masks written only where a column has a NULL, fixed-point rows computed the first
time a program reads them. None of it may change an answer: the WHERE on an int column's codes
is the same truth per row as on its values, and the store's answers are the SQL's (here on a
few queries; tests/test_clustered.py compares many)."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
from sqlglot import exp, parse_one
from test_columnar import _canonical, _compiled, _loaded, _query

from dpsql.dbapi import Service
from dpsql.engine import clustered, columnar
from dpsql.engine.duckdb_engine import LARGE_ROWS
from dpsql.privacy.ledger import MemoryLedger

pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")


def _int_tables(seed: int) -> tuple[columnar.ColumnarTable, columnar.ColumnarTable]:
    """One int column with NULLs (values beyond +-2^40 among small ones), held as values
    (no codes: the value tests) and as codes into its sorted distinct values (the store's)."""
    rng = random.Random(seed)
    pool = [0, 1, -1, 2, 3, 7, -7, 10, 99, 2**40, -(2**40), 2**62 - 1, -(2**62) + 1]
    raw = [rng.choice(pool) if rng.random() > 0.1 else None for _ in range(400)]
    nulls = np.array([v is None for v in raw])
    values = np.array([0 if v is None else v for v in raw], dtype=np.int64)
    labels = (*sorted({v for v in raw if v is not None}), None)
    codes = np.array(
        [len(labels) - 1 if v is None else labels.index(v) for v in raw],
        dtype=columnar.code_dtype(len(labels)),
    )
    by_values = {"x": columnar.Column("int", values, nulls)}
    by_codes = {"x": columnar.Column("int", None, nulls, codes, labels)}
    rows = len(raw)
    return (
        columnar.ColumnarTable("t", "v", rows, by_values, LARGE_ROWS),
        columnar.ColumnarTable("t", "v", rows, by_codes, LARGE_ROWS),
    )


def test_an_int_columns_codes_give_the_truth_its_values_give():
    plain, coded = _int_tables(5)
    assert coded.columns["x"].stored is None and coded.columns["x"].codes.dtype == np.uint8
    x = plain.columns["x"]
    assert np.array_equal(coded.columns["x"].values, np.where(x.nulls, 0, x.values))
    literals = ["0", "1", "2.5", "-2.5", "-1", "6.999", "7", "-7.0", "10", "1e0", "99.5",
                "1099511627776", "-1099511627776", "-1099511627776.5", "4611686018427387903",
                "123456789012"]  # fmt: skip
    texts = []
    for lit in literals:
        for op in ("=", "<>", ">", ">=", "<", "<="):
            texts += [f"x {op} {lit}", f"{lit} {op} x", f"NOT x {op} {lit}"]
        texts += [f"x BETWEEN -7 AND {lit}", f"x IN ({lit}, 3, -7)", f"x NOT IN ({lit}, 2)"]
    texts += ["x IS NULL", "x IS NOT NULL", "x > 2 OR x IS NULL", "x IN (2.5)"]
    ran = 0
    for text in texts:
        where = parse_one(f"SELECT 1 WHERE {text}").args["where"].this
        assert isinstance(where, exp.Expression)
        try:
            want = columnar._condition(where, plain, {})
        except columnar.NotRunnable:
            with pytest.raises(columnar.NotRunnable):
                columnar._condition(where, coded, {})
            continue
        got = columnar._condition(where, coded, {})
        assert want is not None and got is not None
        whole = want(0, plain.rows)
        assert np.array_equal(whole, got(0, coded.rows)), text
        # by ranges (the engine evaluates a WHERE by chunks of rows): the same truth per row
        parts = [got(0, 137), got(137, 138), got(138, coded.rows)]
        assert np.array_equal(whole, np.concatenate(parts)), text
        ran += 1
    assert ran >= 250


def _store(tmp_path, **kw):
    policy = _loaded(tmp_path, **kw)
    svc = Service(policy, ledger=MemoryLedger(), cache=False)
    held = svc.engine.columns["t1"]
    store = columnar.load_clustered(svc.engine._con.cursor(), policy.tables["t1"], held.version,
                                    LARGE_ROWS)  # fmt: skip
    return svc, policy, store


@pytest.mark.skipif(not clustered.available(), reason="numba is not installed")
def test_the_store_holds_narrow_codes_and_fills_fixed_rows_when_read(tmp_path):
    svc, policy, store = _store(tmp_path, unit=True, bounding="scale", groups=2)
    try:
        table = policy.tables["t1"]
        for name, column in store.columns.items():
            kind = table.columns[name].type
            if column.held_codes is not None:
                dtype = column.held_codes.dtype
                assert dtype == columnar.code_dtype(len(column.labels)), name
            if kind == "int":  # codes only: its values gathered from its labels
                assert column.stored is None, name
            if not column.nulls.any():  # never written: the zeros' pages are never mapped
                assert not column.nulls.any()
        unit = store.columns["u"]  # an int unit: its codes one a unit (runs), not a row
        assert unit.held_codes is None and unit.runs is not None
        assert np.array_equal(unit.runs[0], store.unit_starts)
        fixed = store.fixed_rows
        assert fixed is not None and not any(fixed._done)  # nothing computed at build
        sums = [n for n, c in table.columns.items() if c.numeric and c.bounded]
        assert sums
        sql = f"SELECT COUNT(*), SUM({sums[0]}) FROM t1"
        compiled = _compiled(svc, sql, bias=False)
        assert compiled.program is not None
        fast = columnar.run(compiled.program, store, table, compiled.swaps)
        expected = svc.engine.execute(dataclasses.replace(compiled, program=None))
        assert _canonical(fast) == _canonical(expected)
        assert "codes" not in vars(unit)  # the pass read the runs, never a code a row
        assert table.columns[sums[0]].type == "int"
        done = [key for key, i in (store.fixed_index or {}).items() if fixed._done[i]]
        assert not done  # an int column's rows are looked up at its codes, never filled
        looked = [key for key, i in (store.fixed_index or {}).items() if fixed._looked[i]]
        assert looked and {key[1] for key in looked} == {sums[0]}  # only the column it sums
        # every row filled on a whole read, each the same integers as a filling by parts
        whole = store.fixed
        assert whole is not None and all(fixed._done)
        again = columnar.cluster(columnar.load(svc.engine._con.cursor(), table, "v", LARGE_ROWS),
                                 table).fixed  # fmt: skip
        assert sorted(map(tuple, whole.T.tolist())) == sorted(map(tuple, again.T.tolist()))
        # a fixed point read from its column's widest row, clamped (columnar._kernel_spec):
        # the very integers of its own row, on NaN, infinities, halves and values out of bounds
        index = store.fixed_index or {}
        compared = 0
        for (role, name, lo, hi), own in index.items():
            wide = columnar._widest_row(index, name, lo, hi)
            if role != "fixed" or wide is None or wide == own:
                continue
            kept = ~store.columns[name].nulls
            assert np.array_equal(np.clip(whole[wide], lo, hi)[kept], whole[own][kept]), name
            compared += 1
        assert compared >= 2  # a and x
    finally:
        svc.close()


def test_code_dtype_is_the_narrowest_that_holds_the_domain():
    assert columnar.code_dtype(1) == np.uint8 and columnar.code_dtype(256) == np.uint8
    assert columnar.code_dtype(257) == np.uint16 and columnar.code_dtype(65536) == np.uint16
    assert columnar.code_dtype(65537) == np.int32


@pytest.mark.skipif(not clustered.available(), reason="numba is not installed")
def test_a_where_by_chunks_gives_the_sqls_answers(tmp_path, monkeypatch):
    """The WHERE evaluated by chunks of rows (and fixed-point rows filled by chunks) of 97
    rows: every answer the SQL's, on generated WHEREs over every kind of column."""
    monkeypatch.setattr(columnar, "_FILL_ROWS", 97)
    svc, policy, store = _store(tmp_path, unit=True, bounding="scale", groups=2)
    rng = random.Random(31)
    ran = 0
    try:
        for _ in range(24):
            sql = _query(rng)
            try:
                compiled = _compiled(svc, sql, bias=True)
            except Exception:  # refused: nothing to run
                continue
            if compiled.program is None or compiled.program.where is None:
                continue
            fast = columnar.run(compiled.program, store, policy.tables["t1"], compiled.swaps)
            if fast is None:
                continue
            expected = svc.engine.execute(dataclasses.replace(compiled, program=None))
            assert _canonical(fast) == _canonical(expected), sql
            ran += 1
    finally:
        svc.close()
    print(f"{ran} WHEREs by chunks compared")
    assert ran >= 8


@pytest.mark.skipif(not clustered.available(), reason="numba is not installed")
def test_a_float_columns_fixed_points_computed_in_the_pass_are_its_rows(tmp_path, monkeypatch):
    """A float column's fixed-point and clamp-excess rows are computed by the compiled pass
    from its values, block by block (clustered._fill; blocks of 7 rows here, so units and
    blocks cut each other), never filled for it: the very integers its rows hold when filled
    (columnar._fixed_point, _clamp_excess) on NaN, infinities, 1e300, ties of x / 0.5 and
    values out of bounds; and a SUM and AVG of it give the SQL's answer."""
    monkeypatch.setattr(clustered, "_BLOCK", 7)
    svc, policy, store = _store(tmp_path, unit=True, bounding="scale", groups=2)
    try:
        fixed = store.fixed_rows
        assert fixed is not None and fixed.floats is not None
        index = store.fixed_index or {}
        rows = {i: key for key, i in index.items() if key[1] == "x"}
        assert len(rows) >= 3  # two fixed-point ranges and the excess
        from_floats = {i for i, f in enumerate(fixed.fused) if f is not None and f[0] < 3.0}
        assert from_floats == set(rows)  # x's, computed from its values (an int's: looked up)
        sql = "SELECT k, COUNT(*), SUM(x), AVG(x) FROM t1 GROUP BY k"
        compiled = _compiled(svc, sql, bias=True)
        assert compiled.program is not None
        fast = columnar.run(compiled.program, store, policy.tables["t1"], compiled.swaps)
        expected = svc.engine.execute(dataclasses.replace(compiled, program=None))
        assert _canonical(fast) == _canonical(expected)
        assert not any(fixed._done[i] for i in rows)  # the pass computed them: none filled
        whole = store.fixed  # every row filled, as before
        assert whole is not None
        kept = ~store.columns["x"].nulls
        values = store.columns["x"].values
        assert np.isnan(values[kept]).any() and np.isinf(values[kept]).any()
        order = sorted(rows)
        computed = clustered.fused_values(fixed.floats, [fixed.fused[i] for i in order], store.rows)
        for j, i in enumerate(order):
            assert np.array_equal(computed[j][kept], whole[i][kept].astype(np.int64)), rows[i]
    finally:
        svc.close()


def test_int_labels_behave_as_the_tuple_of_values_then_none():
    """An int column's labels held as one int64 array (dpsql.engine.int_labels) read as the
    tuple ``(*values, None)`` it replaces, everywhere the store reads labels."""
    import bisect

    from dpsql.engine.int_labels import IntLabels

    values = [-(2**62), -7, 0, 3, 10, 2**40, 2**62 - 1]
    held, plain = IntLabels(np.array(values, dtype=np.int64)), (*values, None)
    assert len(held) == len(plain) and list(held) == list(plain) and held == plain
    for i in range(-len(plain), len(plain)):
        assert held[i] == plain[i] and type(held[i]) is type(plain[i]), i
    with pytest.raises(IndexError):
        held[len(plain)]
    categories = held[:-1]
    assert list(categories) == values and len(categories) == len(values)
    assert held[1:3] == plain[1:3] and held[::-1] == plain[::-1]
    for probe in (-(2**63), -(2**62), -8, -7, 1, 3, 2**40, 2**62, 2**64):  # exact, any size
        assert bisect.bisect_left(categories, probe) == bisect.bisect_left(values, probe)
        assert bisect.bisect_right(categories, probe) == bisect.bisect_right(values, probe)
    assert np.array_equal(np.asarray(categories), np.array(values, dtype=np.int64))
    assert np.array(categories, dtype=np.int64).dtype == np.int64


@pytest.mark.skipif(not clustered.available(), reason="numba is not installed")
def test_a_stores_int_labels_are_one_int64_array(tmp_path):
    from dpsql.engine.int_labels import IntLabels

    svc, policy, store = _store(tmp_path, unit=True, bounding="scale", groups=2)
    try:
        for name in ("u", "a", "k"):  # the unit and the int columns
            labels = store.columns[name].labels
            assert isinstance(labels, IntLabels) and labels.values.dtype == np.int64, name
        sql = "SELECT k, COUNT(*), SUM(a) FROM t1 WHERE u > 3 AND a IN (1, 2, 50) GROUP BY k"
        compiled = _compiled(svc, sql, bias=True)
        assert compiled.program is not None
        fast = columnar.run(compiled.program, store, policy.tables["t1"], compiled.swaps)
        expected = svc.engine.execute(dataclasses.replace(compiled, program=None))
        assert fast is not None and _canonical(fast) == _canonical(expected)
    finally:
        svc.close()


def _widened(store: columnar.ColumnarTable, policy, widths: dict[str, type]):
    """``store`` clustered again with the named int columns' codes widened (uint16, int32:
    the codes of a domain over 256 and over 65,536 values), copied into a new code array."""
    columns = {
        name: dataclasses.replace(c, held_codes=c.held_codes.astype(widths[name]))
        if name in widths else c
        for name, c in store.columns.items()
    }  # fmt: skip
    table = columnar.ColumnarTable(store.name, store.version, store.rows, columns, store.capacity)
    return columnar.cluster(table, policy)


INT_QUERIES = [
    "SELECT k, COUNT(*), SUM(a), AVG(a) FROM t1 GROUP BY k",
    "SELECT t, SUM(a), VARIANCE(a), SUM(k) FROM t1 WHERE a > 3 OR x < 1 GROUP BY t",
    "SELECT COUNT(*), SUM(a), AVG(k), SUM(x) FROM t1 WHERE b",
    "SELECT b, SUM(a), AVG(a) FROM t1 WHERE k IN (1, 4) GROUP BY b",
]


@pytest.mark.skipif(not clustered.available(), reason="numba is not installed")
def test_an_int_columns_fixed_points_are_looked_up_in_the_pass_never_filled(tmp_path, monkeypatch):
    """An int column's fixed-point and clamp-excess values are looked up by the compiled
    pass at each row's code in a table of its domain (clustered._look_up; blocks of 7 rows,
    so units and blocks cut each other), on codes of 1, 2 and 4 bytes: no full-length row is
    filled (its row's compute raises if called), no array of the table's length is made for
    it (its values are never gathered whole, its tables are its domain long), the very
    integers its filled rows hold, and the SQL's answers."""
    monkeypatch.setattr(clustered, "_BLOCK", 7)
    svc, policy, built = _store(tmp_path, unit=True, bounding="scale", groups=2)
    table = policy.tables["t1"]
    try:
        for store in (built, _widened(built, table, {"a": np.uint16, "k": np.int32})):
            fixed = store.fixed_rows
            index = store.fixed_index or {}
            assert fixed is not None and fixed.codes is not None
            ints = {i: key for key, i in index.items() if key[1] in ("a", "k")}
            assert len(ints) >= 5  # a's two ranges and excess, k's range(s) and excess
            assert {i for i, f in enumerate(fixed.fused) if f and f[0] == 3.0} == set(ints)
            widths = {store.columns[n].held_codes.dtype.itemsize for n in ("a", "k")}
            assert widths in ({1}, {2, 4})

            def never(lo, hi):
                raise AssertionError("an int column's fixed-point row was filled")

            kept_computes = list(fixed._compute)
            for i in ints:
                fixed._compute[i] = never
            for sql in INT_QUERIES:
                compiled = _compiled(svc, sql, bias=True)
                assert compiled.program is not None, sql
                fast = columnar.run(compiled.program, store, table, compiled.swaps)
                expected = svc.engine.execute(dataclasses.replace(compiled, program=None))
                assert fast is not None and _canonical(fast) == _canonical(expected), sql
            assert not any(fixed._done[i] for i in ints)
            looked = [ints[i] for i in ints if fixed._looked[i]]  # read by some query
            assert {key[:2] for key in looked} >= {(r, n) for r in ("fixed", "excess")
                                                   for n in ("a", "k")}  # fmt: skip
            for name in ("a", "k"):
                assert "values" not in vars(store.columns[name])  # never gathered whole
            domains = sum(len(store.columns[key[1]].labels) for key in ints.values())
            assert len(fixed.lut) == domains < store.rows  # tables of the domains, not rows
            # the very integers of the filled rows (the numpy path fills them, as before)
            fixed._compute[:] = kept_computes
            whole = store.fixed
            assert whole is not None
            order = sorted(ints)
            fixed.looked_up(order)  # the tables no query read (a narrower range's)
            computed = clustered.fused_values(
                fixed.floats, [fixed.fused[i] for i in order], store.rows, fixed.codes, fixed.lut
            )
            for j, i in enumerate(order):
                kept = ~store.columns[ints[i][1]].nulls
                assert np.array_equal(computed[j][kept], whole[i][kept].astype(np.int64)), ints[i]
    finally:
        svc.close()


@pytest.mark.skipif(not clustered.available(), reason="numba is not installed")
def test_an_int_columns_looked_up_fixed_points_give_the_filled_rows_answers(tmp_path):
    """Bit-identical to the store before the lookup: every exact aggregate (bias measures
    included) of a pass that looks an int column's fixed points up equals that of a pass
    reading its filled rows (the lookup switched off: fused None, as before), for the same
    compiled query and secret, so every released answer is the same."""
    svc, policy, store = _store(tmp_path, unit=True, bounding="scale", groups=2)
    table = policy.tables["t1"]
    try:
        old = columnar.cluster(
            columnar.ColumnarTable(store.name, store.version, store.rows, store.columns,
                                   store.capacity), table,
        )  # fmt: skip
        assert old.fixed_rows is not None
        old.fixed_rows.fused = [
            f if f is None or f[0] < 3.0 else None for f in old.fixed_rows.fused
        ]
        for sql in INT_QUERIES:
            for bias in (True, False):
                compiled = _compiled(svc, sql, bias=bias)
                assert compiled.program is not None
                new = columnar.run(compiled.program, store, table, compiled.swaps)
                before = columnar.run(compiled.program, old, table, compiled.swaps)
                assert new is not None and before is not None
                assert new.key_rows == before.key_rows, sql
                assert [list(m) for m in new.measures] == [list(m) for m in before.measures], sql
                assert new.key_types == before.key_types
        assert old.fixed_rows._done != [False] * len(old.fixed_rows._done)  # it filled them
        assert not any(store.fixed_rows._done)  # the lookup filled none
    finally:
        svc.close()
