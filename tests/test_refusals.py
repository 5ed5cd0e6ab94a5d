"""Every refusal: its class, SQLSTATE, message, position and hint, before any data is read.

Each case runs against a connection whose private engine is wrapped: a refusal must not call
``engine.execute`` nor touch the engine's DuckDB connection, and must not spend budget.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import exact_connect, table_policy, write_csv

import dpsql
from dpsql.errors import (
    PrivacyError,
    ProgrammingError,
    SQLSyntaxError,
    UndefinedColumnError,
    UndefinedTableError,
)
from dpsql.privacy.accounting import Cost

COLUMNS = {
    "uid": {"type": "int", "nullable": False},
    "x": {"type": "int"},  # no bounds
    "y": {"type": "float", "lower": 0.0, "upper": 1.0},
    "cat": {"type": "text", "values": ["p", "q"]},
    "name": {"type": "text"},  # no public domain
    "d": {"type": "date"},
}


class ConnectionSpy:
    """Stands in for the engine's DuckDB connection and counts every use."""

    def __init__(self, con) -> None:
        self._con = con
        self.uses = 0

    def __getattr__(self, name):
        self.uses += 1
        return getattr(self._con, name)


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    path = write_csv(
        tmp_path_factory.mktemp("refusals") / "t.csv",
        list(COLUMNS),
        [(1, 5, 0.5, "p", "n1", "2024-01-01"), (2, 7, 0.25, "q", "n2", "2024-02-01")],
    )
    policy = table_policy(path, COLUMNS, unit="uid", rows=2, groups=2, privacy={"delta": 0.0})
    conn = exact_connect(policy)
    engine = conn.service.engine
    calls: list[object] = []
    original = engine.execute

    def execute(compiled, handle=None):
        calls.append(compiled)
        return original(compiled, handle)

    engine.execute = execute
    spy = ConnectionSpy(engine._con)
    engine._con = spy
    yield conn, calls, spy
    engine._con = spy._con
    conn.close()


def position(sql: str, at: str) -> tuple[int, int]:
    """1-based (line, column) of ``at`` in ``sql`` (case-insensitive; ``X@2``: second X)."""
    at, _, nth = at.partition("@")
    offset = -1
    for _ in range(int(nth or 1)):
        offset = sql.lower().index(at.lower(), offset + 1)
    line = sql.count("\n", 0, offset) + 1
    return line, offset - (sql.rfind("\n", 0, offset) + 1) + 1


P, U, T, C, S = PrivacyError, UndefinedTableError, UndefinedColumnError, SQLSyntaxError, "42501"

