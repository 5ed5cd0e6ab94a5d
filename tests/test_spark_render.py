"""Rendering compiled plans for Spark, and staging shared CTEs: pure text, no JVM needed."""

from __future__ import annotations

import pytest
import sqlglot
from conftest import fixture_policy
from sqlglot import exp

import dpsql
from dpsql.engine.spark_engine import shared_ctes, stage_ctes, staged_sql
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
    stages, final = stage_ctes(sqlglot.parse_one(sql, read="spark"), "__p_")
    texts = [(name, tree.sql(dialect="spark")) for name, tree in stages]
    assert [name for name, _ in texts] == ["__p_a", "__p_b"]
    assert "FROM __p_a AS a" in texts[1][1]
    rest = final.sql(dialect="spark")
    assert "__p_b AS b" in rest and "__p_a AS y" in rest and "WITH c AS" in rest
    once = sqlglot.parse_one("WITH a AS (SELECT 1 AS x) SELECT x FROM a", read="spark")
    assert stage_ctes(once, "__p_") == ([], once)


STAGED = [  # each reads a bounding CTE more than once (or its extras do)
    *QUERIES,
    "SELECT age, department, COUNT(*) FROM visits WHERE age < 5 AND department <> 'x' "
    "AND age + 1 > 2 GROUP BY age, department",
    "SELECT department, COUNT(*), APPROX_QUANTILE(age, 0.5) FROM visits GROUP BY department",
    "SELECT COUNT(DISTINCT patient_id), SUM(cost) FROM visits",
    # a staged CTE with QUALIFY after an inline one: Spark's wrapper must not swallow its WITH
    "SELECT COALESCE(SQRT(cost), cost) AS k0, COUNT(cost) FROM visits GROUP BY 1",
    "SELECT department, COUNT(*) AS n, RANK() OVER (ORDER BY COUNT(*) DESC) AS r FROM visits "
    "GROUP BY department ORDER BY r",
]


def _old_stage_ctes(sql: str, prefix: str) -> tuple[list[tuple[str, str]], str]:
    """The staging as it was: the rendered Spark text parsed back and cut (the oracle)."""
    tree = sqlglot.parse_one(sql, read="spark")
    if not shared_ctes(tree):
        return [], sql
    stages, final = stage_ctes(tree, prefix)
    return [(name, t.sql(dialect="spark")) for name, t in stages], final.sql(dialect="spark")


def test_staged_spark_text_is_the_text_once_parsed_back(service):
    """The stages are cut from the tree and rendered once: byte for byte the text the engine
    ran when it parsed its own rendering back, for a query's extras and a shape's literals."""
    staged = 0
    for sql in STAGED:
        compiled = _compiled(service, sql)
        for query in (compiled, *compiled.extras):
            before = _old_stage_ctes(query.render("spark"), "__p_")
            assert staged_sql(query, "__p_") == before, sql
            staged += bool(before[0])
    assert staged >= 5
    slot = "123456789012345"  # a shape template's literal slot (dpsql.service.shape_cache)
    template = _compiled(
        service, f"SELECT age, COUNT(*) FROM visits WHERE age < {slot} GROUP BY age"
    )
    swapped = template.with_literals(((slot, "7"),)).with_secret(99)
    before = _old_stage_ctes(swapped.render("spark"), "__q_")
    assert before[0] and "< 7" in before[1] + "".join(t for _, t in before[0])
    assert staged_sql(swapped, "__q_") == before
