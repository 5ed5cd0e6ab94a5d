"""PEP 249 behaviour of dpsql.connect / Connection / Cursor, settings, budget and answer cache."""

from __future__ import annotations

import datetime as dt

import pytest
from conftest import EngineSpy, exact_connect, rows_of, table_policy, write_csv

import dpsql
from dpsql.dbapi import connect_service
from dpsql.errors import (
    BudgetExhaustedError,
    DatabaseError,
    DataError,
    Error,
    IntegrityError,
    InterfaceError,
    InternalError,
    NotSupportedError,
    OperationalError,
    PrivacyError,
    ProgrammingError,
)
from dpsql.plan import bias
from dpsql.privacy.accounting import Cost
from dpsql.privacy.ledger import MemoryLedger
from dpsql.privacy.samplers import SeededNoise

COLUMNS = {
    "uid": {"type": "int", "nullable": False},
    "grp": {"type": "text", "values": ["a", "b", "c"], "nullable": False},
    "v": {"type": "float", "lower": 0.0, "upper": 10.0},
    "d": {"type": "date", "nullable": False},
    "ok": {"type": "bool", "nullable": False},
    "note": {"type": "text"},
}
ROWS = [
    (1, "a", 1.5, "2024-01-01", True, "x"),
    (1, "b", 2.5, "2024-02-01", False, "it's"),
    (2, "a", 9.0, "2024-03-01", True, None),
    (3, "c", 4.0, "2024-04-01", True, "x"),
    (4, "a", None, "2024-05-01", False, "y"),
]


@pytest.fixture
def policy(tmp_path):
    path = write_csv(tmp_path / "t.csv", list(COLUMNS), ROWS)
    return table_policy(
        path,
        COLUMNS,
        unit="uid",
        rows=2,
        groups=2,
        privacy={"budget_epsilon": 100.0, "delta": 1e-6, "budget_delta": 1e-3},
    )


@pytest.fixture
def conn(policy):
    with exact_connect(policy) as c:
        yield c


def spent(conn) -> Cost:
    return conn.service.ledger.spent(conn.analyst, conn.service.policy.dataset)


# -- module ---------------------------------------------------------------------------------


def test_module_globals():
    assert dpsql.apilevel == "2.0"
    assert dpsql.threadsafety in (0, 1, 2, 3)
    assert dpsql.paramstyle in ("qmark", "numeric", "named", "format", "pyformat")
    assert callable(dpsql.connect)


def test_exception_hierarchy():
    assert issubclass(dpsql.Warning, Exception)
    assert issubclass(Error, Exception)
    assert not issubclass(dpsql.Warning, Error)
    assert issubclass(InterfaceError, Error)
    assert issubclass(DatabaseError, Error)
    for cls in (
        DataError,
        OperationalError,
        IntegrityError,
        InternalError,
        ProgrammingError,
        NotSupportedError,
    ):
        assert issubclass(cls, DatabaseError)
    assert issubclass(PrivacyError, ProgrammingError)
    assert issubclass(BudgetExhaustedError, PrivacyError)
    assert issubclass(dpsql.PolicyError, ProgrammingError)
    for name in (
        "Warning",
        "Error",
        "InterfaceError",
        "DatabaseError",
        "DataError",
        "OperationalError",
        "IntegrityError",
        "InternalError",
        "ProgrammingError",
        "NotSupportedError",
        "PrivacyError",
        "BudgetExhaustedError",
    ):
        assert getattr(dpsql, name) is getattr(dpsql.errors, name)


# -- cursor ---------------------------------------------------------------------------------


def test_cursor_before_execute(conn):
    cur = conn.cursor()
    assert cur.description is None
    assert cur.rowcount == -1
    assert cur.arraysize == 1
    with pytest.raises(ProgrammingError):
        cur.fetchone()


def test_fetch_methods_and_description(conn):
    cur = conn.cursor()
    assert cur.execute("SELECT grp, COUNT(*) AS n, AVG(v) FROM t GROUP BY grp") is cur
    assert [d[0] for d in cur.description] == ["grp", "n", "avg"]
    assert [d[1] for d in cur.description] == ["VARCHAR", "BIGINT", "DOUBLE"]
    assert all(len(d) == 7 for d in cur.description)
    assert cur.rowcount == 3
    assert cur.fetchone() == ("a", 3, pytest.approx((1.5 + 9.0) / 2))
    assert cur.fetchmany() == [("b", 1, 2.5)]  # arraysize rows
    assert cur.fetchmany(5) == [("c", 1, 4.0)]
    assert cur.fetchone() is None
    assert cur.fetchmany(2) == []
    assert cur.fetchall() == []
    cur.execute("SELECT grp, COUNT(*) FROM t GROUP BY grp ORDER BY grp DESC")
    cur.arraysize = 2
    assert cur.fetchmany() == [("c", 1), ("b", 1)]
    assert cur.fetchall() == [("a", 3)]
    cur.execute("SELECT ok, COUNT(*) FROM t GROUP BY ok")
    assert list(cur) == [(False, 2), (True, 3)]


