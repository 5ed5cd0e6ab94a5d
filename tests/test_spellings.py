"""Aggregate spellings that are the same measurement: COUNT_IF(c) is COUNT(*) FILTER (WHERE c).

A spelling is rewritten before binding (dpsql.frontend.rewrite.normalise), so it plans the
very measurement of the form it stands for: the same exact answer, cost, and cache entry.
"""

from __future__ import annotations

import pytest
from conftest import fixture_policy, rows_of

import dpsql
from dpsql.dbapi import connect_service
from dpsql.privacy.ledger import MemoryLedger
from dpsql.privacy.samplers import ZeroNoise

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
