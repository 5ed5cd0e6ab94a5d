"""dp_rule_list through the SQL pipeline: charging, EXPLAIN, cache, bounding, refusals."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import sqlglot

import dpsql
from dpsql.dbapi import connect_service
from dpsql.lower.builders import policy_column
from dpsql.lower.rows import bounded_rows, engine_text
from dpsql.privacy.ledger import MemoryLedger
from dpsql.privacy.samplers import SeededNoise

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "visits.toml"
QUERY = (
    "SELECT * FROM dp_rule_list('visits', label => 'smoker', epsilon => 1.0, "
    "max_length => 4, mechanism => 'monotone_em')"
)


@pytest.fixture(scope="module")
def service():
    svc = dpsql.Service(FIXTURE, ledger=MemoryLedger(), noise=SeededNoise(7))
    yield svc
    svc.close()


def test_rule_list_charges_once_and_caches(service):
    conn = connect_service(service, "rl-alice")
    cur = conn.cursor()
    cur.execute(QUERY)
    rows = cur.fetchall()
    assert [d[0] for d in cur.description] == [
        "position",
        "rule",
        "predicate",
        "prediction",
        "noisy_negative",
        "noisy_positive",
        "is_default",
        "noisy_support",
        "positive_rate",
        "rate_low",
        "rate_high",
    ]
    assert rows[-1][6] is True  # the default rule closes the list
    assert cur.cost.epsilon == pytest.approx(1.0)
    spent = service.ledger.spent("rl-alice", service.policy.dataset)
    assert spent.epsilon == pytest.approx(1.0)
    # Same learner call with different post-processing: cached, nothing charged.
    cur.execute(QUERY.replace("SELECT *", "SELECT rule, prediction") + " ORDER BY position DESC")
    assert cur.cached and cur.cost is None
    assert [r[0] for r in cur.fetchall()] == [r[1] for r in reversed(rows)]
    assert service.ledger.spent("rl-alice", service.policy.dataset) == spent


def test_explain_spends_nothing(service):
    conn = connect_service(service, "rl-bob")
    cur = conn.cursor()
    cur.execute("EXPLAIN " + QUERY)
    row, *details = cur.fetchall()
    assert row[2] == "monotone_em" and row[6] == pytest.approx(1.0)
    shown = {d[0]: d for d in details}
    # L = 4: 2L-1 = 7 steps, plus monotone_em's noisy row count for Λ = ⌊0.05·ñ⌋
    assert shown["epsilon_node"][6] == pytest.approx(1.0 / 8)
    assert shown["delta_node"][7] == 0.0
    assert shown["T"][1].startswith("T = none")
    assert "0.05" in shown["Lambda"][1]
    assert shown["label counts"][5] == pytest.approx(5 * 8)  # k = 5 rows per unit
    assert service.ledger.spent("rl-bob", service.policy.dataset).is_zero


def test_rows_bounded_per_unit_and_counted_in_the_engine(service, monkeypatch):
    """The learner sees at most max_rows_per_unit rows of each patient, as pattern counts."""
    seen = {}
    original = service.engine.fetch_matrix

    def spy(query, handle=None):
        seen["sql"] = query.sql(dialect="duckdb")  # a tree: the engine renders it
        seen["result"] = original(query, handle)
        return seen["result"]

    monkeypatch.setattr(service.engine, "fetch_matrix", spy)
    conn = connect_service(service, "rl-carol")
    conn.cursor().execute(QUERY.replace("max_length => 4", "max_length => 3"))
    sql = seen["sql"]
    assert "COUNT(*) AS __w" in sql and "RANDOM" not in sql.upper()
    # Re-run the same bounded row source, with the same secret, keeping the unit column.
    secret = int(re.search(r", (\d+)\)\) <= ", sql).group(1))
    table = service.policy.table("visits")
    unit = [policy_column("patient_id")]
    rows = engine_text(bounded_rows(table, unit), secret).replace("DP_KEYED_HASH(", "HASH(")
    per_unit, total = service.engine._con.execute(
        f"SELECT max(n), sum(n) FROM (SELECT patient_id, count(*) AS n FROM ({rows}) GROUP BY 1)"
    ).fetchone()
    assert per_unit <= table.max_rows_per_unit
    # The weights the learner received add up to exactly the bounded rows.
    assert int(seen["result"][:, -1].sum()) == total
    assert len(seen["result"]) < total  # far fewer patterns than rows left the engine


def test_refusals_spend_nothing(service):
    conn = connect_service(service, "rl-dave")
    cur = conn.cursor()
    with pytest.raises(dpsql.PrivacyError, match="one row per privacy unit"):
        cur.execute(QUERY.replace("monotone_em", "smooth_laplace"))
    with pytest.raises(dpsql.ProgrammingError, match="no argument 'bogus'"):
        cur.execute(QUERY.replace("epsilon => 1.0", "bogus => 1"))
    with pytest.raises(dpsql.ProgrammingError, match="unknown table"):
        cur.execute(QUERY.replace("'visits'", "'nope'"))
    with pytest.raises(dpsql.ProgrammingError, match="no column"):
        cur.execute(QUERY.replace("SELECT *", "SELECT secret_column"))
    assert service.ledger.spent("rl-dave", service.policy.dataset).is_zero


def test_predictions_match_case_expression(service):
    """The released predicates score rows inside the database like the learned list."""
    conn = connect_service(service, "rl-erin")
    cur = conn.cursor()
    cur.execute(QUERY)
    rows = cur.fetchall()
    case = (
        "CASE "
        + " ".join(f"WHEN {r[2]} THEN {str(r[3]).upper()}" for r in rows if not r[6])
        + f" ELSE {str(rows[-1][3]).upper()} END"
    )
    scored = service.scratch.rows(sqlglot.parse_one(f"SELECT {case} FROM visits", read="duckdb"))
    assert scored == []  # the scratch shadow table is empty: no private rows there
    assert isinstance(np.array([r[4] for r in rows]), np.ndarray)


def test_show_budget_reports_own_spending(service):
    conn = connect_service(service, "rl-frank")
    cur = conn.cursor()
    cur.execute("SELECT COUNT(*) FROM visits")
    cur.execute("SHOW budget")
    (row,) = cur.fetchall()
    names = [d[0] for d in cur.description]
    assert names == [d[0] for d in conn.describe("SHOW budget")]
    values = dict(zip(names, row, strict=True))
    assert values["analyst"] == "rl-frank"
    assert values["spent_epsilon"] == pytest.approx(service.policy.epsilon)
    assert values["remaining_epsilon"] == pytest.approx(
        service.policy.budget.epsilon - service.policy.epsilon
    )


def test_default_mechanism_works_on_multi_row_units_with_per_rule_output(service):
    """visits' units own up to 5 rows: the SQL default (monotone_em) runs; each rule has a
    noisy support, a positive rate inside its 95% interval, and no negative count."""
    cur = connect_service(service, "rl-gina").cursor()
    cur.execute("SELECT * FROM dp_rule_list('visits', label => 'smoker')")
    names = [d[0] for d in cur.description]
    for row in cur.fetchall():
        r = dict(zip(names, row, strict=True))
        assert r["noisy_negative"] >= 0 and r["noisy_positive"] >= 0
        assert r["noisy_support"] == r["noisy_negative"] + r["noisy_positive"]
        assert 0.0 <= r["rate_low"] <= r["rate_high"] <= 1.0
        if r["positive_rate"] is not None:
            assert r["rate_low"] <= r["positive_rate"] <= r["rate_high"]
    assert cur.cost.epsilon == pytest.approx(service.policy.epsilon) and cur.cost.delta == 0.0
    with pytest.raises(dpsql.PrivacyError, match="one row per privacy unit") as info:
        cur.execute(
            "SELECT * FROM dp_rule_list('visits', label => 'smoker', delta => 1e-6, "
            "mechanism => 'smooth_laplace')"
        )
    assert "monotone_em" in info.value.hint


def test_cut_points_are_honoured_or_refused(service):
    cur = connect_service(service, "rl-hal").cursor()
    cur.execute(
        "EXPLAIN SELECT * FROM dp_rule_list('visits', label => 'smoker', features => ['age'], "
        "cut_points => 'age: 18, 65')"
    )
    head = cur.fetchall()[0]
    # age >= 18, age >= 65 and their negations; 'age >= 18 and age < 65' (duplicates dropped)
    assert head[1].startswith("5 public candidates")
    for bad, state in (
        ("cut_points => 'department: 3'", "22023"),  # not numeric
        ("cut_points => 'cost: 100', features => ['age']", "22023"),  # not a feature
        ("cut_points => 'nope: 1'", "42703"),
        ("cut_points => 'age: x'", "22023"),
        ("cut_points => 'age 18'", "22023"),
    ):
        with pytest.raises(dpsql.ProgrammingError) as info:
            cur.execute(f"SELECT * FROM dp_rule_list('visits', label => 'smoker', {bad})")
        assert info.value.sqlstate == state and "cut_points" in (info.value.construct or "")
    assert service.ledger.spent("rl-hal", service.policy.dataset).is_zero


def test_notes_reach_the_cursor_and_explain_says_which_delta(service):
    cur = connect_service(service, "rl-ivy").cursor()
    cur.execute(
        "EXPLAIN SELECT * FROM dp_rule_list('visits', label => 'smoker', "
        "mechanism => 'global_gaussian')"
    )
    assert any("session's delta" in m for _, m in cur.messages)
    cur.execute(
        "SELECT * FROM dp_rule_list('visits', label => 'smoker', epsilon => 0.01, max_length => 3)"
    )
    assert cur.messages  # at ε = 0.01 rules fall below Λ or stop: the learner says why