def test_statements_without_rows(conn):
    cur = conn.cursor()
    for sql in ("SET epsilon = 0.5", "RESET epsilon", "BEGIN", "COMMIT", "ROLLBACK"):
        cur.execute(sql)
        assert cur.description is None
        assert cur.rowcount == -1
        with pytest.raises(ProgrammingError):
            cur.fetchall()


def test_executemany_and_connection_execute(conn):
    cur = conn.cursor()
    cur.executemany("SELECT COUNT(*) FROM t WHERE grp = ?", [("a",), ("c",)])
    assert cur.fetchall() == [(1,)]
    assert conn.execute("SELECT COUNT(*) FROM t").fetchall() == [(5,)]


def test_cursor_close(conn):
    cur = conn.cursor()
    cur.execute("SELECT COUNT(*) FROM t")
    cur.close()
    with pytest.raises(InterfaceError):
        cur.execute("SELECT COUNT(*) FROM t")
    with pytest.raises(Error):
        cur.fetchall()
    cur.close()  # closing twice is harmless
    assert conn.cursor().execute("SELECT COUNT(*) FROM t").fetchall() == [(5,)]


def test_connection_close(policy):
    conn = exact_connect(policy)
    cur = conn.cursor()
    conn.commit()
    conn.rollback()
    conn.close()
    conn.close()
    for call in (conn.cursor, conn.commit, conn.rollback):
        with pytest.raises(InterfaceError):
            call()
    with pytest.raises(InterfaceError):
        cur.execute("SELECT COUNT(*) FROM t")
    with pytest.raises(InterfaceError):
        conn.describe("SELECT COUNT(*) FROM t")


def test_context_manager_closes(policy):
    with exact_connect(policy) as conn:
        assert rows_of(conn, "SELECT COUNT(*) FROM t") == [(5,)]
    with pytest.raises(InterfaceError):
        conn.cursor()


# -- parameters -----------------------------------------------------------------------------


def test_parameters_qmark_and_numeric(conn):
    assert rows_of(conn, "SELECT COUNT(*) FROM t WHERE grp = ? AND v > ?", ["a", 1.0]) == [(2,)]
    assert rows_of(conn, "SELECT COUNT(*) FROM t WHERE grp = $2 AND v > $1", [1.0, "a"]) == [(2,)]
    assert rows_of(conn, "SELECT COUNT(*) FROM t WHERE d >= ?", [dt.date(2024, 3, 1)]) == [(3,)]
    assert rows_of(conn, "SELECT COUNT(*) FROM t WHERE ok = ?", [False]) == [(2,)]
    assert rows_of(conn, "SELECT COUNT(*) FROM t WHERE note = ?", ["it's"]) == [(1,)]
    assert rows_of(conn, "SELECT COUNT(*) FROM t WHERE note IS NOT DISTINCT FROM ?", [None]) == [
        (1,)
    ]


def test_parameter_values_are_literals_not_sql(conn):
    spy = EngineSpy(conn.service)
    evil = "x' OR '1'='1"
    assert rows_of(conn, "SELECT COUNT(*) FROM t WHERE note = ?", [evil]) == [(0,)]
    assert "OR '1'='1'" not in spy.sql[0]


def test_parameter_errors(conn):
    cur = conn.cursor()
    with pytest.raises(ProgrammingError, match="parameter"):
        cur.execute("SELECT COUNT(*) FROM t WHERE grp = ?")
    with pytest.raises(ProgrammingError, match="parameter 2"):
        cur.execute("SELECT COUNT(*) FROM t WHERE grp = ? AND v > ?", ["a"])
    with pytest.raises(ProgrammingError, match="named"):
        cur.execute("SELECT COUNT(*) FROM t WHERE grp = :g", {"g": "a"})
    with pytest.raises(ProgrammingError, match="type"):
        cur.execute("SELECT COUNT(*) FROM t WHERE grp = ?", [object()])
    assert spent(conn) == Cost()


# -- settings -------------------------------------------------------------------------------

DEFAULT_SETTINGS = {
    "epsilon": 1.0,
    "delta": 1e-6,
    "mechanism": "laplace",
    "quantile_method": "em",
    "partition_selection": "auto",  # issue 17: optimal selection / τ-threshold / auto
    "confidence": 0.95,
    "bias_estimate": "on",  # issue 31: what the bounds cut, measured (docs/bias.md)
    "bias_interval": "off",
}


