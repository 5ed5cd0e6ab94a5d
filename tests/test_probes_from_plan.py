"""Column probes of any accepted relation, answered from its plan (issue 27, item 5).

Superset saves a virtual dataset by running its SQL with ``LIMIT 1`` and reading
``cursor.description`` only (tests/bi_shapes/superset.toml, virtual_dataset_column_probe), and
syncs columns with ``SELECT * FROM (<sql>) AS virtual_table LIMIT 0``. Over private rows each
such probe answers zero rows (LIMIT 1 too: a row would be data) with the relation's column
names and types from the text and the schema, reads nothing from the engine and spends
nothing, through the DB-API and through ``dpsql serve``. A probe of a relation that would be
refused as a query is refused with the relation's own reason.
"""

from __future__ import annotations

import pytest
from conftest import EngineSpy, fixture_policy
from test_private_joins import star_policy

import dpsql
from dpsql.dbapi import connect_service
from dpsql.errors import PrivacyError
from dpsql.privacy.ledger import MemoryLedger

PASSWORD = "probe pass"


def wrapped(sql: str, limit: int = 1) -> str:
    """What Superset sends for a virtual dataset (sqlglot-pretty-printed, as captured)."""
    return f"SELECT\n  *\nFROM (\n  {sql}\n) AS virtual_table\nLIMIT {limit}"


# (dataset SQL, expected (name, DB-API type) columns)
STAR_CASES = [
    (
        "column list",
        "SELECT visit_id, dept_id AS department, cost FROM visits",
        [("visit_id", "BIGINT"), ("department", "BIGINT"), ("cost", "DOUBLE")],
    ),
    (
        "private join",
        "SELECT v.cost, p.sex, p.age AS patient_age FROM visits v "
        "JOIN patients p ON v.patient_id = p.patient_id",
        [("cost", "DOUBLE"), ("sex", "VARCHAR"), ("patient_age", "BIGINT")],
    ),
    (
        "public join",
        "SELECT v.cost, d.name AS dept, d.beds FROM visits v "
        "JOIN departments d ON v.dept_id = d.id WHERE d.region <> 'south'",
        [("cost", "DOUBLE"), ("dept", "VARCHAR"), ("beds", "BIGINT")],
    ),
    (
        "expressions",
        "SELECT cost * 2 AS double_cost, cost > 100 AS pricey, "
        "CAST(visit_id AS VARCHAR) AS vid FROM visits WHERE cost IS NOT NULL",
        [("double_cost", "DOUBLE"), ("pricey", "BOOLEAN"), ("vid", "VARCHAR")],
    ),
    (
        "CTE",
        "WITH v AS (SELECT patient_id, cost FROM visits WHERE cost > 10) "
        "SELECT cost, cost / 100 AS hundreds FROM v",
        [("cost", "DOUBLE"), ("hundreds", "DOUBLE")],
    ),
]

REFUSED = [
    (
        "SELECT a.cost FROM visits a JOIN visits b ON a.visit_id = b.visit_id",
        "self-join",
    ),
    ("SELECT cost, ROW_NUMBER() OVER () AS r FROM visits", "window functions"),
    ("SELECT cost FROM visits ORDER BY cost LIMIT 5", "LIMIT inside a derived table"),
    ("SELECT md5(CAST(cost AS VARCHAR)) AS h FROM visits", "md5"),
]


@pytest.fixture(scope="module")
def service():
    service = dpsql.Service(star_policy(), ledger=MemoryLedger(), cache=False)
    yield service
    service.close()


@pytest.fixture()
def spy(service):
    spy = EngineSpy(service)
    yield spy
    service.engine.execute = spy.original  # type: ignore[method-assign]


@pytest.fixture(scope="module")
def conn(service):
    conn = connect_service(service, "analyst")
    yield conn
    conn.close()


