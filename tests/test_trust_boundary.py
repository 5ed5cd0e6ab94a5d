"""The trust boundary: a sealed engine connection that only ever runs SQL dpsql generated."""

from __future__ import annotations

from pathlib import Path

import duckdb
import pytest
import sqlglot
from conftest import EngineSpy, exact_connect, rows_of, table_policy, write_csv

import dpsql

COLUMNS = {
    "uid": {"type": "int", "nullable": False},
    "grp": {"type": "text", "values": ["a", "b"]},
    "v": {"type": "int", "lower": 0, "upper": 10},
    "note": {"type": "text"},
}


@pytest.fixture(scope="module")
def sealed(tmp_path_factory):
    base = tmp_path_factory.mktemp("sealed")
    path = write_csv(base / "t.csv", list(COLUMNS), [(1, "a", 3, "x"), (2, "b", 5, "y")])
    other = write_csv(base / "other.csv", ["secret"], [("s3cr3t",)])
    with exact_connect(table_policy(path, COLUMNS, unit="uid")) as conn:
        yield conn, other


@pytest.mark.parametrize("name", ["engine", "scratch"])
def test_connections_are_sealed(sealed, name):
    conn, other = sealed
    con = getattr(conn.service, name)._con
    settings = dict(
        con.execute(
            "SELECT name, value FROM duckdb_settings() "
            "WHERE name IN ('enable_external_access', 'lock_configuration')"
        ).fetchall()
    )
    assert settings == {"enable_external_access": "false", "lock_configuration": "true"}
    for sql in (
        "SET enable_external_access = true",
        "SET lock_configuration = false",
        "SET threads = 1",
        "RESET enable_external_access",
        f"SET allowed_paths = ['{other}']",
    ):
        with pytest.raises(duckdb.Error):
            con.execute(sql)
    for sql in (
        f"SELECT * FROM read_csv('{other}')",
        f"SELECT * FROM '{other}'",
        "SELECT * FROM glob('/etc/*')",
        "SELECT * FROM read_text('/etc/hostname')",
        f"COPY (SELECT 1) TO '{other}.out'",
        "INSTALL httpfs",
        f"ATTACH '{other}.db' AS x",
    ):
        with pytest.raises(duckdb.Error):
            con.execute(sql)
    assert not Path(f"{other}.out").exists()


def test_parquet_source_stays_readable_but_nothing_else(tmp_path: Path):
    src = tmp_path / "t.parquet"
    other = tmp_path / "other.parquet"
    with duckdb.connect() as con:
        con.execute(
            f"COPY (SELECT i AS uid, i % 11 AS v FROM range(20) r(i)) TO '{src}' (FORMAT parquet)"
        )
        con.execute(f"COPY (SELECT 42 AS secret) TO '{other}' (FORMAT parquet)")
    cols = {"uid": {"type": "int"}, "v": {"type": "int", "lower": 0, "upper": 10}}
    with exact_connect(table_policy(src, cols, unit="uid")) as conn:
        assert rows_of(conn, "SELECT COUNT(*), SUM(v) FROM t") == [
            (20, sum(i % 11 for i in range(20)))
        ]
        with pytest.raises(duckdb.Error):
            conn.service.engine._con.execute(f"SELECT * FROM read_parquet('{other}')")


def test_analyst_text_never_reaches_the_engine(sealed):
    conn, _ = sealed
    spy = EngineSpy(conn.service)
    analyst = (
        "/* marker-one */ SELECT grp, COUNT(*) -- marker-two\n"
        "FROM t WHERE v > 1 /* marker-three */ AND note <> 'x''; DROP TABLE t; --' "
        "GROUP BY grp /* marker-four */"
    )
    rows_of(conn, analyst)
    rows_of(conn, "SELECT COUNT(*) FROM t WHERE grp = ? -- marker-five", ["a' OR 'a'='a"])
    assert spy.calls == 2
    for sql in spy.sql:
        assert "marker" not in sql
        assert sql != analyst
        assert sql.startswith(("WITH base AS", "WITH bounded AS", "SELECT"))
        statements = sqlglot.parse(sql, read="duckdb")
        assert len(statements) == 1  # the quoted literal cannot end the statement
        assert not any(isinstance(s, sqlglot.exp.Drop) for s in statements)


def test_errors_never_echo_private_values(tmp_path: Path):
    """A value that does not fit its declared type is named by column and type, not value."""
    path = write_csv(tmp_path / "t.csv", ["uid", "v"], [(1, 3), (2, "private-value-123")])
    cols = {"uid": {"type": "int"}, "v": {"type": "int", "lower": 0, "upper": 10}}
    with pytest.raises(dpsql.PolicyError) as info:
        exact_connect(table_policy(path, cols, unit="uid"))
    assert "private-value-123" not in str(info.value)
    assert "tables.t.source" in str(info.value)


ORACLES = [
    "SELECT COUNT(*) FROM t WHERE CASE WHEN uid = {u} THEN CAST(note AS INT) ELSE 1 END = 1",
    "SELECT COUNT(*) FROM t WHERE 1 // (uid - {u}) >= 0",
    "SELECT COUNT(*) FROM t GROUP BY CASE WHEN v = {u} THEN CAST(note AS INT) ELSE 0 END",
]


@pytest.mark.parametrize("sql", ORACLES)
def test_evaluation_errors_do_not_reveal_rows(tmp_path: Path, sql):
    """An expression that fails only on some row must not fail the query (an error is a free,
    exact answer to "does that row exist?"); the failing rows are dropped or get a NULL key."""
    path = write_csv(tmp_path / "t.csv", ["uid", "v", "note"], [(1, 1, "x"), (2, 2, "y")])
    cols = {
        "uid": {"type": "int"},
        "v": {"type": "int", "lower": 0, "upper": 9},
        "note": {"type": "text"},
    }
    policy = table_policy(path, cols, unit="uid", privacy={"delta": 1e-6})
    with exact_connect(policy) as conn:
        present = conn.cursor().execute(sql.format(u=1)).fetchall()
        absent = conn.cursor().execute(sql.format(u=5)).fetchall()
    assert present is not None and absent is not None
