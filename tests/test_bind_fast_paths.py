"""The binder's early exits answer exactly as the walks they skip.

Two passes return their input untouched for the common flat query, and skip their walks
then: the respelling visitor (``frontend.rewrite.normalise``) when the tree holds none of the
node classes it replaces, and the released-tables split (``frontend.bind._released_tables``)
for a SELECT with no query inside it. Each query below, and generated ones, is bound with the
early exits and with them switched off: the same bound statement (its canonical text), or
the same refusal (class, SQLSTATE, message, position).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from fuzz_grammar import Query, where_queries
from hypothesis import HealthCheck, given, settings
from sqlglot import exp

import dpsql.frontend.bind as bind
import dpsql.frontend.rewrite as rewrite
from dpsql.errors import Error
from dpsql.frontend.bind import parse_statement
from dpsql.plan.canonical import canonical
from dpsql.policy import load_policy

POLICY = load_policy(Path(__file__).resolve().parent.parent / "fixtures" / "visits.toml")

QUERIES = [
    "SELECT COUNT(*) FROM visits",
    "SELECT department, COUNT(*), AVG(cost) FROM visits WHERE age > 30 GROUP BY department",
    "SELECT COUNT_IF(smoker) FROM visits",
    "SELECT COUNT(*) FILTER (WHERE smoker) AS n FROM visits",
    "SELECT SUM(cost) FILTER (WHERE age > 40) FROM visits GROUP BY department",
    "SELECT PERCENTILE_CONT(0.5) WITHIN GROUP (ORDER BY age) FROM visits",
    "SELECT QUANTILE(age, 0.9) FROM visits",
    "SELECT MEDIAN(age) FROM visits",
    "SELECT date_part('year', visit_date) AS y, COUNT(*) FROM visits GROUP BY y",
    "SELECT COUNT(*) FROM visits WHERE visit_date > DATE '2020-01-01'",
    "SELECT COUNT(*) FROM (SELECT * FROM visits WHERE age > 3) AS v",
    "WITH v AS (SELECT age FROM visits) SELECT COUNT(*) FROM v",
    "WITH visits AS (SELECT age FROM visits WHERE age > 50) SELECT COUNT(*) FROM visits",
    "SELECT COUNT(*) FROM visits UNION ALL SELECT COUNT(*) FROM visits",
    "SELECT department, COUNT(*) * 100.0 / (SELECT COUNT(*) FROM visits) FROM visits "
    "GROUP BY department",
    "SELECT COUNT(*) FROM visits WHERE department IN (SELECT department AS d FROM visits "
    "GROUP BY department)",
    "SELECT * FROM visits",
    "SELECT age FROM visits",
    "SELECT COUNT(*) FROM visits v JOIN visits w ON v.patient_id = w.patient_id",
    "SELECT COUNT(*) FROM nowhere",
    "SELECT 1",
    "SELECT COUNT(*), LOWER(department) FROM visits",
    "SELECT SUM(cost) FROM visits WHERE smoker AND age BETWEEN 20 AND 40",
]

#: Public clock readings differ between two binds: such texts are left out.
_CLOCK = re.compile(r"now|current_|localtime|statement_timestamp|transaction_timestamp", re.I)


def _outcome(text: str) -> tuple:
    try:
        return ("bound", canonical(parse_statement(text, POLICY)))
    except Error as exc:
        return ("refused", type(exc).__name__, exc.sqlstate, str(exc), exc.position)


def _both(text: str) -> tuple[tuple, tuple]:
    fast = _outcome(text)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(rewrite, "_RESPELLED", (exp.Expression,))  # the visitor walks every tree
        m.setattr(
            bind, "_one_query", lambda tree, census=None: False
        )  # the classifier sees every SELECT
        slow = _outcome(text)
    return fast, slow


@pytest.mark.parametrize("text", QUERIES)
def test_early_exits_bind_as_the_walks_do(text: str) -> None:
    fast, slow = _both(text)
    assert fast == slow


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(where_queries())
def test_early_exits_on_generated_queries(query: Query) -> None:
    if _CLOCK.search(query.sql):
        return
    fast, slow = _both(query.sql)
    assert fast == slow


def test_a_switched_off_exit_is_what_the_test_compares() -> None:
    """The comparison above is not vacuous: the flat query takes both exits."""
    tree = bind._parse("SELECT department, COUNT(*) FROM visits GROUP BY department")[0]
    assert bind._one_query(tree)
    assert tree.find(*rewrite._RESPELLED) is None
    nested = bind._parse("SELECT COUNT(*) FROM (SELECT age FROM visits) AS v")[0]
    assert not bind._one_query(nested)
