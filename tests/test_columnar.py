"""Column programs (dpsql.lower.local_plan, dpsql.engine.columnar) against the plan's SQL.

A program must return exactly the integers DuckDB returns for the same compiled query: every
test here runs both on the same engine and compares them, on generated data (NULLs, NaN,
values outside their bounds, halves that round, text outside its domain, accents) and on
generated queries within the programs' reach and beyond it (where the SQL must run), row-level
and per unit, through the planner and through the service's shape cache (whose templates hold
sentinel numbers that each statement's literals replace).
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import numpy as np
import pytest
from conftest import budget, write_csv

import dpsql
from dpsql.dbapi import Service
from dpsql.errors import OperationalError
from dpsql.frontend.bind import parse_statement
from dpsql.pipeline import Settings
from dpsql.policy import load_policy
from dpsql.privacy.ledger import MemoryLedger

# A warning only some data produce (an overflow to inf) would fail a query under -W error
pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")

TEXTS = ["alpha", "beta", "gamma", "émile", "Zed", "zz top"]  # values list: the first four


def _data(path: Path, rows: int, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(rows):
        u = None if rng.random() < 0.02 else int(rng.integers(0, rows // 4 + 1))
        a = None if rng.random() < 0.05 else int(rng.integers(-20, 130))
        x: object = round(float(rng.normal(0, 40)) * 4) / 4  # quarters: x / 0.5 has ties
        r = rng.random()
        x = None if r < 0.05 else ("nan" if r < 0.08 else x)
        x = rng.choice(["inf", "-inf", 1e300, -1e308]) if 0.08 <= r < 0.09 else x
        t = None if rng.random() < 0.05 else TEXTS[int(rng.integers(0, len(TEXTS)))]
        b = None if rng.random() < 0.1 else bool(rng.random() < 0.4)
        k = int(rng.integers(0, 7))  # bounds 1..4: some outside
        month, dom = int(rng.integers(1, 4)), int(rng.integers(1, 29))
        day = None if rng.random() < 0.05 else f"2024-{month:02d}-{dom:02d}"
        out.append((u, a, x, t, b, k, f"w{int(rng.integers(0, 30))}", day))
    return write_csv(path, ["u", "a", "x", "t", "b", "k", "w", "d"], out)


def _policy(csv: Path, *, unit: bool, bounding: str = "scale", groups: int = 2) -> dict:
    table: dict = {
        "source": str(csv),
        "columns": {
            "u": {"type": "int", "nullable": True},
            # clip "declared": the passes are compared at the declared clamp (unstated, a
            # SUM's range is bought from a kept DP histogram first: dpsql.service.bounds)
            "a": {"type": "int", "lower": 0, "upper": 100, "nullable": True, "clip": "declared"},
            "x": {
                "type": "float",
                "lower": -50.0,
                "upper": 50.0,
                "granularity": 0.5,
                "nullable": True,
                "clip": "declared",
            },
            "t": {"type": "text", "values": TEXTS[:4], "nullable": True},
            "b": {"type": "bool", "nullable": True},
            "k": {"type": "int", "lower": 1, "upper": 4, "nullable": False},
            "w": {"type": "text", "nullable": False},
            "d": {"type": "date", "nullable": True},
        },
    }
    if unit:
        table.update(
            privacy_unit="u", max_rows_per_unit=2, max_groups_per_unit=groups, bounding=bounding
        )
    return {
        "privacy": {"epsilon": 1.0, "delta": 1e-6, "budget_epsilon": 1e9, "budget_delta": 0.5},
        "tables": {"t1": table},
    }


def _loaded(tmp_path: Path, *, unit: bool, rows: int = 3000, seed: int = 7, **kw):
    """The generated table's policy, loaded (``kw``: _policy's bounding and groups)."""
    csv = _data(tmp_path / f"t1_{seed}.csv", rows, seed)
    return load_policy(_policy(csv, unit=unit, **kw))


def _service(tmp_path: Path, **kw) -> Service:
    return Service(_loaded(tmp_path, **kw), ledger=MemoryLedger(), cache=False)


def _connect(tmp_path: Path, **kw):
    return dpsql.connect(policy=_loaded(tmp_path, **kw), ledger=MemoryLedger(), cache=False)


def _compiled(svc: Service, sql: str, *, bias: bool = True):
    """The compiled query of ``sql`` (``bias`` False: without the bias measures, which only
    the compiled pass computes, never the numpy program)."""
    settings = Settings.from_policy(svc.policy)
    if not bias:
        settings = dataclasses.replace(settings, bias_estimate="off")
    statement = parse_statement(sql, svc.policy)
    prepared = svc._prepare(svc._plans.key(sql, None, settings, "t"), statement, settings, "t")
    return svc._compiled(prepared).with_secret(4242)


def _both(svc: Service, compiled) -> tuple[object, object]:
    """(the program's result or None, the SQL's result), rows in one order."""
    engine = svc.engine
    local = engine._run_columns(compiled, None) if compiled.program is not None else None
    sql = engine.execute(dataclasses.replace(compiled, program=None))
    return _canonical(local), _canonical(sql)


def _canonical(result):
    if result is None:
        return None
    rows = sorted(
        zip(result.key_rows, zip(*result.measures, strict=True), strict=True),
        key=lambda r: repr(r[0]),
    )
    return rows, result.key_types


KEYS = ["t", "b", "k", "a", "w", "x"]


def _numpy_only(monkeypatch) -> None:
    """Run the numpy programs, not the compiled pass over the held store (which a table held
    at connect gets too: dpsql.engine.clustered), for a test of the numpy path itself."""
    from dpsql.engine import clustered

    monkeypatch.setattr(clustered, "available", lambda: False)


AGGREGATES = [
    "COUNT(*)",
    "COUNT(x)",
    "SUM(a)",
    "AVG(x)",
    "SUM(x)",
    "VARIANCE(a)",
    "STDDEV(x)",
    "AVG(a)",
    "COUNT(a)",
]


def _condition(rng: random.Random, depth: int = 0) -> str:
    r = rng.random()
    if depth < 2 and r < 0.3:
        op = rng.choice(["AND", "OR"])
        return f"({_condition(rng, depth + 1)} {op} {_condition(rng, depth + 1)})"
    if depth < 2 and r < 0.38:
        return f"NOT ({_condition(rng, depth + 1)})"
    column = rng.choice(["a", "x", "t", "b", "k", "w", "u", "d"])
    cmp = rng.choice(["=", "<>", "<", "<=", ">", ">="])
    if column in ("a", "k", "u"):
        value = rng.choice(["0", "3", "50", "2.5", "-7", "100", "99.99", "1000000000000.5"])
    elif column == "x":
        value = rng.choice(["0", "0.5", "-12.25", "12.3", "49.75", "-50", "1e2", "0.1"])
    elif column == "d":
        day = rng.choice(["2024-01-01", "2024-02-29", "2024-03-15", "2023-12-31", "2024-02-30"])
        value = rng.choice([f"'{day}'", f"DATE '{day}'", f"CAST('{day}' AS DATE)", "'2024-1-5'"])
    elif column in ("t", "w"):
        value = "'" + rng.choice([*TEXTS, "", "beta ", "w3", "w12", "émile"]) + "'"
    else:
        value = rng.choice(["TRUE", "FALSE"])
        cmp = rng.choice(["=", "<>"])
    shape = rng.random()
    if shape < 0.1:
        return f"{column} IS {'NOT ' if rng.random() < 0.5 else ''}NULL"
    if shape < 0.2 and column not in ("b",):
        low, high = sorted([value, value]) if column in ("t", "w") else (value, value)
        return f"{column} BETWEEN {low} AND {high}"
    if shape < 0.3:
        return f"{column} IN ({value}, {value})"
    if shape < 0.35 and column == "b":
        return "b" if rng.random() < 0.5 else "NOT b"
    if shape < 0.42:
        return f"{value} {cmp} {column}"  # the literal on the left
    return f"{column} {cmp} {value}"


def _query(rng: random.Random) -> str:
    keys = rng.sample(KEYS, rng.choice([0, 0, 1, 1, 2]))
    aggregates = rng.sample(AGGREGATES, rng.randint(1, 3))
    where = f" WHERE {_condition(rng)}" if rng.random() < 0.85 else ""
    group = f" GROUP BY {', '.join(keys)}" if keys else ""
    return f"SELECT {', '.join([*keys, *aggregates])} FROM t1{where}{group}"


@pytest.mark.parametrize(
    "unit, options, least",
    [
        (False, {}, 80),
        (True, {"bounding": "scale", "groups": 2}, 60),
        (True, {"bounding": "scale", "groups": 20}, 60),
        (True, {"bounding": "sample", "groups": 2}, 3),  # value sums sample: SQL only
    ],
    ids=["row-level", "unit-scale-G2", "unit-scale-G20", "unit-sample"],
)
def test_programs_return_what_the_sql_returns(tmp_path, unit, options, least):
    svc = _service(tmp_path, unit=unit, **options)
    rng = random.Random(11 if unit else 5)
    ran = 0
    try:
        for _ in range(150):
            sql = _query(rng)
            try:
                compiled = _compiled(svc, sql)
            except Exception:  # refused (e.g. a key without a public domain): nothing to run
                continue
            local, expected = _both(svc, compiled)
            if local is not None:
                ran += 1
                assert local == expected, sql
    finally:
        svc.close()
    print(f"{ran} programs compared")
    assert ran >= least  # the comparison ran on programs, not only on fallbacks


def test_programs_under_the_shape_cache_use_each_statements_literals(tmp_path):
    """Templates hold sentinel numbers; each statement's own numbers must be the ones the
    program compares with (run through the DB-API: plan cache, text shapes, shapes)."""
    conn = _connect(tmp_path, unit=True)
    svc = conn.service
    seen = []
    execute = svc.engine.execute

    def checked(compiled, handle=None):
        if compiled.program is not None:
            local, expected = _both(svc, compiled)
            if local is not None:
                seen.append(compiled.swaps)
                assert local == expected
        return execute(compiled, handle)

    svc.engine.execute = checked  # type: ignore[method-assign]
    cur = conn.cursor()
    try:
        for i in range(12):
            cur.execute(f"SELECT t, COUNT(*), AVG(x) FROM t1 WHERE a > {i * 7} GROUP BY t")
            cur.execute(f"SELECT SUM(a) FROM t1 WHERE x BETWEEN -{i}.5 AND {i * 3}.25")
    finally:
        conn.close()
    assert len(seen) == 24 and any(seen)  # later statements ran from templates, with swaps


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT w, COUNT(*) FROM t1 GROUP BY w",  # no public domain: keyed-hash ranking
        "SELECT COUNT(DISTINCT a) FROM t1",
        "SELECT MEDIAN(x) FROM t1",
        "SELECT FLOOR(a / 10) AS d, COUNT(*) FROM t1 GROUP BY 1",
        "SELECT COUNT(*) FROM t1 WHERE a + 1 > 3",
        "SELECT COUNT(*) FROM t1 WHERE a > k",
    ],
)
def test_plans_beyond_the_programs_run_their_sql(tmp_path, sql):
    svc = _service(tmp_path, unit=True, rows=400)
    try:
        compiled = _compiled(svc, sql)
        assert compiled.program is None
    finally:
        svc.close()


def test_sampling_with_values_has_no_program(tmp_path):
    svc = _service(tmp_path, unit=True, rows=400, bounding="sample")
    try:
        assert _compiled(svc, "SELECT SUM(a) FROM t1").program is None
        assert _compiled(svc, "SELECT COUNT(*) FROM t1").program is not None  # counts only
    finally:
        svc.close()


def test_literals_past_exact_doubles_run_the_sql(tmp_path):
    """A 16-digit decimal against a DOUBLE column: the program declines (before reading any
    value), the SQL answers."""
    svc = _service(tmp_path, unit=False, rows=400)
    try:
        compiled = _compiled(svc, "SELECT COUNT(*) FROM t1 WHERE x > 1.234567890123456")
        assert compiled.program is not None
        assert svc.engine._run_columns(compiled, None) is None
        compiled = _compiled(svc, "SELECT COUNT(*) FROM t1 WHERE a > 1.234567890123456")
        assert svc.engine._run_columns(compiled, None) is not None  # integers: exact anyway
    finally:
        svc.close()


def test_small_tables_sql_turns_programs_off(tmp_path):
    csv = _data(tmp_path / "t1.csv", 200, 3)
    policy = _policy(csv, unit=True)
    policy["engine"] = {"small_tables": "sql"}
    svc = Service(load_policy(policy), ledger=MemoryLedger(), cache=False)
    try:
        compiled = _compiled(svc, "SELECT COUNT(*) FROM t1")
        assert compiled.program is not None and svc.engine._run_columns(compiled, None) is None
    finally:
        svc.close()


def test_a_failing_program_is_the_uniform_charged_engine_error(tmp_path, monkeypatch):
    """A bug inside a program surfaces as the engine's one uniform error, charged as every
    failure after reading is, never with its own text."""
    from dpsql.engine import columnar

    conn = _connect(tmp_path, unit=True, rows=200)
    try:
        before = budget(conn)["charged_epsilon"]
        monkeypatch.setattr(columnar, "_row_values", lambda *a: 1 / 0)
        monkeypatch.setattr(columnar, "_compiled_pass", lambda *a: 1 / 0)
        with pytest.raises(OperationalError) as info:
            conn.cursor().execute("SELECT SUM(a) FROM t1")
        assert "ZeroDivision" not in str(info.value) and info.value.sqlstate is not None
        assert budget(conn)["charged_epsilon"] == pytest.approx(before + 1.0)
    finally:
        conn.close()


def test_declared_key_types_are_the_binders(tmp_path, monkeypatch):
    """Simple queries are typed without DuckDB's binder (dpsql.frontend.typecheck.
    declared_key_types): the same key types, and no condition the binder would refuse."""
    from dpsql.frontend import typecheck

    svc = _service(tmp_path, unit=False, rows=50)
    rng = random.Random(3)
    declared = 0
    try:
        for _ in range(300):
            sql = _query(rng)
            try:
                bound = parse_statement(sql, svc.policy)
            except Exception:
                continue
            fast = typecheck.declared_key_types(bound)
            if fast is None:
                continue
            declared += 1
            with monkeypatch.context() as patched:
                patched.setattr(typecheck, "declared_key_types", lambda query: None)
                typed = typecheck.type_query(bound, svc.shadow)  # raises on a refusal
            assert [k.type for k in typed.keys] == fast, sql
    finally:
        svc.close()
    assert declared >= 150


@pytest.mark.parametrize("unit", [False, True], ids=["row-level", "unit"])
def test_a_programs_work_does_not_depend_on_which_rows_the_where_keeps(tmp_path, monkeypatch, unit):
    """Fixed shapes (the timing channel between neighbours, docs/threat_model.md): every sum a
    program takes runs over the same arrays whether its WHERE keeps every row, some or none."""
    from dpsql.engine import columnar

    svc = _service(tmp_path, unit=unit, rows=600)
    shapes: list[tuple] = []
    original = columnar._sum_by

    def recorded(codes, values, size, bound):
        shapes.append((codes.shape, values.shape, size))
        return original(codes, values, size, bound)

    monkeypatch.setattr(columnar, "_sum_by", recorded)
    _numpy_only(monkeypatch)  # the compiled pass's own test: tests/test_clustered.py
    seen = []
    try:
        for where in ("", " WHERE u = 3", " WHERE a > 1000", " WHERE t = 'beta' OR b"):
            shapes.clear()
            sql = f"SELECT t, COUNT(*), SUM(a) FROM t1{where} GROUP BY t"
            compiled = _compiled(svc, sql, bias=False)
            assert svc.engine._run_columns(compiled, None) is not None
            seen.append(list(shapes))
    finally:
        svc.close()
    assert all(s == seen[0] for s in seen) and seen[0]


@pytest.mark.parametrize("op", ["=", "<>", "<", "<=", ">", ">="])
def test_every_comparison_of_each_kind_matches_the_sql(tmp_path, op):
    """Each comparison against literals on both sides of values the data holds (and between
    them), for every column kind a program reads."""
    svc = _service(tmp_path, unit=False, rows=1500)
    literals = {
        "d": ["'2024-01-01'", "DATE '2024-02-14'", "CAST('2024-03-28' AS DATE)", "'2023-06-30'"],
        "a": ["0", "50", "50.5", "-1", "100"],
        "x": ["0", "0.25", "-12.5", "49.75", "50"],
        "t": ["'alpha'", "'beta '", "'émile'", "'Zed'", "''"],
        "b": ["TRUE", "FALSE"],
    }
    try:
        for column, values in literals.items():
            if column == "b" and op not in ("=", "<>"):
                continue
            for value in values:
                for sql in (
                    f"SELECT COUNT(*), SUM(a) FROM t1 WHERE {column} {op} {value}",
                    f"SELECT t, COUNT(*) FROM t1 WHERE {value} {op} {column} GROUP BY t",
                ):
                    compiled = _compiled(svc, sql)
                    local, expected = _both(svc, compiled)
                    assert local is not None, sql
                    assert local == expected, sql
    finally:
        svc.close()
