"""Joins with public tables (fixtures/star): exactness, sensitivity, refusals, policy errors.

Exactness runs with noise off and bounds wide enough that no unit is clipped, against
hand-written DuckDB joins over the same CSVs. A public table's empty groups are released too,
so references that group by a public column are written FROM the public table.
"""

from __future__ import annotations

import copy
import tomllib

import duckdb
import pytest
from conftest import ROOT, EngineSpy, assert_same_rows, exact_connect, rows_of, write_csv

from dpsql.errors import PolicyError, PrivacyError, ProgrammingError
from dpsql.frontend.bind import parse_statement
from dpsql.policy import load_policy

STAR = ROOT / "fixtures" / "star"


def star_policy(*, rows: int = 10, groups: int = 8, drop_patient: int | None = None, tmp=None):
    """The star fixture's policy as a dict (absolute sources), with the visits bounds given;
    ``drop_patient`` writes visits without that patient (a neighbouring dataset)."""
    policy = tomllib.loads((STAR / "star.toml").read_text())
    for name, spec in policy["tables"].items():
        spec["source"] = str(STAR / f"{name}.csv")
    policy["tables"]["visits"].update(max_rows_per_unit=rows, max_groups_per_unit=groups)
    policy["privacy"].update(budget_epsilon=1e9, budget_delta=0.5)
    if drop_patient is not None:
        lines = (STAR / "visits.csv").read_text().splitlines()
        kept = [lines[0]] + [x for x in lines[1:] if x.split(",")[1] != str(drop_patient)]
        path = tmp / "visits.csv"
        path.write_text("\n".join(kept) + "\n")
        policy["tables"]["visits"]["source"] = str(path)
    return policy


@pytest.fixture(scope="module")
def star():
    conn = exact_connect(star_policy())
    ref = duckdb.connect()
    for name in ("visits", "departments", "patients"):
        ref.execute(f"CREATE TABLE {name} AS SELECT * FROM read_csv('{STAR / name}.csv')")
    yield conn, ref
    conn.close()
    ref.close()


CASES = [
    # INNER JOIN on the unique key: every department released, the empty one too
    (
        "SELECT d.name, COUNT(*) AS n FROM visits v JOIN departments d ON v.dept_id = d.id "
        "GROUP BY d.name",
        "SELECT d.name, COUNT(v.dept_id) FROM departments d LEFT JOIN visits v "
        "ON v.dept_id = d.id GROUP BY d.name",
    ),
    # the ON written the other way round, an unqualified public column
    (
        "SELECT region, COUNT(*) FROM visits JOIN departments ON departments.id = visits.dept_id "
        "GROUP BY region",
        "SELECT region, COUNT(*) FROM visits v JOIN departments d ON v.dept_id = d.id "
        "GROUP BY region",
    ),
    # LEFT JOIN: rows matching no department (NULL or 99) form the NULL group
    (
        "SELECT d.name, COUNT(*) FROM visits v LEFT JOIN departments d ON v.dept_id = d.id "
        "GROUP BY d.name",
        "SELECT d.name, COUNT(v.visit_id) FROM departments d LEFT JOIN visits v "
        "ON v.dept_id = d.id GROUP BY d.name UNION ALL SELECT NULL, COUNT(*) FROM visits "
        "WHERE dept_id IS NULL OR dept_id NOT IN (SELECT id FROM departments)",
    ),
    (
        "SELECT COUNT(*), SUM(cost) FROM visits v LEFT JOIN departments d ON v.dept_id = d.id",
        "SELECT COUNT(*), SUM(cost) FROM visits",
    ),
    # aggregates of private and public columns, a WHERE on a public column
    (
        "SELECT d.region, SUM(v.cost), AVG(d.beds), COUNT(DISTINCT v.patient_id) FROM visits v "
        "JOIN departments d ON v.dept_id = d.id GROUP BY d.region",
        "SELECT d.region, SUM(v.cost), AVG(d.beds), COUNT(DISTINCT v.patient_id) FROM visits v "
        "JOIN departments d ON v.dept_id = d.id GROUP BY d.region",
    ),
    (
        "SELECT COUNT(*) FROM visits v JOIN departments d ON v.dept_id = d.id "
        "WHERE d.region = 'north' AND v.cost > 100",
        "SELECT COUNT(*) FROM visits v JOIN departments d ON v.dept_id = d.id "
        "WHERE d.region = 'north' AND v.cost > 100",
    ),
    (
        "SELECT v.dept_id, COUNT(*) FROM visits v JOIN departments d ON v.dept_id = d.id "
        "GROUP BY v.dept_id",
        "SELECT d.id, COUNT(v.dept_id) FROM departments d LEFT JOIN visits v "
        "ON v.dept_id = d.id GROUP BY d.id",
    ),
    # semi joins
    (
        "SELECT COUNT(*) FROM visits WHERE dept_id IN (SELECT id FROM departments "
        "WHERE region = 'north')",
        "SELECT COUNT(*) FROM visits WHERE dept_id IN (SELECT id FROM departments "
        "WHERE region = 'north')",
    ),
    (
        "SELECT COUNT(*) FROM visits WHERE dept_id NOT IN (SELECT id FROM departments "
        "WHERE beds > 30)",
        "SELECT COUNT(*) FROM visits WHERE dept_id NOT IN (SELECT id FROM departments "
        "WHERE beds > 30)",
    ),
    (
        "SELECT COUNT(*) FROM visits WHERE dept_id IN (SELECT id FROM departments "
        "WHERE region = 'nowhere')",
        "SELECT 0",
    ),
    # public groups: every key of the public table, empty ones included
    (
        "SELECT d.name, COUNT(v.patient_id) AS n, SUM(v.cost) FROM departments d "
        "LEFT JOIN visits v ON v.dept_id = d.id WHERE d.region <> 'south' GROUP BY d.name",
        "SELECT d.name, COUNT(v.patient_id), COALESCE(SUM(v.cost), 0) FROM departments d "
        "LEFT JOIN visits v ON v.dept_id = d.id GROUP BY d.name HAVING d.name IN ("
        "SELECT name FROM departments)",
    ),
    (
        "SELECT d.region, COUNT(v.visit_id) FROM visits v RIGHT JOIN departments d "
        "ON v.dept_id = d.id GROUP BY d.region",
        "SELECT d.region, COUNT(v.visit_id) FROM visits v RIGHT JOIN departments d "
        "ON v.dept_id = d.id GROUP BY d.region",
    ),
    # a derived table and a CTE on the private side
    (
        "WITH x AS (SELECT dept_id AS dep, cost FROM visits WHERE cost > 500) "
        "SELECT d.name, SUM(x.cost) FROM x JOIN departments d ON x.dep = d.id "
        "WHERE d.beds >= 30 GROUP BY d.name",
        "SELECT d.name, COALESCE(SUM(v.cost), 0) FROM departments d LEFT JOIN visits v "
        "ON v.dept_id = d.id AND v.cost > 500 GROUP BY d.name",
    ),
]


