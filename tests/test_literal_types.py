"""Mistyped literals and expressions fail from the query text alone, spending nothing."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest

import dpsql
from dpsql.privacy.ledger import MemoryLedger

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "visits.toml"


@pytest.fixture(scope="module")
def conn():
    with dpsql.connect(policy=FIXTURE, ledger=MemoryLedger(), cache=False) as c:
        yield c


@pytest.mark.parametrize(
    "sql,params,construct",
    [
        ("SELECT COUNT(*) FROM visits WHERE age > ?", ["abc"], "'abc'"),
        ("SELECT COUNT(*) FROM visits WHERE visit_date > ?", ["2024-01-01 +00"], None),
        ("SELECT COUNT(*) FROM visits WHERE age IN ('1', 'x')", None, "'x'"),
        ("SELECT COUNT(*) FROM visits WHERE age BETWEEN 'a' AND 3", None, "'a'"),
        ("SELECT COUNT(*) FROM visits WHERE 'nope' = smoker", None, "'nope'"),
    ],
)
def test_bad_literal_is_22p02_and_free(conn, sql, params, construct) -> None:
    ledger = conn.service.ledger
    with pytest.raises(dpsql.DataError) as info:
        conn.cursor().execute(sql, params)
    assert info.value.sqlstate == "22P02"
    if construct:
        assert info.value.construct == construct
    assert ledger.spent(conn.analyst, conn.service.policy.dataset).is_zero


def test_type_error_found_on_the_shadow_schema(conn) -> None:
    with pytest.raises(dpsql.ProgrammingError) as info:
        conn.cursor().execute("SELECT COUNT(*) FROM visits WHERE department + 1 > 3")
    assert info.value.sqlstate == "42804"
    assert conn.service.ledger.spent(conn.analyst, conn.service.policy.dataset).is_zero


def test_good_literals_still_work(conn) -> None:
    cur = conn.cursor()
    cur.execute("SELECT COUNT(*) FROM visits WHERE age > ? AND visit_date > ?", ["5", "2024-06-01"])
    assert cur.fetchone()[0] >= 0


def test_describe_with_parameters_spends_nothing(conn) -> None:
    before = conn.service.ledger.spent(conn.analyst, conn.service.policy.dataset)
    description = conn.describe(
        "SELECT department, AVG(cost) AS c FROM visits WHERE age > ? GROUP BY 1", [18]
    )
    assert [(d[0], d[1]) for d in description] == [("department", "VARCHAR"), ("c", "DOUBLE")]
    assert conn.service.ledger.spent(conn.analyst, conn.service.policy.dataset) == before


def test_post_processing_type_error_is_refused_before_charging(conn) -> None:
    before = conn.service.ledger.spent(conn.analyst, conn.service.policy.dataset)
    with pytest.raises(dpsql.DatabaseError) as info:
        conn.cursor().execute("SELECT CAST(COUNT(*) AS DATE) FROM visits")
    assert "nothing was spent" in str(info.value)
    assert conn.service.ledger.spent(conn.analyst, conn.service.policy.dataset) == before


def test_having_may_name_a_select_alias(conn) -> None:
    cur = conn.cursor()
    cur.execute("SELECT department, COUNT(*) AS n FROM visits GROUP BY department HAVING n > 0")
    assert len(cur.fetchall()) == 6  # every department has thousands of visits
    cur.execute("SELECT department, COUNT(*) AS n FROM visits GROUP BY department HAVING n < 0")
    assert cur.fetchall() == []  # released counts are clamped at zero


def test_count_interval_is_the_exact_discrete_half_width(conn) -> None:
    cur = conn.cursor()
    cur.execute("EXPLAIN SELECT COUNT(*) FROM visits WHERE smoker")
    half = cur.fetchall()[0][9]
    cur.execute("SELECT COUNT(*) FROM visits WHERE smoker")
    (value,) = cur.fetchone()
    ((low, high),) = cur.intervals[0]
    assert high - value == pytest.approx(half)
    assert low == pytest.approx(max(value - half, 0.0))


def test_timestamp_keys_keep_their_type_through_the_cache(tmp_path) -> None:
    query = (
        "SELECT DATE_TRUNC('month', visit_date) AS m, COUNT(*) FROM visits "
        "GROUP BY m ORDER BY m LIMIT 2"
    )
    with dpsql.connect(policy=FIXTURE, ledger=MemoryLedger()) as c:
        cur = c.cursor()
        cur.execute(query)
        first = cur.fetchall()
        assert cur.description[0][1] == "TIMESTAMP"
        assert all(isinstance(r[0], dt.datetime) for r in first)
        cur.execute(query)
        assert cur.cached and cur.fetchall() == first
        assert c.describe(query)[0][1] == "TIMESTAMP"


def test_post_processing_check_is_per_grouping_not_per_text(conn) -> None:
    """Both post-process as `k0 + 1`: fine over GROUP BY age, a type error over GROUP BY
    department. The first passing the free check must not let the second skip it."""
    cur = conn.cursor()
    cur.execute("SELECT age + 1 AS x, COUNT(*) FROM visits GROUP BY age")
    before = conn.service.ledger.spent(conn.analyst, conn.service.policy.dataset)
    with pytest.raises(dpsql.DatabaseError, match="nothing was spent"):
        cur.execute("SELECT department + 1 AS x, COUNT(*) FROM visits GROUP BY department")
    assert conn.service.ledger.spent(conn.analyst, conn.service.policy.dataset) == before
