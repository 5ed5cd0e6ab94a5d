"""Aggregate spellings that are the same measurement: COUNT_IF(c) is COUNT(*) FILTER (WHERE c),
AGG(x) FILTER (WHERE c) is AGG(CASE WHEN c THEN x END).

A spelling is rewritten before binding (dpsql.frontend.rewrite.normalise), so it plans the
very measurement of the form it stands for: the same exact answer, cost, and cache entry.
"""

from __future__ import annotations

import pytest
from conftest import fixture_policy, rows_of

import dpsql
from dpsql.dbapi import connect_service
from dpsql.errors import ProgrammingError
from dpsql.privacy.ledger import MemoryLedger
from dpsql.privacy.samplers import SeededNoise, ZeroNoise

PAIRS = [
    (
        "SELECT COUNT_IF(age > 50) FROM visits",
        "SELECT COUNT(*) FILTER (WHERE age > 50) FROM visits",
    ),
    (
        "SELECT department, COUNT_IF(smoker AND cost > 100) FROM visits GROUP BY 1",
        "SELECT department, COUNT(*) FILTER (WHERE smoker AND cost > 100) FROM visits GROUP BY 1",
    ),
]


@pytest.mark.parametrize(("spelled", "plain"), PAIRS, ids=lambda s: s[:40])
def test_count_if_is_count_filter(spelled, plain):
    service = dpsql.Service(fixture_policy(), ledger=MemoryLedger(), noise=ZeroNoise(), cache=False)
    conn = connect_service(service, "a")
    assert rows_of(conn, spelled) == rows_of(conn, plain)
    cur = conn.cursor()
    cur.execute("EXPLAIN " + spelled)
    explained = cur.fetchall()
    cur.execute("EXPLAIN " + plain)
    assert [r[2:9] for r in explained] == [r[2:9] for r in cur.fetchall()]
    service.close()


def test_count_if_shares_the_cached_answer_of_its_plain_form():
    service = dpsql.Service(fixture_policy(), ledger=MemoryLedger())
    cur = connect_service(service, "a").cursor()
    cur.execute(PAIRS[0][1])
    first = cur.fetchall()
    cur.execute(PAIRS[0][0])
    assert cur.cached and cur.fetchall() == first
    service.close()


# The spellings and the CASE forms they stand for, with real (seeded) noise: the same plan, so
# the same draws and the same released rows.
CASE_FORMS = [
    (
        "SELECT SUM(cost) FILTER (WHERE smoker) FROM visits",
        "SELECT SUM(CASE WHEN smoker THEN cost END) FROM visits",
    ),
    (
        "SELECT department, AVG(cost) FILTER (WHERE age > 60), COUNT(*) FILTER (WHERE age > 60)"
        " FROM visits GROUP BY 1 ORDER BY 1",
        "SELECT department, AVG(CASE WHEN age > 60 THEN cost END),"
        " COUNT(CASE WHEN age > 60 THEN 1 END) FROM visits GROUP BY 1 ORDER BY 1",
    ),
    (
        "SELECT COUNT_IF(age > 60 AND smoker) FROM visits",
        "SELECT COUNT(CASE WHEN age > 60 AND smoker THEN 1 END) FROM visits",
    ),
]


@pytest.mark.parametrize(("spelled", "plain"), CASE_FORMS, ids=lambda s: s[:40])
def test_spellings_equal_their_case_forms_under_the_same_seed(spelled, plain):
    answers = []
    for sql in (spelled, plain):
        service = dpsql.Service(
            fixture_policy(), ledger=MemoryLedger(), noise=SeededNoise(2026), cache=False
        )
        answers.append(rows_of(connect_service(service, "a"), sql))
        service.close()
    assert answers[0] == answers[1]


# A FILTER / COUNT_IF condition is typed as a WHERE condition is, before anything is read:
# (sql, message fragment, where the error points)
UNTYPED = [
    ("SELECT COUNT_IF(diagnosis) FROM visits", "must be BOOLEAN, but diagnosis is VARCHAR", 17),
    ("SELECT SUM(cost) FILTER (WHERE age OR smoker) FROM visits", "age is BIGINT", 32),
    ("SELECT SUM(cost) FILTER (WHERE diagnosis > 5) FROM visits", "Cannot compare", None),
]


@pytest.mark.parametrize(("sql", "message", "column"), UNTYPED, ids=[u[0] for u in UNTYPED])
def test_an_untyped_filter_condition_is_refused_free(sql, message, column):
    service = dpsql.Service(fixture_policy(), ledger=MemoryLedger(), noise=ZeroNoise(), cache=False)
    engine = service.engine
    calls: list[object] = []
    original = engine.execute

    def execute(compiled, handle=None):
        calls.append(compiled)
        return original(compiled, handle)

    engine.execute = execute  # type: ignore[method-assign]
    with pytest.raises(ProgrammingError) as refused:
        connect_service(service, "a").cursor().execute(sql)
    assert refused.value.sqlstate == "42804" and message in str(refused.value)
    if column is not None:
        assert f"line 1, column {column}" in str(refused.value)
    assert calls == []  # refused before the engine ran anything
    assert service.ledger.spent("a", service.policy.dataset).epsilon == 0
    service.close()