@pytest.mark.parametrize("sql,reference", CASES, ids=[c[0][:80] for c in CASES])
def test_answers_equal_the_reference_with_noise_off(star, sql, reference):
    conn, ref = star
    got = rows_of(conn, sql)
    expected = ref.execute(reference).fetchall()
    # A WHERE on public columns leaves those groups without rows, but every key of the public
    # table is still released (its domain is public): as 0.
    for condition in ("region = 'south'", "beds < 30"):
        if condition.replace("= ", "<> ").replace("< ", ">= ") in sql:
            empty = {
                r[0]
                for r in ref.execute(f"SELECT name FROM departments WHERE {condition}").fetchall()
            }
            expected = [(r[0], *([0] * (len(r) - 1))) if r[0] in empty else r for r in expected]
    assert_same_rows(got, expected)


def test_group_by_a_public_column_is_not_thresholded(star):
    conn, _ = star
    cur = conn.cursor()
    cur.execute(
        "EXPLAIN SELECT d.name, COUNT(*) FROM visits v JOIN departments d ON v.dept_id = d.id "
        "GROUP BY d.name"
    )
    text = "\n".join(str(r[1]) for r in cur.fetchall())
    assert "public: 7 bins" in text and "tau" not in text
    assert "PublicJoin" in text and "unique key" in text


def test_output_names_are_the_public_columns(star):
    conn, _ = star
    cur = conn.cursor()
    cur.execute(
        "SELECT d.name, COUNT(*) FROM visits v JOIN departments d ON v.dept_id = d.id "
        "GROUP BY d.name"
    )
    assert [c[0] for c in cur.description] == ["name", "count"]