def test_set_show_reset(conn):
    cur = conn.cursor()
    assert rows_of(conn, "SHOW epsilon") == [("1.0",)]
    cur.execute("SET epsilon = 0.25")
    cur.execute("SET delta TO 1e-7")
    cur.execute("SET mechanism = 'gaussian'")
    assert conn.settings == {
        "epsilon": 0.25,
        "delta": 1e-7,
        "mechanism": "gaussian",
        "quantile_method": "em",
        "partition_selection": "auto",
        "confidence": 0.95,
        "bias_estimate": "on",
        "bias_interval": "off",
    }
    assert rows_of(conn, "SHOW mechanism") == [("gaussian",)]
    cur.execute("EXPLAIN SELECT COUNT(*) FROM t")
    row = cur.fetchone()
    # COUNT(*)'s measure: the query's ε less the bias estimate's share (docs/bias.md)
    answer = 0.25 - bias.share(0.25)
    assert row[2] == "gaussian" and row[6] == answer and row[7] == 1e-7 and row[8] > 0  # zCDP
    for name in ("epsilon", "delta", "mechanism"):
        cur.execute(f"RESET {name}")
    assert conn.settings == DEFAULT_SETTINGS
    cur.execute("SELECT COUNT(*) FROM t")
    assert cur.cost == Cost(epsilon=1.0)


def test_settings_are_per_connection(policy):
    service = dpsql.Service(policy, ledger=MemoryLedger())
    alice, bob = connect_service(service, "alice"), connect_service(service, "bob")
    alice.cursor().execute("SET epsilon = 0.1")
    assert alice.settings["epsilon"] == 0.1
    assert bob.settings["epsilon"] == 1.0
    service.close()


@pytest.mark.parametrize(
    "sql",
    [
        "SET epsilon = 0",
        "SET epsilon = -1",
        "SET epsilon = 'abc'",
        "SET epsilon = 'inf'",
        "SET epsilon = 'nan'",
        "SET delta = 1",
        "SET delta = -0.1",
        "SET delta = 'nan'",
        "SET mechanism = 'exponential'",
        "SET confidence = 1",
        "SET confidence = 0",
        "SET confidence = 'nan'",
        "SET threads = 1",
        "SHOW threads",
        "RESET threads",
    ],
)
def test_invalid_settings_are_refused(conn, sql):
    with pytest.raises(ProgrammingError) as info:
        conn.cursor().execute(sql)
    assert info.value.hint
    assert conn.settings == DEFAULT_SETTINGS


# -- spending -------------------------------------------------------------------------------


def test_explain_and_describe_spend_nothing(conn):
    spy = EngineSpy(conn.service)
    cur = conn.cursor()
    cur.execute("EXPLAIN SELECT grp, COUNT(*), AVG(v) FROM t GROUP BY grp")
    rows = cur.fetchall()
    assert rows[-1][0] == "engine_sql" and rows[-2][0] == "total"
    total = rows[-2]
    assert total[6] == pytest.approx(1.0)  # the epsilon the query would cost
    described = conn.describe("SELECT grp, COUNT(*) AS n, AVG(v) FROM t GROUP BY grp")
    assert [d[:2] for d in described] == [("grp", "VARCHAR"), ("n", "BIGINT"), ("avg", "DOUBLE")]
    assert spy.calls == 0 and spent(conn) == Cost()
    cur.execute("SELECT grp, COUNT(*) AS n, AVG(v) FROM t GROUP BY grp")
    assert cur.description == described
    assert spent(conn) == Cost(epsilon=1.0) and cur.cost == Cost(epsilon=1.0)


def test_budget_exhaustion_is_refused_before_running(policy):
    policy["privacy"].update(budget_epsilon=1.0)
    with exact_connect(policy) as conn:
        spy = EngineSpy(conn.service)
        cur = conn.cursor()
        cur.execute("SET epsilon = 0.6")
        cur.execute("SELECT COUNT(*) FROM t")
        with pytest.raises(BudgetExhaustedError) as info:
            cur.execute("SELECT SUM(v) FROM t")
        assert spy.calls == 1
        assert spent(conn) == Cost(epsilon=0.6)
        assert "remaining epsilon=0.4" in info.value.message
        assert info.value.sqlstate == "53400" and "SET epsilon" in info.value.hint
        cur.execute("SET epsilon = 0.4")  # what remains still works
        cur.execute("SELECT SUM(v) FROM t")
        assert spent(conn).epsilon == pytest.approx(1.0)


