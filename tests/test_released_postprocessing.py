"""Relational post-processing over released tables (issue 27, item 2).

Windows over a DP query's released aggregates, UNION ALL / UNION / INTERSECT / EXCEPT of DP
queries, CTE chains over released rows, joins between released results and scalar subqueries
over one: evaluated on noisy outputs only, the measurements charged in one reservation,
EXPLAIN showing each. What reads private rows outside a DP query stays refused, free.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from conftest import budget, fixture_policy

import dpsql
from dpsql.errors import BudgetExhaustedError, PrivacyError, ProgrammingError
from dpsql.privacy.ledger import MemoryLedger
from dpsql.privacy.samplers import ZeroNoise
from dpsql.service.postprocess import check_tables, run_post

LOOSE = {"max_rows_per_unit": 100, "max_groups_per_unit": 100}
_analysts = itertools.count()


class Reads:
    """Counts the engine's executions (reading data)."""

    def __init__(self, service: dpsql.Service) -> None:
        self.count = 0
        execute = service.engine.execute

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return execute(*args, **kwargs)

        service.engine.execute = counted  # type: ignore[method-assign]


@pytest.fixture(scope="module")
def exact() -> Any:
    service = dpsql.Service(
        fixture_policy(privacy={"budget_epsilon": 1e6, "budget_delta": 0.5}, table=LOOSE),
        ledger=MemoryLedger(),
        noise=ZeroNoise(),
        cache=False,
    )
    reads = Reads(service)
    yield service, reads
    service.close()


@pytest.fixture(scope="module")
def noisy() -> Any:
    service = dpsql.Service(
        fixture_policy(privacy={"budget_epsilon": 1e6, "budget_delta": 0.5}, table=LOOSE),
        ledger=MemoryLedger(),
    )
    reads = Reads(service)
    yield service, reads
    service.close()


def run(service: dpsql.Service, sql: str, analyst: str | None = None) -> Any:
    conn = service.connect(analyst or f"a{next(_analysts)}")
    return service.execute(sql, None, conn._settings, conn.analyst), conn


def counts(service: dpsql.Service, where: str = "") -> dict[str, int]:
    result, _ = run(service, f"SELECT department, COUNT(*) AS n FROM visits {where} GROUP BY 1")
    return dict(result.rows)


# -- windows over a DP query's released aggregates -----------------------------------------------


def test_windows_over_released_aggregates(noisy: Any) -> None:
    service, _ = noisy
    sql = (
        "SELECT department, COUNT(*) AS n, SUM(COUNT(*)) OVER (ORDER BY department) AS running, "
        "COUNT(*) * 100.0 / SUM(COUNT(*)) OVER () AS pct, "
        "RANK() OVER (ORDER BY COUNT(*) DESC) AS r, LAG(COUNT(*)) OVER (ORDER BY department) "
        "AS prev FROM visits GROUP BY department ORDER BY department"
    )
    result, conn = run(service, sql)
    assert [d[0] for d in result.description] == ["department", "n", "running", "pct", "r", "prev"]
    n = [row[1] for row in result.rows]
    total = sum(n)
    assert [row[2] for row in result.rows] == list(itertools.accumulate(n))
    assert [row[3] for row in result.rows] == pytest.approx([v * 100.0 / total for v in n])
    ranks = sorted(range(len(n)), key=lambda i: -n[i])
    assert result.rows[ranks[0]][4] == 1
    assert [row[5] for row in result.rows] == [None, *n[:-1]]
    # intervals: a running sum has the sum of the bounds; a ratio and a rank none; LAG the
    # picked row's own
    lows = [iv[1][0] for iv in result.intervals]
    assert [iv[2][0] for iv in result.intervals] == pytest.approx(list(itertools.accumulate(lows)))
    assert all(iv[3] is None and iv[4] is None for iv in result.intervals)
    assert result.intervals[1][5] == result.intervals[0][1]
    # one measurement, charged what EXPLAIN says
    assert budget(conn)["charged_epsilon"] == pytest.approx(result.cost.epsilon)


def test_window_values_equal_the_exact_answer(exact: Any) -> None:
    service, _ = exact
    n = counts(service)
    result, _ = run(
        service,
        "SELECT department, COUNT(*) * 100.0 / SUM(COUNT(*)) OVER () AS pct FROM visits "
        "GROUP BY department",
    )
    total = sum(n.values())
    assert dict(result.rows) == pytest.approx({k: v * 100.0 / total for k, v in n.items()})