def test_the_public_table_is_never_charged(star):
    """A join costs what the same measurements cost without it; the semi join's subquery and
    the lookups read no private data and run no engine query of their own."""
    conn, _ = star
    service = conn.service
    settings = conn._settings
    plain = service.plan(parse_statement("SELECT COUNT(*) FROM visits", service.policy), settings)
    joined = service.plan(
        parse_statement(
            "SELECT d.name, COUNT(*) FROM visits v JOIN departments d ON v.dept_id = d.id "
            "WHERE dept_id IN (SELECT id FROM departments WHERE region = 'north') "
            "GROUP BY d.name",
            service.policy,
        ),
        settings,
    )
    assert joined.cost == plain.cost
    spy = EngineSpy(service)
    before = service.ledger.spent(conn.analyst, service.policy.dataset)
    rows_of(
        conn,
        "SELECT d.name, COUNT(*) FROM visits v JOIN departments d ON v.dept_id = d.id "
        "WHERE dept_id IN (SELECT id FROM departments WHERE region = 'north') GROUP BY d.name",
    )
    after = service.ledger.spent(conn.analyst, service.policy.dataset)
    assert spy.calls == 1
    assert after.epsilon - before.epsilon == pytest.approx(plain.cost.epsilon)
    service.engine.execute = spy.original


SENSITIVITY = [
    "SELECT d.name, COUNT(*) FROM visits v JOIN departments d ON v.dept_id = d.id GROUP BY d.name",
    "SELECT d.name, SUM(cost) FROM visits v LEFT JOIN departments d ON v.dept_id = d.id "
    "GROUP BY d.name",
    "SELECT d.region, SUM(d.beds) FROM visits v JOIN departments d ON v.dept_id = d.id "
    "GROUP BY d.region",
    "SELECT d.name, COUNT(v.patient_id) FROM departments d LEFT JOIN visits v "
    "ON v.dept_id = d.id GROUP BY d.name",
    "SELECT COUNT(*) FROM visits WHERE dept_id IN (SELECT id FROM departments "
    "WHERE region = 'north')",
]


@pytest.mark.parametrize("sql", SENSITIVITY, ids=[s[:70] for s in SENSITIVITY])
def test_neighbouring_datasets_change_within_the_declared_sensitivity(tmp_path, monkeypatch, sql):
    """Remove patient 50 (9 visits, beyond R): the exact bounded answers move by at most the
    L1 sensitivity the plan declares, as for the same query without a join. One keyed-hash
    secret for both runs, so the other units keep the same rows."""
    a = exact_connect(star_policy(rows=3, groups=2))
    b = exact_connect(star_policy(rows=3, groups=2, drop_patient=50, tmp=tmp_path))
    assert_moves_within_sensitivity(a, b, sql, monkeypatch)


def assert_moves_within_sensitivity(a, b, sql: str, monkeypatch) -> None:
    """On the connections ``a`` (D) and ``b`` (D′, one unit removed), with one keyed-hash secret
    for both runs: the exact answers move (in total) by more than 0 and at most the largest L1
    sensitivity the plan declares."""
    import dpsql.pipeline

    monkeypatch.setattr(dpsql.pipeline.secrets, "randbits", lambda bits: 12345)
    plan = a.service.plan(parse_statement(sql, a.service.policy), a._settings)
    bound = max(m.l1 * m.granularity for m in plan.measures)
    got_a = {r[:-1]: float(r[-1] or 0) for r in rows_of(a, sql)}
    got_b = {r[:-1]: float(r[-1] or 0) for r in rows_of(b, sql)}
    change = sum(abs(got_a.get(k, 0) - got_b.get(k, 0)) for k in set(got_a) | set(got_b))
    assert 0 < change <= bound + 1e-6, (change, bound)


REFUSED = [
    (
        "SELECT COUNT(*) FROM visits v JOIN departments d ON v.dept_id = d.beds",
        "not a declared unique key",
    ),
    (
        "SELECT COUNT(*) FROM visits v JOIN patients p ON v.dept_id = p.age",
        "not on the privacy unit",
    ),
    ("SELECT COUNT(*) FROM visits a JOIN visits b ON a.visit_id = b.visit_id", "self-join"),
    ("SELECT COUNT(*) FROM visits v CROSS JOIN departments d", "cross join"),
    ("SELECT COUNT(*) FROM visits v, departments d WHERE v.cost > d.beds", "cross join"),
    ("SELECT COUNT(*) FROM visits v FULL JOIN departments d ON v.dept_id = d.id", "FULL"),
    ("SELECT COUNT(*) FROM visits v JOIN departments d ON v.dept_id > d.id", "ON private"),
    (
        "SELECT COUNT(*) FROM visits v JOIN departments d ON v.dept_id = d.id AND d.beds > 3",
        "ON private",
    ),
    # USING (k) is ON v.k = d.k: visits has no id
    ("SELECT COUNT(*) FROM visits v JOIN departments d USING (id)", "unknown column 'id'"),
    (
        "SELECT d.name, COUNT(*) FROM departments d LEFT JOIN visits v ON v.dept_id = d.id "
        "GROUP BY d.name",
        "COUNT\\(\\*\\) would count",
    ),
    (
        "SELECT d.name, SUM(d.beds) FROM departments d LEFT JOIN visits v ON v.dept_id = d.id "
        "GROUP BY d.name",
        "read the private table only",
    ),
    (
        "SELECT COUNT(*) FROM visits WHERE dept_id IN (SELECT id FROM departments LIMIT 1)",
        "LIMIT",
    ),
    ("SELECT COUNT(*) FROM visits v JOIN departments d ON v.dept_id = d.nope", "unknown column"),
    ("SELECT COUNT(*) FROM visits v JOIN nowhere d ON v.dept_id = d.id", "unknown table"),
    (
        "SELECT d.nope, COUNT(*) FROM visits v JOIN departments d ON v.dept_id = d.id GROUP BY 1",
        "unknown column",
    ),
]


