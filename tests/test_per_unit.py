"""Per-unit relations (issue 27 item 3, dpsql.frontend.per_unit): a derived table or CTE grouped
by the privacy unit is a table of one row per unit (per key), aggregated again by the outer DP
query with unit-level stability 1.

- the dashboard shapes answer on the shipped fixture (Tableau's FIXED LOD binned, a cohort by
  first month, ZetaSQL's per-user AVG, COUNT(DISTINCT) over per-unit values, a per-unit count
  per extra key), close to the exact answer at a large ε;
- EXPLAIN shows the per-unit relation and its stability; the bins of a per-unit value have a
  public domain from its derived range (R × the column bounds);
- what stays refused is refused before anything is read or spent, with its construct;
- neighbouring datasets (tests/test_privacy_audit.py's D and D' = D + one worst-case unit):
  the worst-case unit moves a per-unit count by exactly 1 and a SUM of per-unit sums by at
  most its per-unit range, and the released SUM passes the loss audit.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import duckdb
import pytest
from sqlglot import exp
from test_frontend_audit import first_value, pair, run_queries, sum_audit
from test_privacy_audit import EXTRA, RUNS, R, exact_values, rows_d, write_csv

import dpsql
from dpsql.errors import PrivacyError, ProgrammingError
from dpsql.privacy.accounting import Cost

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"

LOD = (
    "SELECT FLOOR(per_patient/100)*100 AS bin, COUNT(*) AS n FROM (SELECT patient_id, "
    "SUM(cost) AS per_patient FROM visits GROUP BY patient_id) t GROUP BY 1 ORDER BY 1"
)
COHORT = (
    "WITH first AS (SELECT patient_id, MIN(DATE_TRUNC('month', visit_date)) AS m FROM visits "
    "GROUP BY patient_id) SELECT m, COUNT(*) AS n FROM first GROUP BY m ORDER BY m"
)
PER_USER = (
    "SELECT AVG(per_user) AS a FROM (SELECT patient_id, SUM(cost) AS per_user FROM visits "
    "GROUP BY patient_id)"
)
PER_KEY = (
    "SELECT department, AVG(n) AS a, COUNT(*) AS c FROM (SELECT patient_id, department, "
    "COUNT(*) n FROM visits GROUP BY patient_id, department) GROUP BY department ORDER BY 1"
)
DISTINCT = (
    "SELECT COUNT(DISTINCT top) AS d FROM (SELECT patient_id, "
    "LEAST(GREATEST(MAX(age), 0), 100) AS top FROM visits GROUP BY patient_id) t"
)
HAVING = (
    "SELECT COUNT(*) AS n FROM (SELECT patient_id, COUNT(*) AS visits FROM visits "
    "WHERE smoker GROUP BY patient_id HAVING COUNT(*) >= 2) t"
)


@pytest.fixture(scope="module")
def conn(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("per-unit")
    shutil.copy(FIXTURES / "visits.csv", tmp / "visits.csv")
    policy = (FIXTURES / "visits.toml").read_text().replace("epsilon = 1.0 ", "epsilon = 50.0 ")
    policy = policy.replace("budget_epsilon = 10.0", "budget_epsilon = 100000.0")
    (tmp / "visits.toml").write_text(policy)
    con = dpsql.connect(policy=str(tmp / "visits.toml"), ledger=str(tmp / "ledger.db"))
    yield con
    con.close()


def truth(sql: str) -> list[tuple]:
    csv = str(FIXTURES / "visits.csv")
    return (
        duckdb.connect().sql(sql.replace("FROM visits", f"FROM read_csv_auto('{csv}')")).fetchall()
    )


def test_cohort_by_first_month_is_public_and_close(conn) -> None:
    rows = conn.cursor().execute(COHORT).fetchall()
    assert len(rows) == 24  # every month of the declared range, empty ones too
    exact = dict(truth(COHORT.replace("ORDER BY m", "")))
    for month, n in rows:
        assert abs(n - exact.get(month, 0)) <= 25  # MIN over every row of a unit: no row bound


def test_fixed_lod_bins_have_a_public_domain_from_the_derived_range(conn) -> None:
    """per_patient = SUM(cost) over <= R = 5 rows of [0, 5000]: [0, 25000], so the bins are
    the 251 multiples of 100 in it (public, from the policy alone), not thresholded."""
    rows = conn.cursor().execute(LOD).fetchall()
    # and NULL: cost is nullable, so a patient whose costs are all NULL has a NULL sum
    assert [b for b, _ in rows] == [float(100 * i) for i in range(251)] + [None]
    plan = conn.cursor().execute("EXPLAIN (FORMAT TEXT) " + LOD).fetchall()
    text = "\n".join(r[0] for r in plan)
    assert "PerUnit visits GROUP BY patient_id: per_patient=sum" in text
    assert "a unit changes <= 1 row (its own)" in text
    assert "public: 251 bins" in text or "public: 252 bins" in text


def test_per_user_avg_is_close(conn) -> None:
    ((a,),) = conn.cursor().execute(PER_USER).fetchall()
    # bounded: each patient's SUM over at most R = 5 of its visits
    assert 800 < a < 2000


def test_per_unit_with_an_extra_key(conn) -> None:
    rows = conn.cursor().execute(PER_KEY).fetchall()
    exact = {d: (a, c) for d, a, c in truth(PER_KEY)}
    assert [r[0] for r in rows] == sorted(exact)
    for dept, a, c in rows:
        assert 1 <= a <= 5
        assert abs(c - exact[dept][1]) <= 0.1 * exact[dept][1]  # G = 3 departments per unit
    text = "\n".join(
        r[0] for r in conn.cursor().execute("EXPLAIN (FORMAT TEXT) " + PER_KEY).fetchall()
    )
    assert "a unit changes <= 3 rows (one per kept key)" in text
    # the outer query groups by the key: one row per (unit, department), G departments
    assert "<= 1 rows per group, <= 3 groups" in text


def test_count_distinct_over_per_unit_values_and_having(conn) -> None:
    ((d,),) = conn.cursor().execute(DISTINCT).fetchall()
    assert 50 <= d <= 120
    ((n,),) = conn.cursor().execute(HAVING).fetchall()
    ((exact,),) = truth(HAVING)
    assert abs(n - exact) <= 30


def test_a_chain_over_a_per_unit_relation_and_a_window_over_its_dp_query(conn) -> None:
    """A row-level CTE over V is inlined; a DP query over V is post-processed like any other
    (a running total of the cohort)."""
    chain = (
        "WITH first AS (SELECT patient_id, MIN(DATE_TRUNC('month', visit_date)) AS m FROM visits "
        "GROUP BY patient_id), early AS (SELECT m FROM first WHERE m < DATE '2025-01-01') "
        "SELECT m, COUNT(*) AS n FROM early GROUP BY m ORDER BY m"
    )
    rows = conn.cursor().execute(chain).fetchall()
    assert len(rows) == 12  # the months of 2024 only: the WHERE restricts the public domain
    running = (
        "SELECT m, n, SUM(n) OVER (ORDER BY m) AS total FROM (SELECT m, COUNT(*) AS n FROM "
        "(SELECT patient_id, MIN(DATE_TRUNC('month', visit_date)) AS m FROM visits "
        "GROUP BY patient_id) f GROUP BY m) c ORDER BY m"
    )
    rows = conn.cursor().execute(running).fetchall()
    assert len(rows) == 24
    assert rows[-1][2] == pytest.approx(sum(r[1] for r in rows))


def test_sum_distinct_per_unit(conn) -> None:
    """SUM(DISTINCT x) per unit: the distinct values among a unit's R kept rows, in SUM's
    range; the outer query reads it like any per-unit SUM."""
    sql = (
        "SELECT AVG(s) AS a, COUNT(*) AS n FROM (SELECT patient_id, SUM(DISTINCT cost) AS s "
        "FROM visits GROUP BY patient_id HAVING SUM(DISTINCT cost) > 0) t"
    )
    ((a, n),) = conn.cursor().execute(sql).fetchall()
    assert 800 < a < 2000 and 4000 < n < 5000
    text = "\n".join(r[0] for r in conn.cursor().execute("EXPLAIN (FORMAT TEXT) " + sql))
    assert "s=sum_distinct(" in text


def test_the_spec_holds_trees_and_the_relation_reads_copies(conn) -> None:
    """V's inner WHERE and aggregated values are trees in its spec (issue 26 item 2: no text
    rendered to be parsed back); building V leaves them as they were, so V is the same each
    time, and the spec's identity shows them rendered."""
    from dpsql.frontend.bind import parse_statement
    from dpsql.frontend.private_joins import PerUnitSource
    from dpsql.lower.compile import render
    from dpsql.lower.sources import per_unit
    from dpsql.plan.tree import read_node

    sql = (
        "SELECT AVG(s) FROM (SELECT patient_id, SUM(cost) AS s FROM visits "
        "WHERE age > 30 AND department IN ('oncology', 'neurology') GROUP BY patient_id) t"
    )
    table = parse_statement(sql, conn.service.policy).table
    joined = table.joined
    assert isinstance(joined, PerUnitSource) and joined.spec is not None
    spec = joined.spec
    assert isinstance(spec.where, exp.Expression)
    assert [type(c.value) for c in spec.columns] == [exp.Column]
    before = (repr(spec.where), [repr(c.value) for c in spec.columns])
    first, second = (render(per_unit(read_node(table)), "duckdb") for _ in range(2))
    assert first == second
    assert (repr(spec.where), [repr(c.value) for c in spec.columns]) == before
    assert "age > 30 AND department IN ('oncology', 'neurology')" in spec.identity
    assert "WHERE age > 30 AND department IN ('oncology', 'neurology') GROUP BY" in (
        spec.describe()
    )


