"""Privacy boundary, round 3: join conditions are total by construction, and names are scoped.

A join ON columns of two declared types ran as a real JOIN whose implicit cast failed on
exactly the rows the WHERE let through: ``WHERE p.patient_id = 999 AND p.sex = 'f'`` answered
a yes/no question about one person with no noise, whatever was charged. The rule that closes it
is one function, :func:`dpsql.policy.comparable`, enforced where every engine join is built
(``JoinedSource``), refused with a hint by both join lowerings before anything is read, and at
connect for tables that share a privacy unit. A CTE named like a policy table is that CTE in
every construct (dpsql.frontend.scopes), as in PostgreSQL.
"""

from __future__ import annotations

import doctest
import tomllib
from pathlib import Path

import pytest
from conftest import EngineSpy, exact_connect, rows_of

import dpsql
import dpsql.frontend.scopes
from dpsql.dbapi import connect_service
from dpsql.errors import PolicyError, ProgrammingError
from dpsql.policy import ColumnPolicy, JoinedSource, JoinStep, TablePolicy, comparable
from dpsql.privacy.ledger import MemoryLedger
from dpsql.privacy.samplers import ZeroNoise

STAR = Path(__file__).resolve().parent.parent / "fixtures" / "star"


def star_policy() -> dict:
    policy = tomllib.loads((STAR / "star.toml").read_text())
    for name, spec in policy["tables"].items():
        spec["source"] = str(STAR / f"{name}.csv")
    return policy


@pytest.fixture()
def fresh():
    service = dpsql.Service(star_policy(), ledger=MemoryLedger(), noise=ZeroNoise(), cache=False)
    spy = EngineSpy(service)
    conn = connect_service(service, "mallory")
    yield service, spy, conn
    conn.close()
    service.close()


def _spent(service: dpsql.Service) -> float:
    return float(service.ledger.spent("mallory", service.policy.dataset).epsilon)


def _refused(fresh, sql: str) -> dpsql.Error:
    service, spy, conn = fresh
    with pytest.raises(dpsql.Error) as info:
        conn.cursor().execute(sql)
    assert spy.calls == 0, "a refusal must not read data"
    assert _spent(service) == 0, "a refusal must not spend budget"
    return info.value


# -- join conditions --------------------------------------------------------------------------

MISMATCHED_JOINS = [
    # (query, the two columns and types the message names)
    (
        "SELECT COUNT(*) FROM patients p JOIN departments d ON p.sex = d.id "
        "WHERE p.patient_id = 1 AND p.sex = 'f'",
        ("patients.sex (text)", "departments.id (int)"),
    ),
    (
        "SELECT COUNT(*) FROM visits v JOIN departments d ON v.dept_id = d.name",
        ("visits.dept_id (int)", "departments.name (text)"),
    ),
    (
        "SELECT COUNT(*) FROM visits v LEFT JOIN departments d ON d.name = v.dept_id "
        "WHERE v.patient_id = 1",
        ("visits.dept_id (int)", "departments.name (text)"),
    ),
    (
        "SELECT COUNT(*) FROM patients p, departments d WHERE p.sex = d.id",
        ("patients.sex (text)", "departments.id (int)"),
    ),
    (
        "SELECT d.region, COUNT(*) FROM visits v JOIN departments d ON v.dept_id = d.name "
        "GROUP BY d.region",
        ("visits.dept_id (int)", "departments.name (text)"),
    ),
]


@pytest.mark.parametrize(("sql", "named"), MISMATCHED_JOINS, ids=lambda x: str(x)[:50])
def test_a_join_of_two_types_is_refused_before_reading(fresh, sql, named):
    error = _refused(fresh, sql)
    assert error.sqlstate == "42804"
    for column in named:
        assert column in error.message
    assert "cannot be joined" in error.message
    assert error.position is not None
    assert error.hint and "same type" in error.hint


def test_joins_of_one_family_still_run(fresh):
    """int and float compare as numbers: no cast can fail, so the join runs."""
    _, spy, conn = fresh
    cur = conn.cursor()
    cur.execute("SELECT COUNT(*) FROM visits v JOIN departments d ON v.cost = d.id")
    assert cur.fetchall()[0][0] >= 0 and spy.calls == 1


def test_every_engine_join_compares_one_family():
    """The invariant itself: a join no lowering checked cannot be built (bind time, before
    any read), so a new construct that forgets the check fails loudly, not on the data."""
    a = TablePolicy("a", "", None, {"k": ColumnPolicy("k", "text")}, privacy_unit="k")
    b = TablePolicy("b", "", None, {"k": ColumnPolicy("k", "int")}, public=True)
    with pytest.raises(ProgrammingError) as info:
        JoinedSource(
            (JoinStep(a, "j0"), JoinStep(b, "j1", "INNER", (("j0", "k", "j1", "k"),))), (), ""
        )
    assert info.value.sqlstate == "42804"
    c = TablePolicy("c", "", None, {"k": ColumnPolicy("k", "float")}, public=True)
    d = TablePolicy("d", "", None, {"k": ColumnPolicy("k", "int")}, privacy_unit="k")
    JoinedSource((JoinStep(d, "j0"), JoinStep(c, "j1", "INNER", (("j0", "k", "j1", "k"),))), (), "")