WINDOWED = (
    "SELECT department, COUNT(*) AS n, COUNT(*) * 100.0 / SUM(COUNT(*)) OVER () AS pct "
    "FROM visits GROUP BY 1"
)


@pytest.mark.parametrize(
    ("sql", "columns", "kept"),
    [
        # Superset's table chart in raw mode over a virtual dataset (captured, docs/bi_tools.md)
        (f"SELECT department, n, pct FROM ({WINDOWED}) AS virtual_table LIMIT 1000", 3, None),
        (f"SELECT * FROM ({WINDOWED}) AS v", 3, None),
        (f"SELECT v.* FROM ({WINDOWED}) AS v", 3, None),
        (f"WITH v AS ({WINDOWED}) SELECT department, pct FROM v", 2, None),
        # the window is computed over every released row, before the outer WHERE (PostgreSQL)
        (f"SELECT department, pct FROM ({WINDOWED}) AS v WHERE n > 3400", 2, 3400),
        # a star over a DP query nested for its ORDER BY/LIMIT keeps every column
        (
            "SELECT * FROM (SELECT department, COUNT(*) AS n, SUM(COUNT(*)) OVER () AS t "
            "FROM visits GROUP BY 1 ORDER BY n DESC LIMIT 3) AS v",
            3,
            None,
        ),
    ],
)
def test_an_outer_query_over_a_windowed_dp_query(
    exact: Any, sql: str, columns: int, kept: int | None
) -> None:
    """A projection (or WHERE) over a DP query with windows reads its released rows: one
    charge, the windows' values as in PostgreSQL (computed before the outer query), every
    column of a star (a bare * was taken for one column, or the windows were refused)."""
    service, _ = exact
    n = counts(service)
    total = sum(n.values())
    result, conn = run(service, sql)
    assert all(len(row) == columns for row in result.rows)
    expected = {k for k, v in n.items() if kept is None or v > kept}
    if "LIMIT 3" in sql:
        expected = set(sorted(n, key=n.__getitem__, reverse=True)[:3])
        assert [row[2] for row in result.rows] == [total] * 3
    assert {row[0] for row in result.rows} == expected
    if "pct" in sql:
        pct = {row[0]: row[-1] for row in result.rows}
        assert pct == pytest.approx({k: n[k] * 100.0 / total for k in expected})
    assert budget(conn)["charged_epsilon"] == pytest.approx(result.cost.epsilon)


@pytest.mark.parametrize(
    ("sql", "message"),
    [
        ("SELECT cost, SUM(cost) OVER () FROM visits", "window functions over private rows"),
        ("SELECT age, RANK() OVER (ORDER BY cost) FROM visits", "window functions over private"),
        (
            "SELECT department, SUM(cost) OVER () FROM visits GROUP BY department",
            "column 'cost' is used outside an aggregate",
        ),
        (
            "SELECT department, COUNT(*) FROM visits GROUP BY department "
            "HAVING RANK() OVER (ORDER BY COUNT(*)) < 3",
            "not allowed in HAVING",
        ),
        (
            "SELECT department, MODE(department) OVER () FROM visits GROUP BY department",
            "window function MODE is not supported",
        ),
        (
            "SELECT age FROM visits UNION SELECT age FROM visits",
            "UNION of queries that read private rows directly",
        ),
        (
            "SELECT department, COUNT(*) FROM visits GROUP BY 1 UNION ALL "
            "SELECT department, age FROM visits",
            "UNION of queries that read private rows directly",
        ),
        (
            "WITH a AS (SELECT department, COUNT(*) AS n FROM visits GROUP BY department) "
            "SELECT * FROM a JOIN visits v ON a.department = v.department",
            "a join of a released result with private rows",
        ),
        (
            "WITH a AS (SELECT department, COUNT(*) AS n FROM visits GROUP BY 1), "
            "b AS (SELECT department, COUNT(*) AS m FROM visits GROUP BY 1) "
            "SELECT * FROM a JOIN b ON a.department = b.department "
            "WHERE n > (SELECT MAX(age) FROM visits WHERE age > 0 AND cost IS NULL OR true)",
            None,  # a scalar DP subquery: answered (MAX is a DP aggregate)
        ),
    ],
)
def test_what_stays_refused_is_free_and_reads_nothing(
    noisy: Any, sql: str, message: str | None
) -> None:
    service, reads = noisy
    before = reads.count
    conn = service.connect(f"r{next(_analysts)}")
    if message is None:
        service.execute(sql, None, conn._settings, conn.analyst)
        return
    with pytest.raises(PrivacyError) as info:
        service.execute(sql, None, conn._settings, conn.analyst)
    assert info.value.sqlstate == "42501"
    assert message in info.value.message
    assert info.value.hint
    assert reads.count == before
    assert budget(conn)["charged_epsilon"] == 0


