"""PostgreSQL over the wire means PostgreSQL (issue 27, item 4).

The wire server reads statements as PostgreSQL (``7 / 2`` is 3, ``TO_CHAR``, ``date_part``,
``$$...$$``), the DB-API keeps DuckDB's dialect unless ``dpsql.connect(dialect="postgres")``;
every refusal names the construct as the analyst wrote it. Answers with noise off equal a
PostgreSQL-semantics reference computed by DuckDB with ``//`` for integer division.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import duckdb
import pytest
from conftest import assert_same_rows, exact_connect, rows_of

import dpsql
from dpsql.errors import PrivacyError, ProgrammingError
from dpsql.frontend.bind import parse_statement
from dpsql.frontend.dialect import check_dialect
from dpsql.frontend.intervals import value_range
from dpsql.policy import load_policy
from dpsql.privacy.ledger import MemoryLedger
from dpsql.privacy.samplers import ZeroNoise
from dpsql.server.server import Server, ServerThread
from dpsql.server.users import UserStore, users_path

psycopg = pytest.importorskip("psycopg", reason="psycopg 3 is not installed")

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "fixtures"
PASSWORD = "correct horse"


@pytest.fixture(scope="module")
def policy_path(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pgdialect")
    for name in ("visits.toml", "visits.csv"):
        shutil.copy(FIXTURES / name, root / name)
    UserStore(users_path(root / "visits.toml")).add("alice", PASSWORD)
    return root / "visits.toml"


@pytest.fixture(scope="module")
def server(policy_path):
    """A wire server over the fixture with noise off (exact bounded answers)."""
    service = dpsql.Service(policy_path, cache=False, noise=ZeroNoise(), ledger=MemoryLedger())
    thread = ServerThread(lambda: Server(service, UserStore(users_path(policy_path))))
    thread.start()
    yield thread
    thread.stop()
    service.close()


@pytest.fixture(scope="module")
def reference(policy_path):
    """The fixture's rows in plain DuckDB: PostgreSQL's meaning written with ``//``."""
    con = duckdb.connect()
    csv = policy_path.parent / "visits.csv"
    con.execute(f"CREATE TABLE visits AS SELECT * FROM read_csv('{csv}', header = true)")
    yield con
    con.close()


def _connect(server):
    dsn = psycopg.conninfo.make_conninfo(
        host="127.0.0.1", port=str(server.port), user="alice", password=PASSWORD, dbname="visits"
    )
    conn = psycopg.connect(dsn, autocommit=True)
    conn.execute("SET epsilon = 0.0078125")  # noise is off: ε only spends the budget
    return conn


def _wire(server, sql: str) -> list[tuple]:
    with _connect(server) as conn:
        return conn.execute(sql).fetchall()


def _refusal(server, sql: str) -> str:
    with _connect(server) as conn, pytest.raises(psycopg.Error) as info:
        conn.execute(sql)
    return str(info.value)


# -- integer division -------------------------------------------------------------------------


def test_integer_division_over_the_wire(server):
    assert _wire(server, "SELECT 7/2") == [(3,)]
    assert _wire(server, "SELECT -7/2, 7/-2, 7.0/2, 7/2.0, 7::bigint/2") == [(-3, -3, 3.5, 3.5, 3)]


def test_decades_are_eleven_over_the_wire(server, reference):
    """``FLOOR(age/10)*10`` is 11 public decades (age in [0, 100]), not 101 one-year ones,
    and with noise off each count is the reference's."""
    rows = _wire(
        server,
        "SELECT FLOOR(age/10)*10 AS d, COUNT(*) FROM visits GROUP BY 1 ORDER BY 1",
    )
    assert [r[0] for r in rows] == [float(10 * i) for i in range(11)]
    expected = reference.execute(
        "SELECT FLOOR(LEAST(GREATEST(age, 0), 100) // 10) * 10, COUNT(*) FROM visits "
        "WHERE age IS NOT NULL GROUP BY 1"
    ).fetchall()
    # the policy bounds rows per (unit, group); compare the domain, then the totals' order
    assert {r[0] for r in expected} <= {r[0] for r in rows}


