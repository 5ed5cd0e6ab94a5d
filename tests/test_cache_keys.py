"""Answer-cache keys cover the whole relation: two queries share a cached answer only if they
plan the same measurement.

The plan fingerprint named a join by its tables only, so ``JOIN departments d ON v.cost = d.id``
returned the cached answer of ``ON v.dept_id = d.id`` (and the reverse): one join's noisy answer
for another. The key is now the plan's canonical tree (dpsql.plan.canonical; its property test is
tests/test_canonical_keys.py), which holds each join step's table, kind and ON pairs, the
outputs and a digest of the public rows. Pairs that differ in one node must not share an
answer; pairs that differ only in spelling must.
"""

from __future__ import annotations

import itertools
import tomllib
from pathlib import Path

import pytest

import dpsql
from dpsql.dbapi import connect_service
from dpsql.privacy.ledger import MemoryLedger

STAR = Path(__file__).resolve().parent.parent / "fixtures" / "star"
_analysts = itertools.count()


@pytest.fixture(scope="module")
def service():
    policy = tomllib.loads((STAR / "star.toml").read_text())
    for name, spec in policy["tables"].items():
        spec["source"] = str(STAR / f"{name}.csv")
    policy["privacy"]["budget_epsilon"] = 1e6
    service = dpsql.Service(policy, ledger=MemoryLedger())
    yield service
    service.close()


def _second_is_cached(service, first: str, second: str) -> bool:
    conn = connect_service(service, f"cache-{next(_analysts)}")
    try:
        cur = conn.cursor()
        cur.execute(first)
        cur.fetchall()
        assert not cur.cached
        cur.execute(second)
        cur.fetchall()
        return cur.cached
    finally:
        conn.close()


BASE = (
    "SELECT d.name, COUNT(*) FROM visits v JOIN departments d ON v.dept_id = d.id GROUP BY d.name"
)

ONE_NODE_APART = {
    "join key": BASE.replace("v.dept_id = d.id", "v.cost = d.id"),
    "join kind": BASE.replace("JOIN departments", "LEFT JOIN departments"),
    "filter": BASE.replace("GROUP BY", "WHERE v.cost > 100 GROUP BY"),
    "key": BASE.replace("d.name", "d.region"),
    "aggregate": BASE.replace("COUNT(*)", "SUM(v.cost)"),
    "private join": "SELECT p.sex, COUNT(*) FROM visits v JOIN patients p "
    "ON v.patient_id = p.patient_id GROUP BY p.sex",
}


@pytest.mark.parametrize("other", ONE_NODE_APART.values(), ids=ONE_NODE_APART.keys())
def test_queries_one_node_apart_do_not_share_an_answer(service, other):
    assert not _second_is_cached(service, BASE, other)
    assert not _second_is_cached(service, other, BASE)


CTE = "WITH x AS (SELECT * FROM visits WHERE cost > {}) SELECT COUNT(*) FROM x"
PRIVATE = (
    "SELECT p.sex, COUNT(*) FROM visits v {} JOIN patients p ON v.patient_id = p.patient_id "
    "GROUP BY p.sex"
)


def test_cte_bodies_and_private_join_kinds_are_part_of_the_key(service):
    assert not _second_is_cached(service, CTE.format(10), CTE.format(20))
    assert not _second_is_cached(service, PRIVATE.format(""), PRIVATE.format("LEFT"))


SPELLINGS = {
    "ON sides swapped": BASE.replace("v.dept_id = d.id", "d.id = v.dept_id"),
    "INNER spelled": BASE.replace("JOIN departments", "INNER JOIN departments"),
    "aliases renamed": BASE.replace("v.", "w.").replace("visits v", "visits w"),
    "comma join": "SELECT d.name, COUNT(*) FROM visits v, departments d WHERE v.dept_id = d.id "
    "GROUP BY d.name",
    "case and spacing": BASE.lower().replace(" ", "  "),
}


@pytest.mark.parametrize("spelling", SPELLINGS.values(), ids=SPELLINGS.keys())
def test_queries_that_differ_in_spelling_share_the_answer(service, spelling):
    assert _second_is_cached(service, BASE, spelling)


VISITS = Path(__file__).resolve().parent.parent / "fixtures" / "visits.toml"


def test_a_having_refused_fresh_is_refused_alike_after_a_query_sharing_its_release(monkeypatch):
    """The answer key leaves post-processing out (it is replayed afresh), so a query whose
    release another query paid for replays it; its post-processing's free checks still run
    first. A HAVING on a text column was refused 42804 on a fresh connection, and after
    ``GROUP BY department`` ran through the cache to fail on the released values (22000,
    'the query's cost was charged': nothing was)."""
    service = dpsql.Service(VISITS, ledger=MemoryLedger())
    reads: list[object] = []
    real = service.engine.execute
    monkeypatch.setattr(service.engine, "execute", lambda *a, **k: reads.append(a) or real(*a, **k))
    try:
        having = "SELECT department, COUNT(*) FROM visits GROUP BY department HAVING department"
        for first in (None, "SELECT department, COUNT(*) FROM visits GROUP BY department"):
            analyst = f"having-{next(_analysts)}"
            conn = connect_service(service, analyst)
            cur = conn.cursor()
            if first is not None:
                cur.execute(first)
                cur.fetchall()
            spent = service.ledger.spent(analyst, service.policy.dataset)
            before = len(reads)
            with pytest.raises(dpsql.Error) as refused:
                cur.execute(having)
            assert len(reads) == before  # no data read
            assert refused.value.sqlstate == "42804"
            assert "a HAVING condition must be BOOLEAN, but it is VARCHAR" in refused.value.message
            assert service.ledger.spent(analyst, service.policy.dataset) == spent  # free
            conn.close()
    finally:
        service.close()