# -- several DP queries, one reservation ----------------------------------------------------------


UNION_TOTAL = (
    "SELECT department, COUNT(*) AS n FROM visits WHERE smoker GROUP BY department "
    "UNION ALL SELECT 'TOTAL', COUNT(*) FROM visits"
)


def test_union_all_grouped_rows_plus_a_total_row(exact: Any) -> None:
    service, reads = exact
    before = reads.count
    result, conn = run(service, UNION_TOTAL)
    smokers = counts(service, "WHERE smoker")
    everyone = sum(counts(service).values())
    assert dict(result.rows) == {**smokers, "TOTAL": everyone}
    assert [d[0] for d in result.description] == ["department", "n"]
    assert reads.count - before == 2 + 2  # the two measurements (and the two reference runs)
    # every row keeps its own measurement's interval (noise off: a zero-width one)
    assert all(iv[0] is None and iv[1] is not None for iv in result.intervals)
    explain, _ = run(service, "EXPLAIN " + UNION_TOTAL, conn.analyst)
    totals = [r for r in explain.rows if str(r[0]).endswith(": total")]
    assert [r[0] for r in totals] == [
        "measurement 1 (UNION branch 1): total",
        "measurement 2 (UNION branch 2): total",
    ]
    assert budget(conn)["charged_epsilon"] == pytest.approx(sum(r[6] for r in totals))
    assert explain.rows[-1][0].startswith("post-processing of the released results (UNION ALL)")


def test_one_reservation_nothing_runs_when_the_sum_does_not_fit() -> None:
    """Each measurement alone fits the budget, both do not: refused before any read, nothing
    charged, nothing released."""
    service = dpsql.Service(
        fixture_policy(privacy={"budget_epsilon": 1.5, "epsilon": 1.0}),
        ledger=MemoryLedger(),
        noise=ZeroNoise(),
    )
    reads = Reads(service)
    conn = service.connect("tight")
    with pytest.raises(BudgetExhaustedError):
        service.execute(UNION_TOTAL, None, conn._settings, "tight")
    assert reads.count == 0
    assert budget(conn)["charged_epsilon"] == 0
    service.close()


@pytest.mark.parametrize(
    "sql",
    [
        # cohort A vs B: a join of two released results
        "WITH a AS (SELECT department, COUNT(*) AS n FROM visits WHERE smoker GROUP BY 1), "
        "b AS (SELECT department, COUNT(*) AS m FROM visits WHERE NOT smoker GROUP BY 1) "
        "SELECT a.department, n, m FROM a JOIN b ON a.department = b.department",
        # a scalar subquery over a released result
        "WITH a AS (SELECT department, COUNT(*) AS n FROM visits GROUP BY department) "
        "SELECT department, n, n * 100.0 / (SELECT SUM(n) FROM a) AS pct FROM a",
        # a CTE ranking another CTE's released rows, then filtered
        "WITH a AS (SELECT department, COUNT(*) AS n FROM visits GROUP BY department), "
        "r AS (SELECT department, n, RANK() OVER (ORDER BY n DESC) AS rk FROM a) "
        "SELECT department, n FROM r WHERE rk <= 3",
        "SELECT department FROM visits WHERE smoker GROUP BY 1 HAVING COUNT(*) > 500 "
        "INTERSECT SELECT department FROM visits GROUP BY 1 HAVING COUNT(*) > 3300",
        "SELECT department FROM visits GROUP BY 1 EXCEPT "
        "SELECT department FROM visits GROUP BY 1 HAVING COUNT(*) < 3300",
        # UNION (distinct): the same released rows twice are one
        "SELECT smoker, COUNT(*) FROM visits GROUP BY 1 "
        "UNION SELECT smoker, COUNT(*) FROM visits GROUP BY 1",
    ],
)
def test_shapes_answer_the_exact_post_processing(exact: Any, sql: str) -> None:
    """Noise off: the answer is the same SQL run on the fixture (bounds never bind)."""
    import duckdb
    from conftest import FIXTURE_CSV

    service, _ = exact
    result, conn = run(service, sql)
    ref = duckdb.connect()
    ref.execute(
        "CREATE TABLE visits AS SELECT * FROM read_csv(?, header = true)", [str(FIXTURE_CSV)]
    )
    expected = ref.execute(sql).fetchall()
    assert sorted(map(repr, result.rows)) == sorted(map(repr, expected))
    explain, _ = run(service, "EXPLAIN " + sql, conn.analyst)
    spent = sum(r[6] for r in explain.rows if str(r[0]).endswith(": total"))
    assert budget(conn)["charged_epsilon"] == pytest.approx(spent)