def test_per_unit_sql_is_engine_neutral_and_bounded(conn) -> None:
    """The engine SQL reads V from the validated spec (no analyst text), rows bounded first."""
    from dpsql.frontend.bind import parse_statement
    from dpsql.frontend.private_joins import PerUnitSource
    from dpsql.lower.compile import render
    from dpsql.lower.sources import per_unit
    from dpsql.plan.tree import read_node

    statement = parse_statement(PER_KEY, conn.service.policy)
    table = statement.table
    assert isinstance(table.joined, PerUnitSource)
    v = per_unit(read_node(table))
    for dialect in ("duckdb", "spark"):
        sql = render(v, dialect)
        assert "ROW_NUMBER() OVER (PARTITION BY" in sql
        assert "DENSE_RANK() OVER (PARTITION BY" in sql
        assert "<= 5" in sql and "<= 3" in sql


REFUSED = [
    (
        "SELECT AVG(s) FROM (SELECT patient_id, SUM(cost) AS s FROM visits "
        "GROUP BY patient_id, age + 1) t",
        "groups by the privacy unit and plain columns",
        "age + 1",
    ),
    (
        "SELECT AVG(s) FROM (SELECT patient_id, SUM(cost) * 2 AS s FROM visits "
        "GROUP BY patient_id) t",
        "must be an aggregate",
        "SUM(cost) * 2",
    ),
    (
        "SELECT AVG(s) FROM (SELECT patient_id, MEDIAN(cost) AS s FROM visits "
        "GROUP BY patient_id) t",
        "is not supported in a per-unit relation",
        "MEDIAN(cost)",
    ),
    (
        "SELECT AVG(s) FROM (SELECT patient_id, SUM(cost) AS s FROM visits "
        "GROUP BY patient_id LIMIT 10) t",
        "LIMIT inside a per-unit relation",
        "LIMIT 10",
    ),
    (
        "SELECT COUNT(*) FROM (SELECT patient_id, COUNT(*) AS n FROM (SELECT patient_id, "
        "SUM(cost) AS s FROM visits GROUP BY patient_id) a GROUP BY patient_id) b",
        None,  # refused by the binder or here (a chain over a per-unit relation)
        None,
    ),
    (
        "SELECT AVG(s) FROM (SELECT patient_id, SUM(age) AS s FROM visits "
        "GROUP BY patient_id HAVING MAX(diagnosis) > 3) t",
        None,  # typed like a flat WHERE diagnosis > 3 (42804)
        None,
    ),
    (
        "SELECT AVG(s) FROM (SELECT patient_id, SUM(cost) AS s FROM visits "
        "GROUP BY patient_id WITH ROLLUP) t",
        "ROLLUP/CUBE/GROUPING SETS are not supported",
        None,
    ),
    (
        "SELECT AVG(s) FROM (SELECT patient_id, SUM(cost) AS s FROM visits "
        "GROUP BY patient_id, ROLLUP(department)) t",
        "groups by the privacy unit and plain columns",
        None,
    ),
    (
        "SELECT AVG(DISTINCT s) FROM (SELECT patient_id, SUM(cost) AS s FROM visits "
        "GROUP BY patient_id) t",
        "DISTINCT is only supported in COUNT(DISTINCT column)",
        None,
    ),
    (
        "SELECT patient_id, COUNT(*) FROM (SELECT patient_id, SUM(cost) AS s FROM visits "
        "GROUP BY patient_id) t GROUP BY patient_id",
        "GROUP BY the privacy unit",
        None,
    ),
]


