"""The in-memory store of a large table and its compiled pass (dpsql.engine.clustered).

A table not held at connect gets a store built in the background (its columns in memory,
clustered by privacy unit: dpsql.engine.columnar.load_clustered); a program then runs as one
compiled pass over it. Every result must be the very integers of the plan's SQL and of the
numpy program: both are run on the same compiled queries here, on the generated data of
tests/test_columnar.py (NULLs, NaN, values outside their bounds, halves that round, text
outside its domain), row-level and per unit; then through the engine itself (a Parquet
source), including a new data version, which the old store must never answer.
"""

from __future__ import annotations

import dataclasses
import json
import random
import time

import duckdb
import numpy as np
import pytest
from test_columnar import _canonical, _loaded, _query

from dpsql.dbapi import Service
from dpsql.engine import clustered, columnar
from dpsql.engine.duckdb_engine import LARGE_ROWS
from dpsql.frontend.bind import parse_statement
from dpsql.pipeline import Settings
from dpsql.policy import load_policy
from dpsql.privacy.ledger import MemoryLedger
from dpsql.privacy.samplers import ZeroNoise

pytestmark = [
    pytest.mark.filterwarnings("error::RuntimeWarning"),
    pytest.mark.skipif(not clustered.available(), reason="numba is not installed"),
]


def _settings(svc: Service, bias: bool = False) -> Settings:
    """The policy's settings, with or without the bias measures (dpsql.plan.bias: the numpy
    program does not compute them, the compiled pass does)."""
    settings = Settings.from_policy(svc.policy)
    return dataclasses.replace(settings, bias_estimate="on" if bias else "off")


def _compiled(svc: Service, sql: str, bias: bool = False):
    settings = _settings(svc, bias)
    statement = parse_statement(sql, svc.policy)
    prepared = svc._prepare(svc._plans.key(sql, None, settings, "t"), statement, settings, "t")
    return svc._compiled(prepared).with_secret(4242)


def _spy(monkeypatch) -> list[str]:
    """Record each run of a kernel (so a comparison is known to have used it)."""
    calls: list[str] = []
    for name in ("bound_units", "row_sums"):
        original = getattr(clustered, name)

        def spied(*args, _original=original, _name=name, **kw):
            calls.append(_name)
            return _original(*args, **kw)

        monkeypatch.setattr(clustered, name, spied)
    return calls