def test_a_cached_answer_replays_at_no_cost() -> None:
    service = dpsql.Service(
        fixture_policy(privacy={"budget_epsilon": 100}), ledger=MemoryLedger(), cache=True
    )
    conn = service.connect("c")
    first = service.execute(UNION_TOTAL, None, conn._settings, "c")
    spent = budget(conn)["charged_epsilon"]
    again = service.execute(UNION_TOTAL, None, conn._settings, "c")
    assert again.rows == first.rows and again.cached
    assert budget(conn)["charged_epsilon"] == spent
    service.close()


def test_post_processing_errors_before_the_charge_are_free(exact: Any) -> None:
    service, reads = exact
    before = reads.count
    conn = service.connect("typo")
    with pytest.raises(ProgrammingError) as info:
        service.execute(
            "WITH a AS (SELECT department, COUNT(*) AS n FROM visits GROUP BY 1) "
            "SELECT nosuch FROM a UNION ALL SELECT 'x'",
            None,
            conn._settings,
            "typo",
        )
    assert "nosuch" in info.value.message and "__m" not in info.value.message
    assert "Binder" not in info.value.message
    assert reads.count == before
    assert budget(conn)["charged_epsilon"] == 0


def test_the_post_processing_connection_holds_no_table() -> None:
    """The released rows are the only relations there: a policy table's name is unknown on
    it, and the post tree may name only released results and its own CTEs."""
    import sqlglot

    tree = sqlglot.parse_one("SELECT * FROM visits", read="duckdb")
    with pytest.raises(ProgrammingError) as info:
        check_tables(tree)
    assert info.value.sqlstate == "42501"
    with pytest.raises(ProgrammingError, match="visits"):
        run_post(tree, [], [])
    tree = sqlglot.parse_one("SELECT * FROM read_csv('/etc/passwd')", read="duckdb")
    with pytest.raises(ProgrammingError):
        check_tables(tree)
    _, rows = run_post(
        sqlglot.parse_one("SELECT SUM(n) AS t FROM __m0", read="duckdb"),
        [([("k", "VARCHAR"), ("n", "BIGINT")], [("a", 1), ("b", 2)])],
        ["q"],
    )
    assert rows == [(3,)]


def test_explain_text_names_each_measurement_and_the_post_processing(exact: Any) -> None:
    service, reads = exact
    before = reads.count
    result, conn = run(service, "EXPLAIN (FORMAT TEXT) " + UNION_TOTAL)
    lines = [row[0] for row in result.rows]
    assert [d[0] for d in result.description] == ["QUERY PLAN"]
    assert "measurement 1 (UNION branch 1):" in lines
    assert "measurement 2 (UNION branch 2):" in lines
    assert any(
        line.startswith("ReleasedPostProcess SELECT * FROM __m0 UNION ALL") for line in lines
    )
    assert lines[-1].endswith("one reservation")
    assert reads.count == before and budget(conn)["charged_epsilon"] == 0


def test_the_reserved_cost_is_the_sum_of_the_measurements_maps(exact: Any) -> None:
    """dpsql.plan.measures.ReleasedPostProcess: the statement's charge is checked against the
    sum of its plan trees' privacy maps before anything is read."""
    from dpsql.frontend.bind import parse_statement
    from dpsql.plan.measures import ReleasedPostProcess
    from dpsql.service.composite import _released_cost, plan_released

    service, _ = exact
    conn = service.connect("tree")
    query = parse_statement(UNION_TOTAL, service.policy)
    plans = plan_released(service, query, conn._settings, "tree")
    tree = ReleasedPostProcess(tuple(p.root for p in plans), query.post)
    charged = _released_cost(plans)
    assert charged == plans[0].cost + plans[1].cost
    assert tree.cost().epsilon == pytest.approx(charged.epsilon)
    assert tree.cost().delta == pytest.approx(charged.delta)
    assert "free" in tree.stability()


