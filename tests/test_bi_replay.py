"""BI replay: the SQL that Superset, Metabase, Tableau, Power BI, Looker and Grafana send for
ordinary charts on the visits fixture, each answered with the right rows and charged once.

The shapes live in tests/bi_shapes/<tool>.toml (what each must return is stated next to its
SQL). In process they run on an exact connection (noise off, R and G large enough that no
bound binds), so every released value must equal the shape's reference SQL run directly in
DuckDB over the fixture with values clamped to the policy's bounds. Shapes marked
``server = true`` are replayed through ``dpsql serve`` with psycopg too: the server adds the
catalog and zero-row probe routing. ``pending`` shapes are xfail (not strict) with the missing
feature as the reason; docs/bi_tools.md lists them.
"""

from __future__ import annotations

import math
import re
import tomllib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import duckdb
import pytest
from conftest import FIXTURE_CSV, fixture_policy

import dpsql
from dpsql.dbapi import connect_service
from dpsql.privacy.ledger import MemoryLedger
from dpsql.privacy.samplers import ZeroNoise

SHAPES_DIR = Path(__file__).resolve().parent / "bi_shapes"
# Noise is off, so epsilon only sets the threshold tau for non-public keys (time buckets):
# a large one keeps tau small with G = 100, as a realistic epsilon would with bounds that bind.
SESSION_EPSILON = 1000.0
PASSWORD = "replay pass"
DEPARTMENTS = ["cardiology", "dermatology", "emergency", "neurology", "oncology", "pediatrics"]


@dataclass(frozen=True)
class Shape:
    """One SQL shape a tool sends, with what dpsql must answer."""

    tool: str
    name: str
    sql: str
    status: str = "expected"
    feature: str = ""
    outcome: str = "rows"
    columns: tuple[str, ...] | None = None
    rows: int | None = None
    reference: str | None = None
    ordered: bool = False
    charges: int = 1
    epsilon: float = SESSION_EPSILON
    sqlstate: str | None = None
    server: bool = False
    source: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"{self.tool}:{self.name}"

    @property
    def reference_sql(self) -> str | None:
        """The exact-answer SQL: the shape itself unless stated; None for no value check."""
        if self.reference is None:
            return self.sql
        return self.reference or None


_KNOWN = set(Shape.__dataclass_fields__) - {"tool", "extra"}


def load_shapes(directory: Path = SHAPES_DIR) -> list[Shape]:
    """Every shape of every tool file, in file order."""
    shapes = []
    for path in sorted(directory.glob("*.toml")):
        doc = tomllib.loads(path.read_text())
        for raw in doc.get("shape", []):
            known = {k: v for k, v in raw.items() if k in _KNOWN}
            if "columns" in known:
                known["columns"] = tuple(known["columns"])
            extra = {k: v for k, v in raw.items() if k not in _KNOWN}
            shapes.append(Shape(tool=doc["tool"], extra=extra, **known))
    return shapes


SHAPES = load_shapes()


def _params(shapes: Iterable[Shape]) -> Iterator[Any]:
    for shape in shapes:
        marks = []
        if shape.status == "pending":
            reason = shape.feature or "pending"
            marks.append(pytest.mark.xfail(strict=False, reason=reason))
        yield pytest.param(shape, id=shape.id, marks=marks)


# --------------------------------------------------------------------------------------------
# fixtures


def loose_policy() -> dict:
    """The fixture's policy with bounds that never bind (at most 58 visits, 6 departments)."""
    return fixture_policy(
        privacy={"epsilon": SESSION_EPSILON, "budget_epsilon": 1e9, "budget_delta": 0.5},
        table={"max_rows_per_unit": 100, "max_groups_per_unit": 100},
    )


@pytest.fixture(scope="module")
def exact_service() -> Iterator[dpsql.Service]:
    service = dpsql.Service(loose_policy(), ledger=MemoryLedger(), noise=ZeroNoise(), cache=False)
    yield service
    service.close()


@pytest.fixture(scope="module")
def exact(exact_service) -> Iterator[dpsql.Connection]:
    conn = connect_service(exact_service, "replay")
    yield conn
    conn.close()


def reference_db() -> duckdb.DuckDBPyConnection:
    """The fixture in DuckDB with cost clamped to [0, 5000] (age is inside [0, 100] already)."""
    con = duckdb.connect(":memory:")
    con.execute(
        "CREATE TABLE visits AS SELECT CAST(patient_id AS BIGINT) AS patient_id, "
        "CAST(age AS BIGINT) AS age, department, diagnosis, "
        # not LEAST(GREATEST(...)) alone: DuckDB's GREATEST skips NULL, so NULL would become 0
        "CASE WHEN cost IS NULL THEN NULL "
        "ELSE LEAST(GREATEST(CAST(cost AS DOUBLE), 0.0), 5000.0) END AS cost, "
        "CAST(cost AS DOUBLE) AS raw_cost, "  # WHERE sees raw values in dpsql
        "CAST(visit_date AS DATE) AS visit_date, CAST(smoker AS BOOLEAN) AS smoker "
        f"FROM read_csv('{FIXTURE_CSV}', header = true, all_varchar = true)"
    )
    con.execute("CREATE SCHEMA public")
    con.execute("CREATE VIEW public.visits AS SELECT * FROM main.visits")
    return con


@pytest.fixture(scope="module")
def reference() -> Iterator[duckdb.DuckDBPyConnection]:
    con = reference_db()
    yield con
    con.close()


def _charges(service: dpsql.Service) -> int:
    return len(service.ledger.log)


# --------------------------------------------------------------------------------------------
# comparison