# (sql, error class, sqlstate, message fragment, construct located at, hint fragment)
REFUSALS = [
    ("SELECT * FROM t", P, S, "SELECT *", "*", "aggregates"),
    ("SELECT COUNT(*), * FROM t", P, S, "SELECT *", "* FROM", "aggregates"),
    ("SELECT x, COUNT(*) FROM t", P, S, "outside an aggregate", "x,", "GROUP BY"),
    (
        "SELECT cat, COUNT(*) FROM t GROUP BY cat HAVING y > 0",
        P,
        S,
        "outside an aggr",
        "y >",
        "GROUP",
    ),
    ("SELECT COUNT(*) FROM t GROUP BY cat ORDER BY x", P, S, "outside an aggregate", "x", "GROUP"),
    ("SELECT x FROM t", P, S, "outside an aggregate", "x", "aggregate it"),
    ("SELECT cat FROM t", P, S, "outside an aggregate", "cat", "aggregate it"),
    # DDL / DML
    ("CREATE TABLE z (a INT)", P, S, "CREATE", "CREATE", "SELECT"),
    ("CREATE VIEW v AS SELECT COUNT(*) FROM t", P, S, "CREATE", "CREATE", "SELECT"),
    ("INSERT INTO t VALUES (1)", P, S, "INSERT", "INSERT", "SELECT"),
    ("UPDATE t SET x = 1", P, S, "UPDATE", "UPDATE", "SELECT"),
    ("DELETE FROM t", P, S, "DELETE", "DELETE", "SELECT"),
    ("DROP TABLE t", P, S, "DROP", "DROP", "SELECT"),
    ("ALTER TABLE t ADD COLUMN z INT", P, S, "ALTER", "ALTER", "SELECT"),
    ("TRUNCATE t", P, S, "TRUNCATE", "TRUNCATE", "SELECT"),
    # engine commands
    ("PRAGMA table_info('t')", P, S, "PRAGMA", "PRAGMA", "SELECT"),
    ("ATTACH 'other.db' AS o", P, S, "ATTACH", "ATTACH", "SELECT"),
    ("DETACH o", P, S, "DETACH", "DETACH", "SELECT"),
    ("COPY t TO 'out.csv'", P, S, "COPY", "COPY", "SELECT"),
    ("INSTALL httpfs", P, S, "INSTALL", "INSTALL", "SELECT"),
    ("LOAD httpfs", P, S, "LOAD", "LOAD", "SELECT"),
    ("  VACUUM", P, S, "VACUUM", "VACUUM", "SELECT"),
    ("CALL pragma_version()", P, S, "CALL", "CALL", "SELECT"),
    ("SUMMARIZE t", P, S, "SUMMARIZE statements are not allowed", "SUMMARIZE", "SELECT"),
    ("CHECKPOINT", P, S, "CHECKPOINT statements are not allowed", "CHECKPOINT", "SELECT"),
    ("DEALLOCATE p", P, S, "DEALLOCATE statements are not allowed", "DEALLOCATE", "SELECT"),
    ("VALUES (1)", P, S, "VALUES statements are not allowed", "VALUES", "SELECT"),
    # several statements
    (
        "SELECT COUNT(*) FROM t; SELECT COUNT(*) FROM t",
        P,
        S,
        "several statements",
        "SELECT@2",
        "one",
    ),
    ("SELECT COUNT(*) FROM t;\nDROP TABLE t", P, S, "several statements", "DROP", "one"),
    # table functions and file readers
    ("SELECT COUNT(*) FROM read_csv('t.csv')", P, S, "file reader", "read_csv", "policy"),
    ("SELECT COUNT(*) FROM read_csv_auto('/etc/passwd')", P, S, "file reader", "read_csv", "pol"),
    ("SELECT COUNT(*) FROM read_parquet('t.parquet')", P, S, "file reader", "read_parquet", "pol"),
    ("SELECT COUNT(*) FROM glob('*')", P, S, "file reader", "glob", "policy"),
    ("SELECT COUNT(*) FROM range(10)", P, S, "table function", "range", "policy"),
    ("SELECT COUNT(*) FROM duckdb_settings()", P, S, "table function", "duckdb_settings", "pol"),
    (
        "SELECT COUNT(*) FROM t WHERE name IN (SELECT file FROM glob('*'))",
        P,
        S,
        "subquer",
        "(SELECT",
        "one",
    ),
    ("SELECT COUNT(*) FROM 't.csv'", U, "42P01", "unknown table", "'t.csv'", "t"),
    # JOINs, subqueries, CTEs, set operations
    (
        "SELECT COUNT(*) FROM t JOIN t AS u ON t.uid = u.uid",
        P,
        S,
        "many-to-many within a unit",
        "t.uid = u.uid",
        "primary_key",
    ),
    ("SELECT COUNT(*) FROM t, t AS u", P, S, "cross joins", ", t AS u", "privacy unit"),
    ("SELECT COUNT(*) FROM (SELECT * FROM t LIMIT 5)", P, S, "LIMIT inside", "LIMIT", "outer"),
    ("SELECT COUNT(*) FROM (SELECT DISTINCT x FROM t) AS d", P, S, "DISTINCT", "DISTINCT", "keep"),
    ("SELECT COUNT(*) FROM t WHERE x > (SELECT 1)", P, S, "subquer", "(SELECT", "one"),
    (
        "WITH RECURSIVE s AS (SELECT * FROM t) SELECT COUNT(*) FROM s",
        P,
        S,
        "RECURSIVE",
        "WITH",
        "RECURSIVE",
    ),
    (
        "WITH s AS (SELECT * FROM t) SELECT COUNT(*) FROM t WHERE x IN (SELECT x FROM s)",
        P,
        S,
        "CTE",
        "s)",
        "FROM source",
    ),
    ("SELECT * FROM (SELECT * FROM t) AS d", P, S, "individual rows", "*", "aggregates"),
    # a set operation of DP queries is post-processing (tests/test_released_postprocessing.py);
    # one that reads private rows directly is not
    ("SELECT x FROM t UNION SELECT COUNT(*) FROM t", P, S, "UNION", "SELECT", "COUNT"),
    # windows
    ("SELECT COUNT(*) OVER () FROM t", P, S, "window", "COUNT(*) OVER", "GROUP BY"),
    ("SELECT cat, SUM(y) OVER (PARTITION BY cat) FROM t GROUP BY cat", P, S, "window", "SUM", "GR"),
    ("SELECT COUNT(*) FROM t QUALIFY COUNT(*) > 1", P, S, "QUALIFY", "QUALIFY", "one"),
    # non-deterministic and system functions
    ("SELECT COUNT(*) FROM t WHERE random() < 0.5", P, S, "non-deterministic", "random", "literal"),
    # (NOW() and CURRENT_TIMESTAMP are the public clock, read once per statement:
    # tests/test_time_domains.py::test_now_is_a_public_clock_read_once_per_statement)
    (
        "SELECT COUNT(*) FROM t WHERE gen_random_uuid() IS NULL",
        P,
        S,
        "non-deterministic",
        "gen_random_uuid",
        "literal",
    ),
    (
        "SELECT COUNT(*) FROM t WHERE current_setting('x') = 'y'",
        P,
        S,
        "non-deterministic",
        "current_setting",
        "lit",
    ),
    ("SELECT COUNT(*) FROM t WHERE uuid() IS NULL", P, S, "non-deterministic", "uuid", "literal"),
    (
        "SELECT COUNT(*) FROM t\nWHERE current_setting('threads') = '1'",
        P,
        S,
        "system",
        "current_",
        "lit",
    ),
    ("SELECT COUNT(*) FROM t WHERE getenv('HOME') = ''", P, S, "not allowed", "getenv", "grammar"),
    ("SELECT COUNT(*), version() FROM t", P, S, "not allowed", "version", "grammar"),
    # aggregates without bounded sensitivity
    ("SELECT SUM(x) FROM t", P, S, "needs declared bounds", "SUM(x)", "lower and upper"),
    ("SELECT cat,\n  AVG(x) FROM t GROUP BY cat", P, S, "needs declared bounds", "AVG(x)", "lower"),
    ("SELECT STDDEV(x) FROM t", P, S, "needs declared bounds", "STDDEV(x)", "lower"),
    ("SELECT SUM(name) FROM t", P, S, "not a number", "SUM(name)", "int or float"),
    ("SELECT SUM(uid) FROM t", P, S, "privacy unit", "SUM(uid)", "COUNT(DISTINCT uid)"),
    ("SELECT MAX(x) FROM t", P, S, "needs declared bounds", "MAX(x)", "lower and upper"),
    ("SELECT STRING_AGG(name, ',') FROM t", P, S, "not supported", "name,", "MEDIAN"),
    ("SELECT SUM(y * x) FROM t", P, S, "needs a bound on x", "SUM(y * x)", "LEAST(GREATEST"),
    ("SELECT SUM(y / x) FROM t", P, S, "the divisor", "SUM(y / x)", "clamp"),
    ("SELECT AVG(LENGTH(name)) FROM t", P, S, "no range is known", "AVG(", "a number"),
    ("SELECT SUM(uid + y) FROM t", P, S, "privacy unit", "SUM(uid + y)", "COUNT(DISTINCT"),
    ("SELECT AVG(DISTINCT y) FROM t", P, S, "DISTINCT", "AVG(DISTINCT y)", "COUNT(DISTINCT y)"),
    ("SELECT SUM(DISTINCT uid) FROM t", P, S, "privacy unit", "SUM(DISTINCT", "COUNT(DISTINCT"),
    ("SELECT SUM(DISTINCT x) FROM t", P, S, "needs declared bounds", "SUM(DISTINCT", "lower"),
    # unknown names
    ("SELECT COUNT(*) FROM nope", U, "42P01", "unknown table 'nope'", "nope", "t"),
    ("SELECT COUNT(*) FROM other.t", U, "42P01", "unknown table", "other.t", "t"),
    ("SELECT COUNT(nope) FROM t", T, "42703", "unknown column 'nope'", "nope", "uid, x, y"),
    ("SELECT COUNT(*) FROM t WHERE\n  nope = 1", T, "42703", "unknown column", "nope", "uid"),
    ("SELECT COUNT(*) FROM t AS a WHERE b.x = 1", T, "42703", "unknown table or alias", "b.x", "a"),
    # grouping
    ("SELECT COUNT(*) FROM t GROUP BY uid", P, S, "privacy unit", "uid", "COUNT(DISTINCT uid)"),
    ("SELECT COUNT(*) FROM t GROUP BY uid % 10", P, S, "privacy unit", "uid %", "COUNT(DIST"),
    ("SELECT name, COUNT(*) FROM t GROUP BY name", P, S, "not public", "name@2", "values"),
    ("SELECT COUNT(*) FROM t GROUP BY cat,\n d", P, S, "not public", "d", "SET delta"),
    ("SELECT COUNT(*) FROM t GROUP BY ROLLUP (cat)", P, S, "ROLLUP", "ROLLUP", "one query"),
    ("SELECT COUNT(*) FROM t GROUP BY 3", P, S, "out of range", "3", "GROUP BY"),
    # other refusals
    ("SELECT COUNT(*) FROM t TABLESAMPLE 10%", P, S, "TABLESAMPLE", "TABLESAMPLE", "WHERE"),
    ("SELECT COUNT(*) FROM t AT (VERSION => 1)", P, S, "table modifiers", "AT (", "FROM t"),
    ("SELECT COUNT(*) FROM t WITH (NOLOCK)", P, S, "table modifiers", "WITH (", "FROM t"),
    ("SELECT COUNT(cat) FROM t AS u(cat)", P, S, "column aliases", "u(cat)", "FROM t"),
    (
        "SELECT COUNT(*) FROM t LIMIT 1 + 1",
        ProgrammingError,
        "42804",
        "whole number",
        "LIMIT",
        "LIMIT 10",
    ),
    (
        "SELECT COUNT(*) FROM t LIMIT -1",
        ProgrammingError,
        "2201W",
        "whole number",
        "LIMIT",
        "LIMIT 10",
    ),
    ("EXPLAIN SELECT * FROM t", P, S, "SELECT *", "*", "aggregates"),
    ("EXPLAIN\n  SELECT name, COUNT(*) FROM t GROUP BY name", P, S, "not public", "name@2", "val"),
    ("SELEC COUNT(*) FROM t", C, "42601", "syntax error", "(*)", "SELECT"),
    ("SELECT", C, "42601", "", "SELECT", "SELECT"),
]