def test_a_total_row_keeps_the_key_type_and_every_row_its_interval(noisy: Any) -> None:
    """``SELECT NULL, COUNT(*)`` as a TOTAL row: its NULL takes the other branch's type (as in
    SQL); parenthesised branches, a constant row and ORDER BY / LIMIT on the result keep each
    measured row's own interval; the constant row has none."""
    service, _ = noisy
    result, _ = run(
        service,
        "(SELECT smoker, COUNT(*) AS n FROM visits GROUP BY 1 ORDER BY 1) UNION ALL "
        "(SELECT NULL, COUNT(*) FROM visits) UNION ALL SELECT NULL, -1 ORDER BY 2 DESC",
    )
    assert [d[1] for d in result.description] == ["BOOLEAN", "BIGINT"]
    assert [row[0] for row in result.rows] == [None, False, True, None]
    assert result.rows[-1][1] == -1 and result.intervals[-1] == (None, None)
    for row, (_, interval) in zip(result.rows[:3], result.intervals[:3], strict=True):
        low, high = interval
        assert low <= row[1] <= high


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT department, COUNT(*) * 100.0 / (SELECT COUNT(*) FROM visits) AS pct "
        "FROM visits GROUP BY department",
        "SELECT department, COUNT(*), AVG(age) / (SELECT AVG(age) FROM visits) AS rel "
        "FROM visits WHERE smoker GROUP BY 1 HAVING COUNT(*) > (SELECT COUNT(*) / 40 FROM visits) "
        "ORDER BY 2 DESC LIMIT 3",
        "SELECT COUNT(*) * 1.0 / (SELECT COUNT(DISTINCT patient_id) FROM visits) AS per_patient "
        "FROM visits",
    ],
)
def test_a_scalar_dp_subquery_inside_a_dp_query(exact: Any, sql: str) -> None:
    """The query's own keys and aggregates are one measurement, each scalar subquery another,
    all in one reservation; its SELECT list, HAVING, ORDER BY and LIMIT run over the released
    tables. Noise off: the same as the SQL on the fixture."""
    import duckdb
    from conftest import FIXTURE_CSV

    service, _ = exact
    result, conn = run(service, sql)
    ref = duckdb.connect()
    ref.execute(
        "CREATE TABLE visits AS SELECT * FROM read_csv(?, header = true)", [str(FIXTURE_CSV)]
    )
    expected = ref.execute(sql).fetchall()
    assert len(result.rows) == len(expected)
    for row, want in zip(sorted(result.rows), sorted(expected), strict=True):
        assert row == pytest.approx(want)
    explain, _ = run(service, "EXPLAIN " + sql, conn.analyst)
    totals = [r for r in explain.rows if str(r[0]).endswith(": total")]
    names = [r[0].split(":")[0] for r in totals]
    assert names[0] == "measurement 1 (query)"
    assert names[1:] == [f"measurement {i} (scalar subquery)" for i in range(2, len(names) + 1)]
    assert budget(conn)["charged_epsilon"] == pytest.approx(sum(r[6] for r in totals))


def test_a_per_unit_relation_is_not_a_measurement_of_its_own(exact: Any) -> None:
    """A CTE grouped by the privacy unit is a per-unit relation (dpsql.frontend.per_unit), not
    a DP query: in a set operation it is read by the DP query over it."""
    from dpsql.frontend.bind import parse_statement
    from dpsql.frontend.statements import ReleasedQuery

    service, _ = exact
    query = parse_statement(
        "WITH pu AS (SELECT patient_id, SUM(cost) AS s FROM visits GROUP BY patient_id) "
        "SELECT COUNT(*) FROM pu UNION ALL SELECT COUNT(*) FROM visits",
        service.policy,
    )
    assert isinstance(query, ReleasedQuery)
    assert query.names == ("UNION branch 1", "UNION branch 2")
    assert len(query.measurements) == 2


def test_the_post_processing_database_is_empty_and_locked() -> None:
    """What post-processing runs on holds no table (not even an empty shadow), reads no file
    and cannot be reconfigured: only released values ever reach it."""
    import duckdb

    from dpsql.service.postprocess import _connection

    cur = _connection()
    try:
        assert cur.execute("SELECT COUNT(*) FROM duckdb_tables()").fetchone() == (0,)
        assert cur.execute("SELECT COUNT(*) FROM duckdb_views() WHERE NOT internal").fetchone() == (
            0,
        )
        with pytest.raises(duckdb.Error):
            cur.execute("SET enable_external_access = true")
        with pytest.raises(duckdb.Error):
            cur.execute("SELECT * FROM read_csv('/etc/hostname')")
    finally:
        cur.close()