def test_analysts_have_separate_budgets(policy):
    policy["privacy"].update(budget_epsilon=1.0)
    service = dpsql.Service(policy, ledger=MemoryLedger())
    alice, bob = connect_service(service, "alice"), connect_service(service, "bob")
    alice.cursor().execute("SELECT COUNT(*) FROM t")
    with pytest.raises(BudgetExhaustedError):
        alice.cursor().execute("SELECT SUM(v) FROM t")
    bob.cursor().execute("SELECT SUM(v) FROM t")
    service.close()


# -- answer cache ---------------------------------------------------------------------------


@pytest.fixture
def cached_conn(policy):
    with dpsql.connect(policy=policy, ledger=MemoryLedger(), noise=SeededNoise(5)) as c:
        yield c


def test_same_query_twice_is_cached_and_free(cached_conn):
    cur = cached_conn.cursor()
    cur.execute("SELECT grp, COUNT(*), AVG(v) FROM t GROUP BY grp")
    first, cost = cur.fetchall(), cur.cost
    assert not cur.cached and cost is not None
    cur.execute("SELECT grp, COUNT(*), AVG(v) FROM t GROUP BY grp")
    assert cur.cached and cur.cost is None
    assert cur.fetchall() == first  # the same noisy answer, not a fresh draw
    assert spent(cached_conn) == cost


def test_post_processing_variants_reuse_the_cache(cached_conn):
    cur = cached_conn.cursor()
    cur.execute("SELECT grp, COUNT(*) FROM t GROUP BY grp")
    first = dict(cur.fetchall())
    cost = spent(cached_conn)
    for sql in (
        "SELECT grp, COUNT(*) FROM t GROUP BY grp ORDER BY 2 DESC",
        "SELECT grp, COUNT(*) FROM t GROUP BY grp ORDER BY grp LIMIT 1",
        "SELECT grp AS g, COUNT(*) AS n FROM t GROUP BY 1 HAVING COUNT(*) > -1000",
        "select   grp, count(*)  from t group by grp -- a comment",
    ):
        cur.execute(sql)
        assert cur.cached, sql
        assert all(first[g] == n for g, n in cur.fetchall())
    assert spent(cached_conn) == cost


def test_cache_is_not_shared_by_different_aggregates(cached_conn):
    """AVG(v) and SUM(v), COUNT(v) read the same measures but release different outputs."""
    cur = cached_conn.cursor()
    cur.execute("SELECT AVG(v) FROM t")
    cur.execute("SELECT SUM(v), COUNT(v) FROM t")
    assert len(cur.fetchall()[0]) == 2
    assert not cur.cached
    cur.execute("SELECT COUNT(v), SUM(v) FROM t")
    assert len(cur.fetchall()[0]) == 2


def test_cache_distinguishes_settings(cached_conn):
    cur = cached_conn.cursor()
    cur.execute("SELECT COUNT(*) FROM t")
    cur.execute("SET epsilon = 0.5")
    cur.execute("SELECT COUNT(*) FROM t")
    assert not cur.cached and cur.cost == Cost(epsilon=0.5)


# -- results --------------------------------------------------------------------------------


def test_intervals_cover_released_values(conn):
    cur = conn.cursor()
    cur.execute("SELECT grp, COUNT(*) AS n, SUM(v) FROM t GROUP BY grp")
    rows = cur.fetchall()
    assert len(cur.intervals) == len(rows)
    for row, intervals in zip(rows, cur.intervals, strict=True):
        assert intervals[0] is None  # a key: no noise
        for value, iv in zip(row[1:], intervals[1:], strict=True):
            low, high = iv
            assert low <= value <= high


def test_post_processing_errors_are_dbapi_errors(conn):
    cur = conn.cursor()
    for sql in ("SELECT CAST(COUNT(*) AS TINYINT) * 100 FROM t", "SELECT COUNT(*) // 0 FROM t"):
        with pytest.raises(DataError):
            cur.execute(sql)
    with pytest.raises(DataError):
        cur.execute("SELECT 'a'::INT")


def test_undrawable_noise_scale_is_refused_before_running(policy):
    """A tiny epsilon gives a noise scale the exact sampler cannot draw: refused, nothing read."""
    with dpsql.connect(policy=policy, ledger=MemoryLedger(), noise=SeededNoise(1)) as conn:
        spy = EngineSpy(conn.service)
        cur = conn.cursor()
        cur.execute("SET epsilon = 1e-12")
        with pytest.raises(DataError) as info:
            cur.execute("SELECT COUNT(*), SUM(v) FROM t")
        assert "epsilon" in info.value.hint
        assert spy.calls == 0 and spent(conn) == Cost()