@pytest.mark.parametrize(("sql", "message", "construct"), REFUSED, ids=range(len(REFUSED)))
def test_refusals_read_nothing_and_spend_nothing(conn, sql, message, construct) -> None:
    engine = conn.service.engine
    calls: list[object] = []
    original = engine.execute

    def execute(compiled, handle=None):
        calls.append(compiled)
        return original(compiled, handle)

    engine.execute = execute
    spent = conn.service.ledger.spent(conn.analyst, conn.service.policy.dataset)
    try:
        with pytest.raises(ProgrammingError) as info:
            conn.cursor().execute(sql)
    finally:
        engine.execute = original
    err = info.value
    if message is not None:
        assert isinstance(err, PrivacyError)
        assert message in err.message, err.message
    if construct is not None:
        assert err.construct == construct
    assert err.hint
    assert "_Builder" not in err.message and "Traceback" not in err.message
    assert calls == []
    assert conn.service.ledger.spent(conn.analyst, conn.service.policy.dataset) == spent
    assert spent is None or isinstance(spent, Cost)


def test_an_auto_bound_is_read_at_its_cap_inside_a_per_unit_relation(tmp_path: Path) -> None:
    """max_rows_per_unit = "auto": V bounds each unit at the cap (64, the largest the choice
    may return), a valid bound; V itself is never given a chosen bound (1 row per unit)."""
    shutil.copy(FIXTURES / "visits.csv", tmp_path / "visits.csv")
    text = (FIXTURES / "visits.toml").read_text()
    text = text.replace("max_rows_per_unit = 5 ", 'max_rows_per_unit = "auto" ')
    (tmp_path / "visits.toml").write_text(text)
    con = dpsql.connect(policy=str(tmp_path / "visits.toml"), ledger=str(tmp_path / "l.db"))
    explain = "EXPLAIN (FORMAT TEXT) " + PER_USER
    lines = [r[0] for r in con.cursor().execute(explain).fetchall()]
    assert any("PerUnit visits GROUP BY patient_id" in x and "(R = 64, G = 3)" in x for x in lines)
    assert any("Bound per patient_id: <= 1 rows per group, <= 1 groups" in x for x in lines)
    ((a,),) = con.cursor().execute(PER_USER).fetchall()
    assert a is not None
    con.close()


