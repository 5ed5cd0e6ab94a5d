"""Rendering compiled plans for Spark, and staging shared CTEs: pure text, no JVM needed."""

from __future__ import annotations

import pytest
import sqlglot
from conftest import fixture_policy
from sqlglot import exp

import dpsql
from dpsql.engine.spark_engine import stage_ctes
from dpsql.frontend.bind import parse_statement
from dpsql.lower.compile import compile_plan
from dpsql.pipeline import Settings
from dpsql.privacy.ledger import MemoryLedger

QUERIES = [
    "SELECT COUNT(*), SUM(age), VAR_SAMP(cost) FROM visits WHERE smoker",
    "SELECT department, COUNT(*), AVG(cost) FROM visits WHERE NOT (smoker) GROUP BY department",
    "SELECT diagnosis, COUNT(*) FROM visits GROUP BY diagnosis",
    "SELECT FLOOR(age / 10) AS d, COUNT(*) FROM visits WHERE age // 3 > 2 GROUP BY d",
]


@pytest.fixture(scope="module")
def service():
    svc = dpsql.Service(fixture_policy(), ledger=MemoryLedger())
    yield svc
    svc.close()


def _compiled(service, sql):
    plan = service.plan(
        parse_statement(sql, service.policy, None), Settings.from_policy(service.policy)
    )
    return compile_plan(plan, 12345)


@pytest.mark.parametrize("sql", QUERIES)
def test_spark_text_uses_xxhash_and_only_spark_constructs(service, sql):
    compiled = _compiled(service, sql)
    spark_sql = compiled.render("spark")
    tree = sqlglot.parse_one(spark_sql, read="spark")
    assert "QUALIFY" not in spark_sql.upper() and "TRY(" not in spark_sql.upper()
    assert "RAND" not in spark_sql.upper()
    if "HASH(" in compiled.render("duckdb").upper():  # keyed: rows or groups chosen by hash
        assert "XXHASH64(" in spark_sql.upper() and "12345" in spark_sql
    # No bare parenthesised column (Spark 4.0 cannot parse WHERE (flag)).
    assert not any(isinstance(p.this, exp.Column) for p in tree.find_all(exp.Paren))
    # The outermost sums are DECIMAL(38, 0) (no silent BIGINT wrap-around on Spark).
    for total in tree.find_all(exp.Sum):
        if total.parent_select is tree:
            assert isinstance(total.this, exp.Cast)
    # DuckDB's text is the compiled text with its own hash: unchanged by the Spark rewrites.
    assert compiled.render("duckdb") == compiled.sql.replace("DP_KEYED_HASH(", "HASH(")


def test_stage_ctes_materialises_only_shared_ctes():
    sql = (
        "WITH a AS (SELECT 1 AS x), b AS (SELECT x FROM a), c AS (SELECT x FROM b UNION ALL "
        "SELECT x FROM b) SELECT x FROM c JOIN a AS y ON c.x = y.x"
    )
    stages, final = stage_ctes(sql, "__p_")
    assert [name for name, _ in stages] == ["__p_a", "__p_b"]
    assert "FROM __p_a AS a" in stages[1][1]
    assert "__p_b AS b" in final and "__p_a AS y" in final and "WITH c AS" in final
    assert stage_ctes("WITH a AS (SELECT 1 AS x) SELECT x FROM a", "__p_") == (
        [],
        "WITH a AS (SELECT 1 AS x) SELECT x FROM a",
    )
