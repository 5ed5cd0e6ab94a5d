"""SUM(DISTINCT x): the sum of the distinct fixed-point values of x among the bounded rows.

Exact answers (noise off) against hand-written DuckDB over the same rows, in a flat query and
in the outer query over a per-unit relation; the sensitivity R·max|v| per group (G groups)
on the plan and on a neighbouring dataset; EXPLAIN names the measure; other DISTINCT
aggregates stay refused, free.
"""

from __future__ import annotations

import duckdb
import pytest
from conftest import (
    CLAMP_MACRO,
    FIXTURE_CSV,
    assert_same_rows,
    exact_connect,
    fixture_policy,
    rows_of,
    table_policy,
    write_csv,
)

import dpsql
from dpsql.errors import ProgrammingError
from dpsql.frontend.bind import parse_statement
from dpsql.pipeline import Settings
from dpsql.privacy.accounting import Cost
from dpsql.privacy.ledger import MemoryLedger

COLUMNS = {
    "uid": {"type": "int", "nullable": False},
    "grp": {"type": "text", "values": ["a", "b", "c"], "nullable": False},
    "n": {"type": "int", "lower": -5, "upper": 10},
    "cost": {"type": "float", "lower": 0.0, "upper": 50.0, "granularity": 0.5},
}
ROWS = [
    (1, "a", 3, 1.2),
    (1, "a", 3, 1.3),  # same fixed-point value as 1.2 (g = 0.5): one distinct value
    (2, "a", 20, 60.0),  # clamped: n to 10, cost to 50
    (2, "b", -9, None),  # n clamped to -5; a NULL cost is not summed
    (3, "b", -5, 7.0),
    (3, "c", None, 7.0),
    (4, "c", 4, 2.0),
    (5, "c", 4, 2.0),
]
DECLARED = {"n": (-5, 10, 1.0), "cost": (0.0, 50.0, 0.5)}


def reference(path, sql: str) -> list:
    """``sql`` over the CSV in plain DuckDB, with ``fp(col)`` the column's fixed-point
    value (clamped, rounded to its granularity, times the granularity)."""
    con = duckdb.connect()
    con.execute(CLAMP_MACRO)
    con.execute(f"CREATE TABLE t AS SELECT * FROM read_csv_auto('{path}')")
    for col, (lo, hi, g) in DECLARED.items():
        sql = sql.replace(f"fp({col})", f"(ROUND(cl({col}, {lo}, {hi}) / {g}) * {g})")
    return con.execute(sql).fetchall()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_csv(tmp_path_factory.mktemp("sd") / "t.csv", list(COLUMNS), ROWS)


@pytest.mark.parametrize("unit", [None, "uid"])
def test_flat_sum_distinct_is_exact(data, unit):
    """Row-level, and with a unit whose R and G never bind (<= 2 rows, <= 2 groups each)."""
    policy = table_policy(data, COLUMNS, unit=unit, rows=2, groups=2, privacy={"delta": 0.0})
    conn = exact_connect(policy)
    got = rows_of(
        conn,
        "SELECT grp, SUM(DISTINCT n), SUM(DISTINCT cost), SUM(cost), COUNT(cost) FROM t "
        "GROUP BY grp",
    )
    expected = reference(
        data,
        "SELECT grp, SUM(DISTINCT fp(n)), SUM(DISTINCT fp(cost)), COALESCE(SUM(fp(cost)), 0), "
        "COUNT(cost) FROM t GROUP BY grp",
    )
    assert_same_rows(got, expected)
    assert_same_rows(
        rows_of(conn, "SELECT SUM(DISTINCT cost) FROM t"),
        reference(data, "SELECT SUM(DISTINCT fp(cost)) FROM t"),
    )


def _fixture_reference(sql: str) -> list:
    con = duckdb.connect()
    con.execute(CLAMP_MACRO)
    con.execute(f"CREATE TABLE visits AS SELECT * FROM read_csv_auto('{FIXTURE_CSV}')")
    return con.execute(sql).fetchall()