def _norm(value: Any) -> Any:
    """Dates and timestamps compare as dates when they fall on midnight (DATE_TRUNC of a DATE
    is a DATE in one engine and a TIMESTAMP in another); decimals as floats."""
    import datetime as dt
    import decimal

    if isinstance(value, dt.datetime) and value.time() == dt.time(0) and value.tzinfo is None:
        return value.date()
    if isinstance(value, decimal.Decimal):
        return float(value)
    return value


def _key(row: tuple) -> tuple:
    return tuple((v is None, str(type(v)) if v is None else "", repr(v)) for v in row)


def assert_rows_match(got: list[tuple], expected: list[tuple], *, ordered: bool) -> None:
    got = [tuple(_norm(v) for v in r) for r in got]
    expected = [tuple(_norm(v) for v in r) for r in expected]
    if not ordered:
        got, expected = sorted(got, key=_key), sorted(expected, key=_key)
    assert len(got) == len(expected), f"{len(got)} rows, expected {len(expected)}:\n{got}"
    for g_row, e_row in zip(got, expected, strict=True):
        assert len(g_row) == len(e_row), (g_row, e_row)
        for g, e in zip(g_row, e_row, strict=True):
            if (
                isinstance(g, float | int)
                and isinstance(e, float | int)
                and not (isinstance(g, bool) or isinstance(e, bool))
            ):
                assert math.isclose(g, e, rel_tol=1e-7, abs_tol=1e-6), (g_row, e_row)
            else:
                assert g == e, (g_row, e_row)


def check_answer(shape: Shape, columns: list[str], rows: list[tuple], ref) -> None:
    if shape.columns is not None:
        assert columns == list(shape.columns)
    if shape.outcome == "probe":
        assert rows == []
        return
    if shape.rows is not None:
        assert len(rows) == shape.rows, rows
    expected_sql = shape.reference_sql
    if expected_sql is not None:
        assert_rows_match(rows, ref.execute(expected_sql).fetchall(), ordered=shape.ordered)


# --------------------------------------------------------------------------------------------
# in process


@pytest.mark.parametrize("shape", list(_params(SHAPES)))
def test_shape_in_process(shape: Shape, exact, exact_service, reference):
    if shape.outcome == "probe" and not re.search(r"\bLIMIT\s+[01]\s*$", shape.sql, re.I):
        # LIMIT 0/1 column probes are answered in process too, from the plan (grammar_notes.md,
        # "Column probes"); constant-false WHERE probes are routed by dpsql serve
        pytest.skip("WHERE 1 = 0 probes are routed by dpsql serve (docs/server.md)")
    before = _charges(exact_service)
    cur = exact.cursor()
    if shape.outcome == "refused":
        with pytest.raises(dpsql.Error) as info:
            cur.execute(shape.sql)
        assert info.value.sqlstate == shape.sqlstate
        assert _charges(exact_service) == before
        return
    cur.execute(shape.sql)
    rows = cur.fetchall()
    columns = [d[0] for d in cur.description or []]
    charges = shape.charges
    assert _charges(exact_service) - before == charges, "charged once (or free)"
    if charges and shape.epsilon:
        assert math.isclose(cur.cost.epsilon, shape.epsilon), cur.cost
    check_answer(shape, columns, rows, reference)


def test_shape_files_are_well_formed():
    """Every shape names its source; pending ones name the feature they wait for."""
    names = [s.id for s in SHAPES]
    assert len(names) == len(set(names))
    assert {s.tool for s in SHAPES} >= {
        "superset",
        "metabase",
        "tableau",
        "powerbi",
        "looker",
        "grafana",
    }
    for shape in SHAPES:
        assert shape.status in ("expected", "pending"), shape.id
        assert shape.outcome in ("rows", "probe", "refused"), shape.id
        assert shape.source, shape.id
        assert not shape.extra, (shape.id, shape.extra)
        if shape.status == "pending":
            assert shape.feature, shape.id
        if shape.outcome == "refused":
            assert shape.sqlstate and shape.charges == 0, shape.id
        if shape.outcome == "probe":
            assert shape.server and shape.charges == 0, shape.id


# --------------------------------------------------------------------------------------------
# through dpsql serve


@pytest.fixture(scope="module")
def server(tmp_path_factory, exact_service):
    pytest.importorskip("psycopg", reason="psycopg 3 is not installed")
    from dpsql.server.server import Server, ServerThread
    from dpsql.server.users import UserStore

    users = UserStore(tmp_path_factory.mktemp("replay") / "replay.users.json")
    users.add("replay", PASSWORD)
    thread = ServerThread(lambda: Server(exact_service, users))
    thread.start()
    yield thread
    thread.stop()


def _server_rows(server, sql: str) -> tuple[list[str], list[tuple]]:
    import psycopg

    dsn = psycopg.conninfo.make_conninfo(
        host="127.0.0.1", port=str(server.port), user="replay", password=PASSWORD, dbname="visits"
    )
    with psycopg.connect(dsn, autocommit=True) as conn:
        cur = conn.execute(sql)
        columns = [d.name for d in cur.description or []]
        return columns, cur.fetchall()


@pytest.mark.parametrize("shape", list(_params(s for s in SHAPES if s.server)))
def test_shape_through_server(shape: Shape, server, exact_service, reference):
    import psycopg

    before = _charges(exact_service)
    if shape.outcome == "refused":
        with pytest.raises(psycopg.Error) as info:
            _server_rows(server, shape.sql)
        assert info.value.diag.sqlstate == shape.sqlstate
        assert _charges(exact_service) == before
        return
    columns, rows = _server_rows(server, shape.sql)
    charges = 0 if shape.outcome == "probe" else shape.charges
    assert _charges(exact_service) - before == charges, "charged once (or free)"
    check_answer(shape, columns, rows, reference)