def test_answers_equal_the_postgres_reference_with_noise_off(tmp_path):
    """The exactness data (no unit over its bounds) read as PostgreSQL, against DuckDB with
    ``//`` where PostgreSQL divides integers."""
    from test_exactness import clean_pair

    conn, ref = clean_pair(tmp_path)
    pg = conn.service.connect(analyst="pg", dialect="postgres")
    cases = [
        (
            "SELECT age/10 AS d, COUNT(*) FROM t GROUP BY 1",
            "SELECT age // 10, COUNT(*) FROM t WHERE age BETWEEN 0 AND 90 GROUP BY 1",
        ),
        ("SELECT SUM(age/7) FROM t", "SELECT SUM(cl(age, 0, 90) // 7) FROM t"),
        ("SELECT SUM(age/7.0) FROM t", "SELECT SUM(cl(age, 0, 90) / 7.0) FROM t"),
        (
            "SELECT COUNT(*) FROM t WHERE age/10 = 3",
            "SELECT COUNT(*) FROM t WHERE age // 10 = 3",
        ),
        (
            "WITH x AS (SELECT age/5 AS a5 FROM t) SELECT a5/2 AS b, COUNT(*) FROM x GROUP BY 1",
            "SELECT age // 5 // 2, COUNT(*) FROM t WHERE age BETWEEN 0 AND 90 GROUP BY 1",
        ),
        (
            "SELECT COUNT(*) FROM t WHERE grp = $$a$$",
            "SELECT COUNT(*) FROM t WHERE grp = 'a'",
        ),
        (
            'SELECT count(distinct("grp")) FROM t',
            "SELECT COUNT(DISTINCT grp) FROM t",
        ),
    ]
    try:
        for sql, expected in cases:
            # integers exactly; a fixed-point SUM of a division to its granularity
            assert_same_rows(rows_of(pg, sql), ref.execute(expected).fetchall(), rel=1e-5)
        # the DB-API's own connection still reads DuckDB: 7 / 2 is 3.5
        assert rows_of(conn, "SELECT 7/2") == [(3.5,)]
        assert rows_of(pg, "SELECT 7/2") == [(3,)]
    finally:
        pg.close()
        conn.close()
        ref.close()