@pytest.mark.parametrize("bias", [False, True], ids=["answer", "with-bias"])
@pytest.mark.parametrize(
    "unit, options, least",
    [
        (False, {}, 50),
        (True, {"bounding": "scale", "groups": 2}, 40),
        (True, {"bounding": "scale", "groups": 20}, 40),
    ],
    ids=["row-level", "unit-G2", "unit-G20"],
)
def test_the_compiled_pass_returns_what_the_sql_and_the_program_return(
    tmp_path, monkeypatch, unit, options, least, bias
):
    policy = _loaded(tmp_path, unit=unit, **options)
    svc = Service(policy, ledger=MemoryLedger(), cache=False)
    calls = _spy(monkeypatch)
    table = policy.tables["t1"]
    engine = svc.engine
    held = engine.columns["t1"]  # the numpy program's table (held at connect)
    store = columnar.load_clustered(engine._con.cursor(), table, held.version, LARGE_ROWS)
    if unit:  # clustered: each unit's rows contiguous, the units in code order
        codes = store.columns["u"].codes
        assert codes is not None and bool(np.all(codes[1:] >= codes[:-1]))
        assert store.unit_starts is not None and store.unit_starts[-1] == store.rows
    rng = random.Random(23 if unit else 29)
    ran = biased = 0
    try:
        for _ in range(250):
            sql = _query(rng)
            try:
                compiled = _compiled(svc, sql, bias)
            except Exception:  # refused: nothing to run
                continue
            if compiled.program is None:
                continue
            if bias:  # the bias measures are there (a COUNT, SUM or AVG is estimated)
                biased += any(m.kind in columnar.KERNEL_ONLY for m in compiled.program.measures)
            calls.clear()
            fast = columnar.run(compiled.program, store, table, compiled.swaps)
            if fast is None or not calls:
                continue
            ran += 1
            expected = engine.execute(dataclasses.replace(compiled, program=None))
            assert _canonical(fast) == _canonical(expected), sql
            program = columnar.run(compiled.program, held, table, compiled.swaps)
            if program is not None:
                assert _canonical(fast) == _canonical(program), sql
            else:  # only where the numpy program cannot run: the bias measures
                assert any(m.kind in columnar.KERNEL_ONLY for m in compiled.program.measures)
    finally:
        svc.close()
    print(f"{ran} compiled passes compared ({biased} with bias measures)")
    assert ran >= least and (biased >= least // 2 if bias else biased == 0)


@pytest.mark.parametrize("fetch", [None, 97], ids=["one-fetch", "by-unit-ranges"])
@pytest.mark.parametrize("unit", [False, True], ids=["row-level", "unit"])
def test_load_clustered_holds_the_rows_load_holds(tmp_path, monkeypatch, unit, fetch):
    """DuckDB's codes and order (load_clustered) against numpy's (load, then cluster): the
    same labels, the same rows as a multiset, the same units' extents and fixed points; also
    fetched by ranges of units (~97 rows each: the last with the rows of no unit)."""
    if fetch is not None:
        monkeypatch.setattr(columnar, "_FETCH_ROWS", fetch)
    policy = _loaded(tmp_path, unit=unit, rows=1500)
    svc = Service(policy, ledger=MemoryLedger(), cache=False)
    try:
        table = policy.tables["t1"]
        con = svc.engine._con.cursor()
        a = columnar.load_clustered(con, table, "v", LARGE_ROWS)
        b = columnar.cluster(columnar.load(con, table, "v", LARGE_ROWS), table)
    finally:
        svc.close()

    def rows(t: columnar.ColumnarTable) -> np.ndarray:
        arrays = []
        for name in sorted(t.columns):
            col = t.columns[name]
            arrays += [np.where(col.nulls, 0, col.values).astype(np.float64), col.nulls]
            if col.codes is not None:
                arrays.append(col.codes)
        matrix = np.stack([np.nan_to_num(np.asarray(x, dtype=np.float64)) for x in arrays])
        return matrix[:, np.lexsort(matrix[::-1])]

    assert {n: c.labels for n, c in a.columns.items()} == {
        n: c.labels for n, c in b.columns.items()
    }
    assert np.array_equal(rows(a), rows(b))
    assert a.fixed_index == b.fixed_index and a.nulls_index == b.nulls_index
    assert a.fixed is not None and b.fixed is not None
    assert sorted(map(tuple, a.fixed.T.tolist())) == sorted(map(tuple, b.fixed.T.tolist()))
    if unit:
        assert np.array_equal(a.unit_starts, b.unit_starts)  # type: ignore[arg-type]


def _parquet(path, rows: int, seed: int) -> None:
    con = duckdb.connect()
    con.execute(
        f"COPY (SELECT CAST(hash(i, {seed}) % {rows // 7 + 1} AS BIGINT) AS uid, "
        f"CAST(hash(i, {seed} + 1) % 90 AS BIGINT) AS age, "
        f"['a', 'b', 'c', 'd', 'e'][1 + CAST(hash(i, {seed} + 2) % 5 AS BIGINT)] AS dept, "
        f"CASE WHEN hash(i, {seed} + 3) % 20 = 0 THEN NULL "
        f"ELSE CAST(hash(i, {seed} + 4) % 100000 AS DOUBLE) / 100 END AS cost "
        f"FROM range({rows}) t(i)) TO '{path}' (FORMAT parquet)"
    )
    con.close()


def _large_policy(path) -> dict:
    # clip "declared": the store and the SQL compared at one clamp (unstated, each run with the
    # cache off buys a clamp histogram whose <= R rows per unit a fresh secret picks)
    columns = {
        "uid": {"type": "int", "nullable": False},
        "age": {"type": "int", "lower": 0, "upper": 100, "clip": "declared"},
        "dept": {"type": "text", "values": ["a", "b", "c", "d"]},
        "cost": {
            "type": "float",
            "lower": 0.0,
            "upper": 500.0,
            "granularity": 0.01,
            "clip": "declared",
        },
    }
    return {
        "privacy": {"epsilon": 1.0, "delta": 1e-6, "budget_epsilon": 1e9, "budget_delta": 0.5},
        "tables": {
            "v": {
                "source": str(path),
                "columns": columns,
                "privacy_unit": "uid",
                "max_rows_per_unit": 3,
                "max_groups_per_unit": 1,
            },
            "vr": {"source": str(path), "columns": columns},
        },
    }


QUERIES = [
    "SELECT dept, COUNT(*), SUM(cost), AVG(cost) FROM {t} WHERE age > 17 GROUP BY dept",
    "SELECT dept, COUNT(*), SUM(cost), AVG(cost) FROM {t} GROUP BY dept",
    "SELECT COUNT(*), AVG(age), STDDEV(cost) FROM {t} WHERE dept = 'b' OR cost < 100",
]


def _measures(svc: Service, sql: str):
    compiled = _compiled(svc, sql)
    local = svc.engine._run_columns(compiled, None) if compiled.program is not None else None
    expected = svc.engine.execute(dataclasses.replace(compiled, program=None))
    return local, expected


def test_a_large_table_gets_its_store_in_the_background(tmp_path, monkeypatch):
    """No setting: a Parquet source is not held at connect; its store is built on a thread of
    its own, used once ready (the compiled pass, the SQL's integers), and the answers through
    the service are the same with and without it."""
    path = tmp_path / "v.parquet"
    _parquet(path, 5000, 1)
    svc = Service(
        load_policy(_large_policy(path)), ledger=MemoryLedger(), cache=False, noise=ZeroNoise()
    )
    calls = _spy(monkeypatch)
    try:
        assert svc.engine.wait_for_stores(120)
        assert {"v", "vr"} <= set(svc.engine.columns)
        for t in ("v", "vr"):
            for q in QUERIES:
                sql = q.format(t=t)
                calls.clear()
                local, expected = _measures(svc, sql)
                assert local is not None and calls, sql  # the compiled pass answered
                assert _canonical(local) == _canonical(expected), sql
                settings = _settings(svc)
                with_store = svc.execute(sql, None, settings, "a")
                held = dict(svc.engine.columns)
                svc.engine.columns.clear()  # the SQL plans, as before the store was ready
                try:
                    without = svc.execute(sql, None, settings, "a")
                finally:
                    svc.engine.columns.update(held)
                assert with_store.rows == without.rows, sql
    finally:
        svc.close()


def test_a_new_data_version_never_reads_the_old_store(tmp_path):
    """A replaced Parquet file is a new data version: the old store is dropped at the next
    query (which runs its SQL), a new one is built for the new rows and answers them."""
    path = tmp_path / "v.parquet"
    _parquet(path, 3000, 1)
    svc = Service(load_policy(_large_policy(path)), ledger=MemoryLedger(), cache=False)
    sql = QUERIES[0].format(t="v")
    try:
        assert svc.engine.wait_for_stores(120)
        old = svc.engine.columns["v"]
        before, _ = _measures(svc, sql)
        time.sleep(0.01)
        _parquet(tmp_path / "w.parquet", 4000, 9)
        (tmp_path / "w.parquet").replace(path)
        compiled = _compiled(svc, sql)
        assert svc.engine._run_columns(compiled, None) is None  # stale: the SQL runs
        assert svc.engine.wait_for_stores(120)
        new = svc.engine.columns["v"]
        assert new is not old and new.version == svc.engine.versions["v"] != old.version
        after, expected = _measures(svc, sql)
        assert after is not None and _canonical(after) == _canonical(expected)
        assert _canonical(after) != _canonical(before)
    finally:
        svc.close()


def test_small_tables_sql_builds_no_store(tmp_path):
    path = tmp_path / "v.parquet"
    _parquet(path, 500, 1)
    policy = _large_policy(path)
    policy["engine"] = {"small_tables": "sql"}
    svc = Service(load_policy(policy), ledger=MemoryLedger(), cache=False)
    try:
        assert svc.engine.wait_for_stores(60) and not svc.engine.columns
    finally:
        svc.close()


@pytest.mark.parametrize("unit", [False, True], ids=["row-level", "unit"])
def test_the_compiled_pass_reads_the_same_arrays_whatever_the_where_keeps(
    tmp_path, monkeypatch, unit
):
    """Fixed shapes (docs/threat_model.md, "Column programs"): the kernel is handed every row
    of the table and every group code whether the WHERE keeps every row, some or none (inside,
    each row is accumulated with its weight and each pair of a unit's rows bounded)."""
    svc = Service(_loaded(tmp_path, unit=unit, rows=600), ledger=MemoryLedger(), cache=False)
    shapes: list[tuple] = []
    for name in ("bound_units", "row_sums"):
        original = getattr(clustered, name)

        def spied(*args, _original=original):
            shapes.append(tuple(getattr(a, "shape", a) for a in args if not isinstance(a, list)))
            return _original(*args)

        monkeypatch.setattr(clustered, name, spied)
    seen = []
    try:
        for where in ("", " WHERE u = 3", " WHERE a > 1000", " WHERE t = 'beta' OR b"):
            shapes.clear()
            compiled = _compiled(svc, f"SELECT t, COUNT(*), SUM(a) FROM t1{where} GROUP BY t", True)
            assert svc.engine._run_columns(compiled, None) is not None
            seen.append(list(shapes))
    finally:
        svc.close()
    assert all(s == seen[0] for s in seen) and seen[0]


def test_closing_or_exiting_while_a_store_is_built(tmp_path):
    """A build still reading is interrupted and waited for: close() does not meet DuckDB's
    'connection is busy' refusal, and a process that exits mid-build exits cleanly (a thread
    inside DuckDB at interpreter exit used to abort it)."""
    import subprocess
    import sys

    path = tmp_path / "v.parquet"
    _parquet(path, 300_000, 1)
    for delay in (0.0, 0.3):
        svc = Service(load_policy(_large_policy(path)), ledger=MemoryLedger(), cache=False)
        time.sleep(delay)
        svc.close()  # raises nothing
    script = (
        "import json, sys, time\n"
        "from dpsql.pipeline import Service\n"
        "from dpsql.privacy.ledger import MemoryLedger\n"
        "svc = Service(json.loads(sys.argv[1]), ledger=MemoryLedger(), cache=False)\n"
        "time.sleep(float(sys.argv[2]))\n"
    )
    for delay in ("0", "0.3"):
        proc = subprocess.run(
            [sys.executable, "-c", script, json.dumps(_large_policy(path)), delay],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]


def test_the_rounding_order_and_divisions_are_numpy_s():
    """The pass's helpers for the per-unit rounding (no copy per unit, shifts for the
    power-of-two grids) give numpy's sort and Python's floor division: every branch (codes
    read off the seen flags, insertion sort, in-place sort; shift or division), any sign."""
    rng = np.random.default_rng(5)
    for size, t in [(17, 10), (17, 1), (40, 2), (500, 3), (500, 32), (5000, 33), (5000, 400)]:
        for _ in range(20):
            codes = rng.choice(size, size=t, replace=False).astype(np.int64)
            touched = np.zeros(size, dtype=np.int64)
            touched[:t] = codes
            seen = np.zeros(size, dtype=np.bool_)
            seen[codes] = True
            clustered._order_pairs(touched, t, seen, size)
            assert touched[:t].tolist() == sorted(codes.tolist()), (size, t)
    for d in [1, 2, 3, 8, 1000, 1 << 20, (1 << 20) + 1, 1 << 40]:
        shift = clustered._shift(d)
        assert shift == (d.bit_length() - 1 if d & (d - 1) == 0 else -1)
        xs = [0, 1, -1, d - 1, d, -d, -d - 1, 2**62, -(2**62), 2**63 - 1, -(2**63)]
        xs += rng.integers(-(2**62), 2**62, size=50).tolist()
        for x in xs:
            assert clustered._floordiv(x, d, shift) == x // d, (x, d)