@pytest.mark.parametrize(
    ("sql", "cls", "sqlstate", "message", "at", "hint"),
    REFUSALS,
    ids=[r[0].replace("\n", " ")[:60] for r in REFUSALS],
)
def test_refusal(guarded, sql, cls, sqlstate, message, at, hint):
    conn, calls, spy = guarded
    calls.clear()
    spent = conn.service.ledger.spent(conn.analyst, conn.service.policy.dataset)
    uses = spy.uses
    with pytest.raises(cls) as info:
        conn.cursor().execute(sql)
    err = info.value
    assert isinstance(err, ProgrammingError)
    assert err.sqlstate == sqlstate
    assert message in err.message
    assert err.hint and hint in err.hint, err.hint
    assert err.position is not None, f"no position for {sql!r}"
    assert (err.position.line, err.position.column) == position(sql, at), str(err)
    assert f"[{sqlstate}]" in str(err) and str(err.position) in str(err)
    # nothing read, nothing spent
    assert calls == []
    assert spy.uses == uses
    assert conn.service.ledger.spent(conn.analyst, conn.service.policy.dataset) == spent
    assert spent == Cost()


def test_refusals_are_privacy_errors_and_programming_errors():
    assert issubclass(PrivacyError, dpsql.ProgrammingError)
    assert issubclass(dpsql.BudgetExhaustedError, PrivacyError)
    assert all(issubclass(r[1], dpsql.ProgrammingError) for r in REFUSALS)