# R and G that never bind on the fixture: the bounded rows are all its rows
WIDE = {"max_rows_per_unit": 1000, "max_groups_per_unit": 10}


def test_fixture_flat_and_per_unit_outer_are_exact():
    conn = exact_connect(fixture_policy(table=WIDE))
    got = rows_of(conn, "SELECT department, SUM(DISTINCT cost) FROM visits GROUP BY department")
    expected = _fixture_reference(
        "SELECT department, SUM(DISTINCT ROUND(cl(cost, 0, 5000) / 0.01)) * 0.01 "
        "FROM visits GROUP BY department"
    )
    assert_same_rows(got, [(k, float(v)) for k, v in expected])
    # the outer query over V: per_user in [0, R·5000], one row per unit (R' = 1)
    got = rows_of(
        conn,
        "SELECT SUM(DISTINCT per_user) FROM (SELECT patient_id, SUM(cost) AS per_user "
        "FROM visits GROUP BY patient_id) v",
    )
    expected = _fixture_reference(
        "SELECT SUM(DISTINCT cl(s, 0, 5000000)) * 0.01 FROM (SELECT patient_id, "
        "SUM(ROUND(cl(cost, 0, 5000) / 0.01)) AS s FROM visits GROUP BY patient_id)"
    )
    assert_same_rows(got, [(float(expected[0][0]),)], rel=1e-12)


def test_plan_sensitivity_is_r_times_the_largest_value_per_group(data):
    R, G = 3, 2
    svc = dpsql.Service(table_policy(data, COLUMNS, unit="uid", rows=R, groups=G))
    settings = Settings(1.0, 1e-6, "laplace")

    def plan_of(sql: str):
        return svc.plan(parse_statement(sql, svc.policy), settings)

    try:
        plan = plan_of("SELECT grp, SUM(DISTINCT n) FROM t GROUP BY grp")
        (m,) = plan.measures
        assert (m.kind, m.center, m.lo, m.hi, m.scale) == ("distinct_sum", 0, -5, 10, 1)
        assert plan.bounding == "sample"  # the distinct values of the kept rows themselves
        assert (m.row_bound, m.per_group_bound, m.l1) == (10, R * 10, G * R * 10)
        assert m.l2 == pytest.approx(G**0.5 * R * 10)
        # centred SUM beside it: the distinct sum stays uncentred
        sql = "SELECT SUM(DISTINCT n), SUM(n), COUNT(n) FROM t"
        plan = plan_of(sql)
        kinds = {m.kind: m for m in plan.measures}
        assert kinds["sum"].center != 0 and kinds["distinct_sum"].center == 0
        # the outer query over a per-unit relation: V's range, one row per unit (R' = 1)
        sql = "SELECT SUM(DISTINCT s) FROM (SELECT uid, SUM(n) AS s FROM t GROUP BY uid) v"
        (m,) = plan_of(sql).measures
        assert m.kind == "distinct_sum"
        assert (m.lo, m.hi) == (-5 * R, 10 * R)  # SUM(n) per unit: [min(L, R·L), max(U, R·U)]
        assert (m.row_bound, m.per_group_bound, m.l1) == (10 * R, 10 * R, 10 * R)
    finally:
        svc.close()


def test_one_more_unit_moves_each_group_by_at_most_r_times_max_value(tmp_path):
    """Neighbours: the data, and the data plus unit 99 with R rows in each of G groups whose
    values are all new and extreme (the worst case: every one of its values counts)."""
    R, G = 3, 2
    extra = [(99, g, v, 50.0 - i) for g in ("a", "b") for i, v in enumerate((10, -5, 9))]
    results = []
    for rows in (ROWS, ROWS + extra):
        path = write_csv(tmp_path / f"t{len(rows)}.csv", list(COLUMNS), rows)
        conn = exact_connect(table_policy(path, COLUMNS, unit="uid", rows=R, groups=G))
        sql = "SELECT grp, SUM(DISTINCT n), SUM(DISTINCT cost) FROM t GROUP BY grp"
        results.append({r[0]: r[1:] for r in rows_of(conn, sql)})
    before, after = results
    moved_n = [abs(after[k][0] - before[k][0]) for k in before]
    moved_cost = [abs(after[k][1] - before[k][1]) for k in before]
    assert max(moved_n) <= R * 10 and max(moved_cost) <= R * 50.0
    assert sum(moved_n) <= G * R * 10 and sum(moved_cost) <= G * R * 50.0
    assert sum(1 for d in moved_n if d) == G  # the unit did reach G groups