@pytest.mark.parametrize(
    ("analyst", "sql"),
    [
        # carol may not read diagnosis: not in a UNION branch, a CTE or a scalar subquery
        (
            "carol",
            "SELECT department, COUNT(*) FROM visits GROUP BY 1 UNION ALL "
            "SELECT diagnosis, COUNT(*) FROM visits GROUP BY 1",
        ),
        (
            "carol",
            "WITH a AS (SELECT department, COUNT(*) AS n FROM visits GROUP BY 1), "
            "b AS (SELECT department, COUNT(DISTINCT diagnosis) AS d FROM visits GROUP BY 1) "
            "SELECT * FROM a JOIN b ON a.department = b.department",
        ),
        (
            "bob",  # bob may not read cost
            "SELECT department, COUNT(*) / (SELECT SUM(cost) FROM visits) FROM visits GROUP BY 1",
        ),
        ("dave", UNION_TOTAL),  # dave reads nothing
    ],
)
def test_access_rules_hold_in_every_measurement(tmp_path: Any, analyst: str, sql: str) -> None:
    from test_authorization import write_policy

    service = dpsql.Service(write_policy(tmp_path), ledger=MemoryLedger())
    reads = Reads(service)
    conn = service.connect(analyst)
    with pytest.raises(PrivacyError) as info:
        service.execute(sql, None, conn._settings, analyst)
    assert info.value.sqlstate == "42501"
    assert reads.count == 0 and budget(conn)["charged_epsilon"] == 0
    service.close()


def test_a_sum_over_released_rows_has_the_sum_of_their_bounds(noisy: Any) -> None:
    """``SELECT SUM(n) FROM (DP query)`` (filtered or grouped again): the interval is the sum
    of the summed rows' bounds; COUNT(*) of released rows has none."""
    service, _ = noisy
    per_group, _ = run(service, "SELECT department, COUNT(*) AS n FROM visits GROUP BY 1")
    result, _ = run(
        service,
        "SELECT SUM(n) AS total, COUNT(*) AS groups FROM "
        "(SELECT department, COUNT(*) AS n FROM visits GROUP BY department) AS s",
    )
    (total, groups), ((low, high), none) = result.rows[0], result.intervals[0]
    assert groups == 6 and none is None
    assert low <= total <= high and high - low > 0
    # another release (cache off): only the width is comparable, and each interval is itself
    # simulated, so roughly
    width = sum(iv[1][1] - iv[1][0] for iv in per_group.intervals)
    assert high - low == pytest.approx(width, rel=0.25)


def test_scalar_dp_subqueries_without_from(exact: Any) -> None:
    """``SELECT (SELECT COUNT(*) FROM visits) AS n, (SELECT AVG(age) FROM visits) AS a``: two
    measurements, one reservation; a scalar subquery over private rows stays refused."""
    service, _ = exact
    result, conn = run(
        service, "SELECT (SELECT COUNT(*) FROM visits) AS n, (SELECT AVG(age) FROM visits) AS a"
    )
    assert budget(conn)["charged_epsilon"] == pytest.approx(result.cost.epsilon)
    assert [d[0] for d in result.description] == ["n", "a"]
    assert result.rows[0][0] == sum(counts(service).values())
    with pytest.raises(PrivacyError):
        run(service, "SELECT (SELECT age FROM visits LIMIT 1)")


def test_a_join_of_released_results_keeps_each_picked_value_interval(noisy: Any) -> None:
    """Cohort A vs B: each picked count keeps its own measurement's interval (a LEFT JOIN's
    missing side has none); the ratio has none."""
    service, _ = noisy
    result, _ = run(
        service,
        "SELECT a.department, a.n, b.n AS m, a.n * 1.0 / b.n AS ratio "
        "FROM (SELECT department, COUNT(*) AS n FROM visits WHERE smoker GROUP BY 1) a "
        "LEFT JOIN (SELECT department, COUNT(*) AS n FROM visits WHERE NOT smoker GROUP BY 1) b "
        "ON a.department = b.department ORDER BY ratio",
    )
    assert len(result.rows) == 6
    for row, (key, n, m, ratio) in zip(result.rows, result.intervals, strict=True):
        assert key is None and ratio is None
        assert n[0] <= row[1] <= n[1] and m[0] <= row[2] <= m[1]