@pytest.mark.parametrize("sql,message", REFUSED, ids=[r[0][:70] for r in REFUSED])
def test_refusals_are_free(star, sql, message):
    conn, _ = star
    spy = EngineSpy(conn.service)
    spent = conn.service.ledger.spent(conn.analyst, conn.service.policy.dataset)
    try:
        with pytest.raises((PrivacyError, ProgrammingError), match=message) as info:
            rows_of(conn, sql)
        assert info.value.sqlstate and info.value.hint
        assert "sqlglot" not in str(info.value) and "<class" not in str(info.value)
        assert spy.calls == 0
        assert conn.service.ledger.spent(conn.analyst, conn.service.policy.dataset) == spent
    finally:
        conn.service.engine.execute = spy.original


# -- policy ----------------------------------------------------------------------------------


def _edited(edit) -> dict:
    policy = star_policy()
    edit(policy["tables"])
    return policy


@pytest.mark.parametrize(
    "edit,key,fix",
    [
        (
            lambda t: t["departments"].update(privacy_unit="id"),
            "tables.departments.public",
            "remove privacy_unit",
        ),
        (
            lambda t: t["departments"].update(primary_key="nope"),
            "tables.departments.primary_key",
            "declare it",
        ),
        (
            lambda t: t["departments"].update(unique=["region"]),
            "tables.departments.unique",
            "remove the duplicates",
        ),
        (
            lambda t: t["departments"].update(primary_key=["id"]),
            "tables.departments.primary_key",
            'primary_key = "id"',
        ),
        (lambda t: t["departments"].update(public="yes"), "tables.departments.public", "true"),
    ],
)
def test_bad_declarations_fail_at_connect(edit, key, fix):
    with pytest.raises(PolicyError) as info:
        load_policy(_edited(edit))
    assert key in str(info.value) and fix in (info.value.hint or "")


def test_a_public_primary_key_with_nulls_names_the_file(tmp_path):
    path = write_csv(tmp_path / "d.csv", ["id", "name"], [(1, "a"), (None, "b")])
    policy = copy.deepcopy(star_policy())
    policy["tables"]["departments"].update(source=str(path))
    policy["tables"]["departments"]["columns"] = {"id": {"type": "int"}, "name": {"type": "text"}}
    policy["tables"]["departments"]["unique"] = []
    with pytest.raises(PolicyError, match="NULL values in") as info:
        load_policy(policy)
    assert str(path) in str(info.value)


def test_the_star_fixture_loads():
    policy = load_policy(STAR / "star.toml")
    departments = policy.table("departments")
    assert departments.public and departments.unique_keys == ("id", "name")
    assert len(departments.rows) == 7
    assert not policy.table("visits").public


def test_a_query_over_the_public_table_alone_is_exact_and_free(star):
    conn, ref = star
    spy = EngineSpy(conn.service)
    spent = conn.service.ledger.spent(conn.analyst, conn.service.policy.dataset)
    try:
        cur = conn.cursor()
        sql = (
            "SELECT region, COUNT(*) AS n, SUM(beds) FROM departments GROUP BY region "
            "ORDER BY n DESC, region"
        )
        cur.execute(sql)
        assert [c[0] for c in cur.description] == ["region", "n", "sum"]
        assert cur.fetchall() == ref.execute(sql).fetchall()
        assert rows_of(conn, "SELECT * FROM departments WHERE id = 99") == []
        assert rows_of(conn, "SELECT COUNT(*) FROM (SELECT * FROM departments) x") == [(7,)]
        with pytest.raises(PrivacyError, match="file reader"):
            rows_of(conn, "SELECT read_csv('x') FROM departments")
        assert spy.calls == 0
        assert conn.service.ledger.spent(conn.analyst, conn.service.policy.dataset) == spent
    finally:
        conn.service.engine.execute = spy.original