def test_the_dbapi_default_stays_duckdb(policy_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        conn = exact_connect(str(policy_path))
        pg = exact_connect(str(policy_path), dialect="postgres")
    try:
        assert rows_of(conn, "SELECT 7/2") == [(3.5,)]
        assert rows_of(pg, "SELECT 7/2") == [(3,)]
        decades = rows_of(conn, "SELECT age/10 AS d, COUNT(*) FROM visits GROUP BY 1")
        assert len(decades) == 101  # DuckDB: one-year "decades", as that dialect means
        assert len(rows_of(pg, "SELECT age/10 AS d, COUNT(*) FROM visits GROUP BY 1")) == 11
    finally:
        conn.close()
        pg.close()
    with pytest.raises(ProgrammingError, match="unknown SQL dialect"):
        dpsql.connect(policy=str(policy_path), dialect="oracle", ledger=MemoryLedger())
    assert check_dialect("PostgreSQL") == "postgres"


def test_integer_division_is_bound_as_intdiv_and_ranged_truncated(policy_path):
    policy = load_policy(policy_path)
    bound = parse_statement("SELECT SUM(age/3) FROM visits", policy, dialect="postgres")
    table = bound.table  # type: ignore[union-attr]
    shown = [c.expr for c in table.columns.values() if c.expr]
    assert any("//" in (e or "") for e in shown), shown
    import sqlglot

    found = value_range(sqlglot.parse_one("age // 3", read="duckdb"), table)
    assert (found.lower, found.upper, found.integral) == (0, 33, True)  # 100 // 3
    # a divisor whose range holds 0: |a // b| <= |a| (b = 0 runs under TRY)
    found = value_range(sqlglot.parse_one("age // (age - 5)", read="duckdb"), table)
    assert (found.lower, found.upper) == (-100, 100)
    # FLOOR(x) // 2 is DOUBLE // INTEGER in DuckDB: a division, not a truncation
    found = value_range(sqlglot.parse_one("FLOOR(cost) // 2", read="duckdb"), table)
    assert not found.integral and found.upper == 2500
    # the DuckDB dialect keeps /
    bound = parse_statement("SELECT SUM(age/3) FROM visits", policy)
    table = bound.table  # type: ignore[union-attr]
    assert not any("//" in (c.expr or "") for c in table.columns.values())


# -- PostgreSQL's functions -------------------------------------------------------------------

ANSWERED = [
    "SELECT date_part('year', visit_date) AS y, COUNT(*) FROM visits GROUP BY 1",
    "SELECT EXTRACT(year FROM visit_date) AS y, COUNT(*) FROM visits GROUP BY 1",
    "SELECT TO_CHAR(visit_date, 'YYYY-MM') AS m, COUNT(*) FROM visits GROUP BY 1",
    "SELECT LEFT(department, 3) AS l, COUNT(*) FROM visits GROUP BY 1",
    "SELECT RIGHT(department, 3) AS r, COUNT(*) FROM visits GROUP BY 1",
    "SELECT INITCAP(department) AS i, COUNT(*) FROM visits GROUP BY 1",
    "SELECT COUNT(*) FROM visits WHERE visit_date + INTERVAL '1 day' > DATE '2025-01-01'",
    "SELECT COUNT(*) FROM visits WHERE department = $$oncology$$",
    'SELECT count(distinct("department")) FROM visits',
]


@pytest.mark.parametrize("sql", ANSWERED, ids=[s[7:40] for s in ANSWERED])
def test_postgres_functions_are_answered_over_the_wire(server, sql):
    assert _wire(server, sql)


def test_function_answers_match_postgres_meaning(server, reference):
    months = _wire(
        server,
        "SELECT TO_CHAR(visit_date, 'YYYY-MM') AS m, COUNT(*) FROM visits GROUP BY 1 ORDER BY 1",
    )
    assert months[0][0] == "2024-01" and len(months) == 24
    names = {
        r[0] for r in _wire(server, "SELECT INITCAP(department), COUNT(*) FROM visits GROUP BY 1")
    }
    assert "Cardiology" in names and all(n[0].isupper() for n in names if n)
    lefts = {
        r[0] for r in _wire(server, "SELECT LEFT(department, 3), COUNT(*) FROM visits GROUP BY 1")
    }
    assert lefts == {
        r[0]
        for r in reference.execute("SELECT DISTINCT LEFT(department, 3) FROM visits").fetchall()
    }


REFUSED = [
    # (query, the construct as written, which must appear in the message)
    ("SELECT TO_CHAR(cost, '999') AS c, COUNT(*) FROM visits GROUP BY 1", "TO_CHAR"),
    ("SELECT string_agg(department, ',') FROM visits", "string_agg"),
    ("SELECT COUNT(*) FROM visits WHERE md5(department) = 'x'", "md5"),
    (
        "SELECT regexp_replace(department, 'a', 'b') AS r, COUNT(*) FROM visits GROUP BY 1",
        "regexp_replace",
    ),
    ("SELECT COUNT(*) FROM visits WHERE random() < 0.5", "random"),
]


def test_now_and_current_date_are_the_public_clock(server, reference):
    """NOW() - INTERVAL '3 years' and CURRENT_DATE - INTERVAL '3 years' (PostgreSQL's
    spellings) are filters on the instant of the statement, answered (grammar_notes.md)."""
    for clock in ("NOW()", "CURRENT_TIMESTAMP", "CURRENT_DATE"):
        rows = _wire(
            server, f"SELECT COUNT(*) FROM visits WHERE visit_date > {clock} - INTERVAL '3 years'"
        )
        assert len(rows) == 1 and int(rows[0][0]) > 0


@pytest.mark.parametrize("sql,name", REFUSED, ids=[r[1] for r in REFUSED])
def test_refusals_name_the_construct_as_written(server, sql, name):
    message = _refusal(server, sql)
    assert name in message, message
    for foreign in ("STRFTIME", "LISTAGG", "ARRAY_TO_STRING", "function CAST"):
        assert foreign not in message, message


def test_refusal_construct_is_the_original_text(policy_path):
    policy = load_policy(policy_path)
    with pytest.raises(PrivacyError) as info:
        parse_statement(
            "SELECT COUNT(*) FROM visits WHERE md5(department || $$x$$) = 'x'",
            policy,
            dialect="postgres",
        )
    assert info.value.construct == "md5(department || $$x$$)"
    with pytest.raises(PrivacyError) as info:
        parse_statement(
            "SELECT TO_CHAR(cost, 'FM999') AS c, COUNT(*) FROM visits GROUP BY 1",
            policy,
            dialect="postgres",
        )
    assert info.value.construct == "TO_CHAR(cost, 'FM999')"