@pytest.mark.parametrize(
    ("a", "b", "ok"),
    [
        ("int", "float", True),
        ("int", "int", True),
        ("text", "text", True),
        ("date", "date", True),
        ("bool", "bool", True),
        ("text", "int", False),
        ("text", "date", False),
        ("int", "bool", False),
        ("date", "float", False),
        ("text", "bool", False),
    ],
)
def test_the_one_comparison_rule(a, b, ok):
    assert comparable(a, b) is ok and comparable(b, a) is ok


def test_tables_sharing_a_privacy_unit_declare_it_with_one_type(tmp_path):
    """A source that keeps ids as text next to one that keeps them as integers: every join on
    the unit would cast, and one non-numeric id would decide whether every such query fails."""
    policy = star_policy()
    policy["tables"]["patients"]["columns"]["patient_id"]["type"] = "text"
    with pytest.raises(PolicyError) as info:
        exact_connect(policy)
    message = str(info.value)
    assert "tables.patients.columns.patient_id.type" in message or "patients" in message
    assert "'text'" in message and "'int'" in message
    assert "one type in every table" in (info.value.hint or "")


# -- scopes -----------------------------------------------------------------------------------


def test_the_scopes_doctest():
    failures, _ = doctest.testmod(dpsql.frontend.scopes)
    assert failures == 0


def test_a_cte_shadows_the_table_in_a_flat_query():
    conn = exact_connect(star_policy())
    shadowed = rows_of(
        conn,
        "WITH patients AS (SELECT * FROM patients WHERE age > 200) SELECT COUNT(*) FROM patients",
    )
    assert shadowed == [(0,)]
    inner = rows_of(
        conn,
        "SELECT COUNT(*) FROM (WITH patients AS (SELECT * FROM patients WHERE age > 200) "
        "SELECT * FROM patients) AS x",
    )
    assert inner == [(0,)]


SHADOWED = [
    # (query with a CTE named like a policy table, the same query with the CTE renamed)
    (
        "WITH patients AS (SELECT * FROM patients WHERE age > 200) SELECT COUNT(*) "
        "FROM visits v JOIN patients p ON v.patient_id = p.patient_id",
        "WITH x AS (SELECT * FROM patients WHERE age > 200) SELECT COUNT(*) "
        "FROM visits v JOIN x p ON v.patient_id = p.patient_id",
    ),
    (
        "WITH departments AS (SELECT * FROM departments WHERE id > 100) SELECT COUNT(*) "
        "FROM visits v JOIN departments d ON v.dept_id = d.id",
        "WITH x AS (SELECT * FROM departments WHERE id > 100) SELECT COUNT(*) "
        "FROM visits v JOIN x d ON v.dept_id = d.id",
    ),
    (
        "WITH departments AS (SELECT * FROM departments WHERE id > 100) SELECT COUNT(*) "
        "FROM visits v WHERE v.dept_id IN (SELECT id FROM departments)",
        "WITH x AS (SELECT * FROM departments WHERE id > 100) SELECT COUNT(*) "
        "FROM visits v WHERE v.dept_id IN (SELECT id FROM x)",
    ),
    (
        "WITH departments AS (SELECT * FROM departments WHERE id > 100) SELECT d.name, "
        "COUNT(*) FROM departments d LEFT JOIN visits v ON v.dept_id = d.id GROUP BY d.name",
        "WITH x AS (SELECT * FROM departments WHERE id > 100) SELECT d.name, "
        "COUNT(*) FROM x d LEFT JOIN visits v ON v.dept_id = d.id GROUP BY d.name",
    ),
]


@pytest.mark.parametrize(("shadowed", "renamed"), SHADOWED, ids=lambda x: x[:60])
def test_a_cte_shadows_the_table_in_every_construct(fresh, shadowed, renamed):
    """Joins, public lookups and semi joins resolve the CTE first: the query behaves as with
    the CTE renamed (refused alike, before reading) instead of silently reading the table."""
    a = _refused(fresh, shadowed)
    b = _refused(fresh, renamed)
    assert (type(a), a.sqlstate) == (type(b), b.sqlstate)
    assert "(CTE)" not in a.message  # the CTE is named as the analyst wrote it


def test_the_engine_sql_oracle_catches_a_builder_that_forgets_the_rule(monkeypatch):
    """A deliberately broken build: every join check switched off (the rule answers 'yes'),
    so a text = integer join reaches the engine. dpsql.lower.totality, which types the SQL the
    engine runs independently of the builders, reports that comparison; with the rule in
    place the same query never reaches the engine."""
    from dpsql.frontend import joins, private_joins
    from dpsql.lower.totality import mixed_comparisons
    from dpsql.policy import SQL_TYPES

    sql = "SELECT COUNT(*) FROM visits v JOIN departments d ON v.dept_id = d.name"
    service = dpsql.Service(star_policy(), ledger=MemoryLedger(), noise=ZeroNoise(), cache=False)
    schema = {
        name: {c: SQL_TYPES[spec.type] for c, spec in table.columns.items()}
        for name, table in service.policy.tables.items()
        if not table.public
    }
    spy = EngineSpy(service)
    for module in (dpsql.policy, joins, private_joins):
        monkeypatch.setattr(module, "comparable", lambda a, b: True)
    conn = connect_service(service, "mallory")
    try:
        conn.cursor().execute(sql)
    except dpsql.Error:
        pass  # the broken build may fail after reading: that is the oracle the rule closes
    finally:
        conn.close()
        service.close()
    assert spy.calls == 1
    found = mixed_comparisons(spy.sql[0], schema)
    assert found and "BIGINT against TEXT" in found[0], found
