"""dp_rule_list through the SQL pipeline: charging, EXPLAIN, cache, bounding, refusals."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

import dpsql
from dpsql.privacy.ledger import MemoryLedger
from dpsql.privacy.samplers import SeededNoise
from dpsql.sql.rows import bounded_rows_sql

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
    conn = service.connect("rl-alice")
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
    conn = service.connect("rl-bob")
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

    def spy(sql, handle=None):
        seen["sql"] = sql
        seen["result"] = original(sql, handle)
        return seen["result"]

    monkeypatch.setattr(service.engine, "fetch_matrix", spy)
    conn = service.connect("rl-carol")
    conn.cursor().execute(QUERY.replace("max_length => 4", "max_length => 3"))
    sql = seen["sql"]
    assert "COUNT(*) AS __w" in sql and "RANDOM" not in sql.upper()
    # Re-run the same bounded row source, with the same secret, keeping the unit column.
    secret = int(re.search(r", (\d+)\)\) <= ", sql).group(1))
    table = service.policy.table("visits")
    rows = bounded_rows_sql(table, '"patient_id"', secret).replace("DP_KEYED_HASH(", "HASH(")
    per_unit, total = service.engine._con.execute(
        f"SELECT max(n), sum(n) FROM (SELECT patient_id, count(*) AS n FROM ({rows}) GROUP BY 1)"
    ).fetchone()
    assert per_unit <= table.max_rows_per_unit
    # The weights the learner received add up to exactly the bounded rows.
    assert int(seen["result"][:, -1].sum()) == total
    assert len(seen["result"]) < total  # far fewer patterns than rows left the engine


def test_refusals_spend_nothing(service):
    conn = service.connect("rl-dave")
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
    conn = service.connect("rl-erin")
    cur = conn.cursor()
    cur.execute(QUERY)
    rows = cur.fetchall()
    case = (
        "CASE "
        + " ".join(f"WHEN {r[2]} THEN {str(r[3]).upper()}" for r in rows if not r[6])
        + f" ELSE {str(rows[-1][3]).upper()} END"
    )
    scored = service.scratch.rows(f"SELECT {case} FROM visits")
    assert scored == []  # the scratch shadow table is empty: no private rows there
    assert isinstance(np.array([r[4] for r in rows]), np.ndarray)


def test_show_budget_reports_own_spending(service):
    conn = service.connect("rl-frank")
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