STAR = FIXTURES / "star" / "star.toml"


def test_joins_inside_a_per_unit_relation(tmp_path: Path) -> None:
    """A join on the unit or with a public table on its key is lowered to one private
    relation first and bounded after the join (R = 3, G = 2 of visits); a unit_path table
    (its unit is not among its own columns) stays refused, free."""
    con = dpsql.connect(policy=str(STAR), ledger=str(tmp_path / "ledger.db"))
    cur = con.cursor()
    cur.execute("SET epsilon = 3")
    private = (
        "SELECT COUNT(*) AS n FROM (SELECT v.patient_id, SUM(v.cost) AS s FROM visits v "
        "JOIN patients p ON v.patient_id = p.patient_id WHERE p.age > 40 GROUP BY v.patient_id) t"
    )
    ((n,),) = cur.execute(private).fetchall()
    assert abs(n - 178) <= 15  # 178 patients over 40 with a visit (exact)
    text = "\n".join(r[0] for r in cur.execute("EXPLAIN (FORMAT TEXT) " + private))
    assert "PerUnit visits INNER JOIN patients WHERE age > 40 GROUP BY patient_id" in text
    public = (
        "SELECT region, COUNT(*) AS n FROM (SELECT v.patient_id, d.region, COUNT(*) AS c "
        "FROM visits v JOIN departments d ON v.dept_id = d.id GROUP BY v.patient_id, d.region) t "
        "GROUP BY region ORDER BY region"
    )
    rows = cur.execute(public).fetchall()
    assert [r[0] for r in rows] == ["east", "north", "south"]
    # the cache key holds the join's own definition, not only its name
    from dpsql.frontend.bind import parse_statement

    statement = parse_statement(private, con.service.policy)
    base = statement.table.joined.steps[0].table
    assert base.joined is not None and base.joined.identity in statement.table.joined.identity
    spent = con.service.ledger.spent(con.analyst, con.service.policy.dataset)
    with pytest.raises(PrivacyError) as info:
        cur.execute(
            "SELECT AVG(n) FROM (SELECT patient_id, COUNT(*) AS n FROM prescriptions "
            "GROUP BY patient_id) t"
        )
    assert "over a unit_path table is not supported" in info.value.message
    assert info.value.position is not None
    assert con.service.ledger.spent(con.analyst, con.service.policy.dataset) == spent
    con.close()