def _probes(sql: str) -> list[str]:
    """The shapes one dataset is probed with: its SQL with LIMIT 1 (Superset saving it), and
    wrapped as virtual_table with LIMIT 1 and LIMIT 0."""
    return [f"{sql}\nLIMIT 1", wrapped(sql, 1), wrapped(sql, 0)]


@pytest.mark.parametrize(("name", "sql", "columns"), STAR_CASES, ids=[c[0] for c in STAR_CASES])
def test_a_probe_answers_columns_from_the_plan_free(name, sql, columns, conn, service, spy):
    for probe in _probes(sql):
        before = len(service.ledger.log)
        cur = conn.cursor()
        cur.execute(probe)
        assert [d[:2] for d in cur.description] == columns, probe
        assert cur.fetchall() == [], "a probe never returns a row"
        assert cur.cost is None
        assert conn.describe(probe) == cur.description
        assert spy.calls == 0, "nothing read from the engine"
        assert len(service.ledger.log) == before, "nothing spent"


@pytest.mark.parametrize(("sql", "reason"), REFUSED, ids=[r[1] for r in REFUSED])
def test_a_probe_of_a_refused_relation_is_refused_with_its_reason(sql, reason, conn, service, spy):
    for probe in _probes(sql):
        before = len(service.ledger.log)
        with pytest.raises(dpsql.Error) as info:
            conn.cursor().execute(probe)
        assert not isinstance(info.value, dpsql.InternalError)
        if reason != "md5":
            assert reason.split()[0].lower() in str(info.value).lower(), str(info.value)
        assert spy.calls == 0 and len(service.ledger.log) == before


PER_UNIT = (
    "SELECT patient_id, COUNT(*) AS n, SUM(cost) AS total, MIN(dept_id) AS first_dept "
    "FROM visits GROUP BY patient_id"
)
PER_UNIT_COLUMNS = [
    ("patient_id", "BIGINT"),
    ("n", "BIGINT"),
    ("total", "DOUBLE"),
    ("first_dept", "BIGINT"),
]


@pytest.mark.parametrize("limit", [0, 1])
def test_a_probe_of_a_per_unit_relation_answers_its_columns_free(limit, conn, service, spy):
    """One private row per patient (a per-unit relation): Superset 6.1 saves such a virtual
    dataset by sending its SQL with LIMIT 1 (captured: tests/bi_shapes/superset_run.toml,
    per_unit_dataset_probe); it was refused (GROUP BY the privacy unit) and Superset could not
    save the dataset. Its probe is a row-level relation's: columns, no row, nothing read."""
    before = len(service.ledger.log)
    cur = conn.cursor()
    # as sent, and wrapped as a BI tool wraps a virtual dataset's probe
    for probe in (f"{PER_UNIT}\nLIMIT {limit}", wrapped(PER_UNIT, limit)):
        cur.execute(probe)
        assert [d[:2] for d in cur.description] == PER_UNIT_COLUMNS
        assert cur.fetchall() == [] and cur.cost is None
    assert spy.calls == 0 and len(service.ledger.log) == before


def test_dp_queries_and_public_tables_are_not_probes(conn, service):
    """LIMIT 1 over a released result keeps a released row (charged); a public table's row
    is public and returned as it is."""
    before = len(service.ledger.log)
    cur = conn.cursor()
    cur.execute("SELECT COUNT(*) AS n FROM visits LIMIT 1")
    assert len(cur.fetchall()) == 1 and len(service.ledger.log) == before + 1
    cur.execute("SELECT * FROM (SELECT name FROM departments) AS virtual_table LIMIT 1")
    assert len(cur.fetchall()) == 1
    # a row preview (LIMIT 100) is still the row-level refusal, of a per-unit relation too
    with pytest.raises(PrivacyError):
        cur.execute(wrapped("SELECT cost FROM visits", 100))
    for sql in (
        "SELECT patient_id, COUNT(*) AS n FROM visits GROUP BY patient_id LIMIT 5",
        wrapped("SELECT patient_id, COUNT(*) AS n FROM visits GROUP BY patient_id", 100),
    ):
        with pytest.raises(PrivacyError, match=r"privacy unit|individual rows"):
            cur.execute(sql)