def test_refusal_messages_never_echo_data(guarded):
    """Refusals are about the query text: a value from the data never appears in them."""
    conn, _, _ = guarded
    for sql in ("SELECT name FROM t", "SELECT name, COUNT(*) FROM t GROUP BY name"):
        with pytest.raises(PrivacyError) as info:
            conn.cursor().execute(sql)
        assert "n1" not in str(info.value) and "n2" not in str(info.value)


def test_gaussian_without_delta_is_refused_before_running(guarded):
    conn, calls, _ = guarded
    cur = conn.cursor()
    cur.execute("SET mechanism = 'gaussian'")
    try:
        with pytest.raises(PrivacyError) as info:
            cur.execute("SELECT COUNT(*) FROM t")
    finally:
        cur.execute("RESET mechanism")
    assert "delta" in info.value.message and "SET delta" in info.value.hint
    assert calls == []


def test_refusal_on_the_shipped_fixture(tmp_path: Path):
    """The fixture's policy: GROUP BY the non-public diagnosis is refused when delta = 0."""
    from conftest import fixture_policy

    sql = "SELECT diagnosis, COUNT(*) FROM visits GROUP BY diagnosis"
    with (
        exact_connect(fixture_policy(privacy={"delta": 0.0})) as conn,
        pytest.raises(PrivacyError, match="not public") as info,
    ):
        conn.cursor().execute(sql)
    assert "values" in info.value.hint