# --- neighbouring datasets -----------------------------------------------------------------

PER_UNIT_QUERIES = {
    "units": "SELECT COUNT(*) AS n FROM (SELECT pid, SUM(amount) AS s FROM t GROUP BY pid) u",
    "sum-of-sums": (
        "SELECT SUM(s) AS total FROM (SELECT pid, SUM(amount) AS s FROM t GROUP BY pid) u"
    ),
}
SEEDS = {"D": 61, "D′": 62}


@pytest.fixture(scope="module")
def neighbours(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("per-unit-audit")
    sources = {
        "D": write_csv(tmp / "d.csv", rows_d()),
        "D′": write_csv(tmp / "d2.csv", rows_d() + EXTRA),
    }
    return {
        name: run_queries(path, SEEDS[name], PER_UNIT_QUERIES, runs=2)
        for name, path in sources.items()
    }


def test_the_worst_case_unit_moves_a_per_unit_count_by_one(neighbours) -> None:
    d, d2 = pair(neighbours, "units")
    assert d.plan.max_rows == 1 and d.plan.max_groups == 1
    moved = first_value(exact_values(d2.plan, d2.result)) - first_value(
        exact_values(d.plan, d.result)
    )
    assert moved == 1


def test_the_worst_case_unit_moves_a_sum_of_sums_by_its_per_unit_range(neighbours) -> None:
    """The extra unit has R + 1 rows far above the bound in each of two depts: its per-unit
    sum is computed after bounding (R rows of its pair, clamped to 50): at most R · 50."""
    d, d2 = pair(neighbours, "sum-of-sums")
    moved = first_value(exact_values(d2.plan, d2.result)) - first_value(
        exact_values(d.plan, d.result)
    )
    assert 0 < moved <= R * 50.0 + 1e-9
    assert d.plan.query.table.columns["s"].upper == R * 50.0


def test_the_per_unit_relation_bounds_rows_before_aggregating(tmp_path: Path) -> None:
    """V itself, run in DuckDB on D′: the worst-case unit (2(R + 1) rows, each far above the
    bound, in two departments) has one row whose COUNT(*) is R, SUM R · 50 (its R kept rows,
    each clamped), MAX 50 over every row; with the department as an extra key, G rows of R
    rows each. Without bounding before aggregating these would be 2(R + 1) and (R + 1) · 50."""
    from test_privacy_audit import G, policy

    from dpsql.frontend.bind import parse_statement
    from dpsql.lower.compile import render
    from dpsql.lower.hashing import is_secret
    from dpsql.lower.sources import per_unit
    from dpsql.plan.tree import read_node
    from dpsql.policy import load_policy

    source = write_csv(tmp_path / "d2.csv", rows_d() + EXTRA)
    loaded = load_policy(policy(source, "laplace"))
    con = duckdb.connect()
    con.execute(f"CREATE VIEW t AS SELECT * FROM read_csv_auto('{source}')")

    def v_rows(sql: str) -> list[tuple]:
        table = parse_statement(sql, loaded).table
        tree = per_unit(read_node(table)).transform(
            lambda n: exp.Literal.number(12345) if is_secret(n) else n
        )
        return con.execute(render(tree, "duckdb") + " ORDER BY ALL").fetchall()

    one = v_rows(
        "SELECT COUNT(*) FROM (SELECT pid, COUNT(*) AS n, SUM(amount) AS s, MAX(amount) AS m "
        "FROM t GROUP BY pid) u"
    )
    assert [r for r in one if r[0] == 999] == [(999, R, R * 50.0, 50.0)]
    assert all(r[1] <= R for r in one)
    keyed = v_rows(
        "SELECT COUNT(*) FROM (SELECT pid, dept, COUNT(*) AS n FROM t GROUP BY pid, dept) u"
    )
    assert [r for r in keyed if r[0] == 999] == [(999, "c", R), (999, "d", R)][:G]


@pytest.mark.slow
def test_sum_of_per_unit_sums_audit_finds_no_violation(neighbours) -> None:
    d, d2 = pair(neighbours, "sum-of-sums")
    report, _ = sum_audit(d, d2, 700, RUNS, lambda s: s)
    print(f"\n[audit] per-unit sum: {report}")
    assert not report.violated, str(report)