def test_types_come_from_the_schema_not_the_data(tmp_path):
    """An empty table answers the same columns and types as the full one: the answer cannot
    depend on the rows."""
    empty = tmp_path / "visits.csv"
    empty.write_text("patient_id,age,department,diagnosis,cost,visit_date,smoker,readmitted\n")
    policy = fixture_policy()
    full = dpsql.Service(policy, ledger=MemoryLedger(), cache=False)
    policy["tables"]["visits"]["source"] = str(empty)
    none = dpsql.Service(policy, ledger=MemoryLedger(), cache=False)
    sql = wrapped("SELECT FLOOR(age / 10) * 10 AS band, cost, visit_date FROM visits", 1)
    try:
        answers = [connect_service(s, "a").cursor().execute(sql).description for s in (full, none)]
    finally:
        full.close()
        none.close()
    assert answers[0] == answers[1]
    assert [d[:2] for d in answers[0]] == [
        ("band", "DOUBLE"),
        ("cost", "DOUBLE"),
        ("visit_date", "DATE"),
    ]


# --------------------------------------------------------------------------------------------
# through dpsql serve (PostgreSQL over the wire)


@pytest.fixture(scope="module")
def server(tmp_path_factory, service):
    pytest.importorskip("psycopg", reason="psycopg 3 is not installed")
    from dpsql.server.server import Server, ServerThread
    from dpsql.server.users import UserStore

    users = UserStore(tmp_path_factory.mktemp("probes") / "users.json")
    users.add("analyst", PASSWORD)
    thread = ServerThread(lambda: Server(service, users))
    thread.start()
    yield thread
    thread.stop()


def _wire(server, sql: str):
    import psycopg

    dsn = psycopg.conninfo.make_conninfo(
        host="127.0.0.1", port=str(server.port), user="analyst", password=PASSWORD, dbname="star"
    )
    with psycopg.connect(dsn, autocommit=True) as conn:
        cur = conn.execute(sql)
        return [(d.name, d.type_code) for d in cur.description or []], cur.fetchall()


PG_OIDS = {"BIGINT": 20, "DOUBLE": 701, "VARCHAR": 25, "BOOLEAN": 16}


@pytest.mark.parametrize(("name", "sql", "columns"), STAR_CASES, ids=[c[0] for c in STAR_CASES])
def test_a_probe_through_the_wire(name, sql, columns, server, service, spy):
    expected_names = [n for n, _ in columns]
    for probe in _probes(sql):
        before = len(service.ledger.log)
        described, rows = _wire(server, probe)
        assert [n for n, _ in described] == expected_names, probe
        if name != "CTE":  # PostgreSQL's cost / 100 is numeric division like DuckDB's here
            assert [o for _, o in described] == [PG_OIDS[t] for _, t in columns], probe
        assert rows == []
        assert spy.calls == 0 and len(service.ledger.log) == before


def test_a_per_unit_probe_through_the_wire(server, service, spy):
    before = len(service.ledger.log)
    described, rows = _wire(server, f"{PER_UNIT}\nLIMIT 1")
    assert described == [(n, PG_OIDS[t]) for n, t in PER_UNIT_COLUMNS]
    assert rows == []
    assert spy.calls == 0 and len(service.ledger.log) == before


@pytest.mark.parametrize(("sql", "reason"), REFUSED[:2], ids=[r[1] for r in REFUSED[:2]])
def test_a_refused_probe_through_the_wire(sql, reason, server, service, spy):
    import psycopg

    for probe in _probes(sql):
        before = len(service.ledger.log)
        with pytest.raises(psycopg.Error) as info:
            _wire(server, probe)
        assert info.value.diag.sqlstate == "42501", probe
        assert reason.split()[0].lower() in str(info.value).lower()
        assert spy.calls == 0 and len(service.ledger.log) == before
