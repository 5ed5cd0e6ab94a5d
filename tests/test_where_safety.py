"""WHERE conjuncts that cannot fail run without TRY; everything else stays under TRY.

TRY exists so that a data-dependent engine error can never tell the analyst that some row
exists (a free membership oracle). Dropping it is only sound for conditions that cannot raise
for any row; these tests pin the whitelist, show that results do not change, and show that a
condition that does fail on some rows still filters them out silently.
"""

from __future__ import annotations

import pytest
import sqlglot
from conftest import EngineSpy, exact_connect, fixture_policy, rows_of

import dpsql.lower.bounding as bounding_module
import dpsql.pipeline as pipeline_module
from dpsql.frontend.safety import cannot_fail, where_conditions
from dpsql.policy import load_policy

POLICY = load_policy(fixture_policy())
TABLE = POLICY.tables["visits"]


def _where(condition: str) -> sqlglot.exp.Expression:
    return (
        sqlglot.parse_one(f"SELECT 1 FROM visits WHERE {condition}", read="duckdb")
        .args["where"]
        .this
    )


SAFE = [
    "age > 30",
    "age >= -3",
    "30 < age",
    "cost <= 12.5e2",
    "age = cost",
    "department = 'cardiology'",
    "department <> 'x' OR diagnosis = 'y'",
    "NOT (age IS NULL)",
    "cost IS NOT NULL",
    "smoker",
    "NOT smoker",
    "smoker = TRUE",
    "smoker IS TRUE",
    "age IN (1, 2, 3)",
    "department IN ('a', 'b')",
    "age BETWEEN 20 AND 40",
    "visit_date > DATE '2024-01-01'",
    "visit_date >= '2024-02-29'",
    "'2024-02-29' <= visit_date",
    "visit_date BETWEEN '2024-01-01' AND '2024-06-30'",
    "department LIKE 'card%'",
    "department ILIKE 'C%'",
    "age = NULL",
    "(age > 3 AND (smoker OR cost < 10))",
]

RISKY = [
    "age + 1 > 30",  # integer arithmetic can overflow
    "age * 1000 > 3",
    "cost / age > 1",
    "CAST(diagnosis AS INT) = 3",  # fails on rows whose diagnosis is not a number
    "visit_date > '2024-02-30'",  # not a date (bind refuses it; the whitelist does not rely on it)
    "visit_date > '2024-1-5'",  # not the canonical form
    "age > '30'",  # string compared with a number: an implicit cast
    "smoker = 1",
    "department = 3",
    "LOWER(department) = 'x'",
    "department LIKE 'a!%' ESCAPE '!'",
    "age IN (1, 'x')",
    "CASE WHEN age > 3 THEN TRUE ELSE FALSE END",
    "nosuchcolumn > 3",
]


@pytest.mark.parametrize("condition", SAFE)
def test_whitelisted_conditions_cannot_fail(condition: str) -> None:
    assert cannot_fail(_where(condition), TABLE)


@pytest.mark.parametrize("condition", RISKY)
def test_other_conditions_stay_under_try(condition: str) -> None:
    assert not cannot_fail(_where(condition), TABLE)
    assert "TRY(" in " ".join(where_conditions(_where(condition), TABLE, "duckdb"))


def test_only_the_conjuncts_that_might_fail_go_under_try() -> None:
    parts = where_conditions(
        _where("age > 3 AND age + 1 > 4 AND (smoker OR cost < 1)"), TABLE, "duckdb"
    )
    assert parts == ["(age > 3)", "(smoker OR cost < 1)", "TRY((age + 1 > 4))"]


def test_or_keeps_its_precedence_next_to_other_conditions() -> None:
    conn = exact_connect(fixture_policy())
    spy = EngineSpy(conn.service)
    rows_of(conn, "SELECT COUNT(*) FROM visits WHERE age < 10 OR age > 80")
    assert '(age < 10 OR age > 80) AND NOT "patient_id" IS NULL' in spy.sql[-1]
    assert "TRY(" not in spy.sql[-1]


QUERIES = [
    "SELECT COUNT(*), SUM(cost), AVG(age) FROM visits WHERE age > 30 AND smoker",
    "SELECT department, COUNT(*) FROM visits WHERE age < 10 OR age > 80 GROUP BY department",
    "SELECT COUNT(*) FROM visits WHERE visit_date BETWEEN '2024-01-01' AND '2024-06-30'",
    "SELECT SUM(cost) FROM visits WHERE department IN ('cardiology', 'oncology') "
    "AND NOT (cost IS NULL)",
    "SELECT COUNT(*) FROM visits WHERE age + 1 > 30 AND department LIKE 'c%'",
]


@pytest.mark.parametrize("query", QUERIES)
def test_results_equal_those_with_everything_under_try(query: str, monkeypatch) -> None:
    # The same keyed-hash secret both times, so the same rows are kept where R binds.
    monkeypatch.setattr(pipeline_module.secrets, "randbits", lambda bits: 12345)
    split = rows_of(exact_connect(fixture_policy()), query)

    def all_under_try(parts):  # every conjunct as if it could fail: the whole WHERE in TRY
        return [sqlglot.exp.Try(this=sqlglot.exp.and_(*(part.copy() for part, _ in parts)))]

    monkeypatch.setattr(bounding_module, "guarded", all_under_try)
    conn = exact_connect(fixture_policy())
    spy = EngineSpy(conn.service)
    assert rows_of(conn, query) == split
    assert "TRY(" in spy.sql[-1]


def test_a_condition_failing_on_some_rows_still_filters_them_silently() -> None:
    """diagnosis is text; casting it to INT fails on every row: no error, nothing matches."""
    conn = exact_connect(fixture_policy())
    spy = EngineSpy(conn.service)
    assert rows_of(conn, "SELECT COUNT(*) FROM visits WHERE CAST(diagnosis AS INT) = 3") == [(0,)]
    assert "TRY(" in spy.sql[-1]
