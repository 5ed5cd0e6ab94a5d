"""No internal exception reaches a door: a failure that is not dpsql's own becomes one
InternalError (XX000) naming no value and no internal class, whichever step raised it.

Each step of a statement's path gets a non-dpsql exception injected (a KeyError carrying a
"secret" value); the DB-API and the CLI must show the uniform XX000 error, before the reserve
nothing may be charged, and after it the charged boundary's uniform error stands.
"""

from __future__ import annotations

import pytest
from conftest import fixture_policy

import dpsql
from dpsql.cli import main
from dpsql.dbapi import connect_service
from dpsql.privacy.ledger import MemoryLedger

SECRET = "q999-secret-value"
QUERY = "SELECT department, COUNT(*) FROM visits WHERE age > 30 GROUP BY department"

# (where, the attribute patched, after the reserve?)
STEPS = [
    ("parse and bind", "dpsql.pipeline.parse_statement", False),
    ("plan", "dpsql.pipeline.Service.plan", False),
    ("the drawable check", "dpsql.pipeline.Service._check_drawable", False),
    ("the engine", "dpsql.engine.duckdb_engine.DuckDBEngine.execute", True),
    ("the release", "dpsql.pipeline.release", True),
    ("post-processing", "dpsql.pipeline.Service._finish", True),
]


def _boom(*args, **kwargs):
    raise KeyError(SECRET)


@pytest.mark.parametrize(("where", "target", "after"), STEPS, ids=[s[0] for s in STEPS])
def test_the_dbapi_shows_no_internal_exception(monkeypatch, where, target, after):
    service = dpsql.Service(fixture_policy(), ledger=MemoryLedger(), cache=False)
    conn = connect_service(service, "mallory")
    monkeypatch.setattr(target, _boom)
    with pytest.raises(dpsql.Error) as info:
        conn.cursor().execute(QUERY)
    error = info.value
    assert SECRET not in str(error) and "KeyError" not in str(error)
    spent = service.ledger.spent("mallory", service.policy.dataset)
    if after:
        assert error.sqlstate in ("58000", "22000")  # the charged boundary's uniform errors
        assert float(spent.epsilon) > 0
    else:
        assert error.sqlstate == "XX000"
        assert float(spent.epsilon) == 0
    monkeypatch.undo()
    conn.cursor().execute(QUERY)  # the service still answers
    service.close()


def test_the_cli_shows_no_internal_exception(monkeypatch, capsys, tmp_path):
    source = fixture_policy()["tables"]["visits"]["source"]
    policy = tmp_path / "policy.toml"
    policy.write_text(
        f"""[privacy]
budget_epsilon = 3.0
[tables.visits]
source = "{source}"
privacy_unit = "patient_id"
[tables.visits.columns.patient_id]
type = "int"
[tables.visits.columns.age]
type = "int"
lower = 0
upper = 100
"""
    )
    monkeypatch.setattr("dpsql.pipeline.parse_statement", _boom)
    code = main(["query", "--policy", str(policy), "SELECT COUNT(*) FROM visits"])
    out = capsys.readouterr()
    assert code != 0
    assert "XX000" in out.err and SECRET not in out.err + out.out
    assert "Traceback" not in out.err and "KeyError" not in out.err


@pytest.mark.parametrize("position", [".7", "1.5", "1.0", "1e0"])
def test_group_by_a_non_integer_literal_is_a_clear_refusal(position):
    service = dpsql.Service(fixture_policy(), ledger=MemoryLedger(), cache=False)
    conn = connect_service(service, "mallory")
    with pytest.raises(dpsql.ProgrammingError) as info:
        conn.cursor().execute(f"SELECT department, COUNT(*) FROM visits GROUP BY {position}")
    assert info.value.sqlstate == "42601"
    assert "not a select-list position" in info.value.message
    assert float(service.ledger.spent("mallory", service.policy.dataset).epsilon) == 0
    service.close()


def test_an_empty_public_table_is_an_empty_domain(tmp_path):
    """Grouping by a column of an empty public table: INNER releases no group, LEFT the NULL
    group only (public facts: the table is empty), not a leaked engine parser error."""
    from test_join_totality import STAR, star_policy

    empty = tmp_path / "departments.csv"
    empty.write_text((STAR / "departments.csv").read_text().splitlines()[0] + "\n")
    policy = star_policy()
    policy["tables"]["departments"]["source"] = str(empty)
    service = dpsql.Service(policy, ledger=MemoryLedger(), cache=False)
    cur = connect_service(service, "mallory").cursor()
    base = "SELECT d.name, COUNT(*) FROM visits v {} departments d ON v.dept_id = d.id GROUP BY 1"
    cur.execute(base.format("JOIN"))
    assert cur.fetchall() == []
    cur.execute(base.format("LEFT JOIN"))
    assert [row[0] for row in cur.fetchall()] == [None]
    service.close()