def test_explain_shows_the_measure_and_its_sensitivity():
    conn = exact_connect(fixture_policy())
    cur = conn.cursor()
    cur.execute("EXPLAIN SELECT department, SUM(DISTINCT cost) FROM visits GROUP BY department")
    rows = cur.fetchall()
    (row,) = [r for r in rows if r[0] == "SUM(DISTINCT cost)"]
    assert row[1] == "distinct_sum(cost)"
    assert row[3] == pytest.approx(3 * 5 * 5000.0)  # G · R · max|cost|, in the answer's units
    assert any("m0=distinct_sum(cost)" in str(r[1]) for r in rows if r[0] == "plan")


def test_noisy_release_has_an_interval_and_spends_epsilon():
    conn = dpsql.connect(policy=fixture_policy(), ledger=MemoryLedger(), cache=False)
    cur = conn.cursor()
    cur.execute("SELECT department, SUM(DISTINCT cost) FROM visits GROUP BY department")
    assert len(cur.fetchall()) == 6
    spent = conn.service.ledger.spent(conn.analyst, conn.service.policy.dataset)
    assert spent.epsilon == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("sql", "construct"),
    [
        ("SELECT AVG(DISTINCT cost) FROM visits", "AVG(DISTINCT cost)"),
        ("SELECT MAX(DISTINCT cost) FROM visits", "MAX(DISTINCT cost)"),
        (
            "SELECT AVG(DISTINCT s) FROM (SELECT patient_id, SUM(cost) AS s FROM visits "
            "GROUP BY patient_id) t",
            "AVG(DISTINCT s)",
        ),
    ],
)
def test_other_distinct_aggregates_stay_refused_free(sql, construct):
    conn = exact_connect(fixture_policy())
    with pytest.raises(ProgrammingError) as info:
        conn.cursor().execute(sql)
    assert "DISTINCT is only supported in COUNT(DISTINCT column)" in info.value.message
    assert construct in info.value.message
    assert conn.service.ledger.spent(conn.analyst, conn.service.policy.dataset) == Cost()


def test_spark_rendering_widens_inside_distinct():
    """Spark's SUM(BIGINT) wraps past 2^63, so the renderer sums DECIMAL(38, 0): inside the
    DISTINCT (``SUM(CAST(DISTINCT v ...))`` does not parse)."""
    import sqlglot

    from dpsql.lower.compile import compile_plan

    svc = dpsql.Service(fixture_policy())
    try:
        sql = "SELECT department, SUM(DISTINCT cost) FROM visits GROUP BY department"
        plan = svc.plan(parse_statement(sql, svc.policy), Settings(1.0, 1e-6, "laplace"))
        (extra,) = compile_plan(plan, 7).extras
        text = extra.render("spark")
        assert "SUM(DISTINCT CAST(" in text
        sqlglot.parse_one(text, read="spark")
    finally:
        svc.close()


def test_spark_matches_duckdb_when_bounds_do_not_bind():
    from conftest import local_spark, require_spark

    require_spark()
    policy = fixture_policy(table=WIDE)
    on_duckdb = exact_connect(policy)
    on_spark = exact_connect(policy, engine="spark", spark_session=local_spark())
    for sql in (
        "SELECT department, SUM(DISTINCT cost), SUM(DISTINCT age) FROM visits GROUP BY 1",
        "SELECT SUM(DISTINCT per_user) FROM (SELECT patient_id, SUM(cost) AS per_user "
        "FROM visits GROUP BY patient_id) v",
    ):
        assert_same_rows(rows_of(on_spark, sql), rows_of(on_duckdb, sql))
