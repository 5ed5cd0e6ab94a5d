"""Folded grouping (dpsql.lower.fold): rows grouped by the columns the keys read, then by the keys.

Whether a plan folds depends on the policy and the query only; the folded plan's exact measures
equal the one-level plan's for the same secret, row-level and per privacy unit, with and
without a prepared store; Spark's text accumulates the inner sums in DECIMAL.
"""

from __future__ import annotations

import dataclasses

import pytest
import sqlglot
from conftest import fixture_policy
from sqlglot import exp

from dpsql.frontend.bind import parse_statement
from dpsql.lower import fold, prepared_plan
from dpsql.lower.compile import compile_plan
from dpsql.pipeline import Service, Settings
from dpsql.policy import load_policy
from dpsql.privacy.ledger import MemoryLedger

SECRETS = (0, 4242, 2**62 - 1)

FOLDED = [
    "SELECT smoker, FLOOR(age / 10) * 10 AS decade, COUNT(*), AVG(cost) FROM visits "
    "WHERE visit_date >= DATE '2024-03-01' GROUP BY smoker, decade",
    "SELECT FLOOR(age / 10) AS d, SUM(cost), VARIANCE(cost), COUNT(cost) FROM visits GROUP BY 1",
    "SELECT CASE WHEN age < 40 THEN 'young' ELSE 'old' END AS band, department, COUNT(*) "
    "FROM visits WHERE cost > 100 GROUP BY 1, 2",
    "SELECT UPPER(department) AS d, readmitted, SUM(age) FROM visits GROUP BY 1, 2",
    "SELECT age % 3 AS r, smoker, AVG(age) FROM visits WHERE smoker OR age > 50 GROUP BY 1, 2",
]
NOT_FOLDED = [
    "SELECT department, smoker, COUNT(*) FROM visits GROUP BY 1, 2",  # bare columns only
    "SELECT FLOOR(cost / 1000) AS c, COUNT(*) FROM visits GROUP BY 1",  # cost: not small
    "SELECT COUNT(*), SUM(cost) FROM visits",  # no key
]


def _policy(*, unit: bool, store: bool):
    policy = fixture_policy()
    if not unit:
        for key in ("privacy_unit", "max_rows_per_unit", "max_groups_per_unit"):
            policy["tables"]["visits"].pop(key)
    loaded = load_policy(policy)
    if store:
        loaded = dataclasses.replace(
            loaded, engine=dataclasses.replace(loaded.engine, prepared="memory")
        )
    return loaded


@pytest.fixture(params=[(False, False), (False, True), (True, False), (True, True)])
def service(request):
    unit, store = request.param
    svc = Service(_policy(unit=unit, store=store), ledger=MemoryLedger(), cache=False)
    yield svc
    svc.close()


def _plan(svc: Service, sql: str):
    settings = Settings.from_policy(svc.policy)
    settings.delta = 1e-6
    # its subject is the store/folded plan; bias measures are not in these plans: docs/bias.md
    # (a plan with them falls back to the generic bounded SQL, which keeps a unit's pairs unfolded)
    settings.bias_estimate = "off"
    return svc.plan(parse_statement(sql, svc.policy), settings)


def _rows(svc: Service, compiled, nk: int) -> list[tuple]:
    rows = svc.engine._con.execute(compiled.render("duckdb")).fetchall()
    return sorted(
        (tuple(int(v or 0) if i >= nk else v for i, v in enumerate(r)) for r in rows), key=repr
    )


def _is_folded(compiled) -> bool:
    return any(q.alias == fold.INNER for q in compiled.expression.find_all(exp.Subquery))


@pytest.mark.parametrize("sql", FOLDED)
def test_folded_plans_equal_the_one_level_plans(service, sql, monkeypatch):
    # the store's two-phase plan for every shape (store_tree leaves some to the plain plan:
    # test_prepared_store.test_store_routing_by_shape); its subject is the folded store plan
    monkeypatch.setattr(prepared_plan, "two_phase_pays", lambda plan: True)
    plan = _plan(service, sql)
    folded = compile_plan(plan, 0)
    row_level = plan.query.table.privacy_unit is None
    store = service.policy.engine.prepared != "off"
    # without a store, a privacy unit's pairs are not folded (a (unit, column) group each)
    assert _is_folded(folded) == (row_level or store), sql
    monkeypatch.setattr(fold, "INNER_GROUPS", 0)
    one_level = compile_plan(plan, 0)
    monkeypatch.undo()
    assert not _is_folded(one_level)
    for secret in SECRETS:
        nk = len(plan.keys)
        expected = _rows(service, one_level.with_secret(secret), nk)
        assert _rows(service, folded.with_secret(secret), nk) == expected, (sql, secret)


@pytest.mark.parametrize("sql", NOT_FOLDED)
def test_keys_without_small_domains_are_not_folded(service, sql):
    assert not _is_folded(compile_plan(_plan(service, sql), 0))


def test_which_columns_fold_comes_from_the_policy():
    table = _policy(unit=False, store=False).tables["visits"]

    def columns(*keys: str):
        return fold.fold_columns(table, [sqlglot.parse_one(k, read="duckdb") for k in keys])

    assert columns("smoker", "FLOOR(age / 10)") == ["smoker", "age"]  # 2 x 101 values
    assert columns("department || smoker") == ["department", "smoker"]
    assert columns("age + age") == ["age"]
    assert columns("smoker", "department") is None  # nothing to evaluate per row
    assert columns("FLOOR(cost)") is None  # a float column
    assert columns("LOWER(diagnosis)") is None  # free text
    assert columns("YEAR(visit_date)") is None  # a date
    assert columns("age * 2", "age % 7", "department || 'x'") == ["age", "department"]
    big = dataclasses.replace(table.columns["age"], upper=5000.0)
    wide = dataclasses.replace(table, columns={**table.columns, "age": big})
    assert fold.fold_columns(wide, [sqlglot.parse_one("age // 10", read="duckdb")]) is None


def test_distinct_counts_are_not_refolded():
    """COUNT(DISTINCT x) of inner groups cannot be summed back: such plans keep one level."""
    assert fold.foldable(
        [sqlglot.parse_one("SUM(x) - COUNT(y) * 3"), sqlglot.parse_one("COUNT(*)")]
    )
    assert not fold.foldable([sqlglot.parse_one("COUNT(DISTINCT x)")])
    assert not fold.foldable([sqlglot.parse_one("MAX(x)")])


def test_spark_accumulates_the_inner_sums_in_decimal():
    """Spark's SUM(BIGINT) wraps past 2^63: a folded plan's inner sums are widened as well."""
    svc = Service(_policy(unit=False, store=False), ledger=MemoryLedger(), cache=False)
    try:
        compiled = compile_plan(_plan(svc, FOLDED[1]), 0)
        spark = sqlglot.parse_one(compiled.render("spark"), read="spark")
        inner = [q for q in spark.find_all(exp.Subquery) if q.alias == fold.INNER]
        assert inner
        sums = list(inner[0].this.find_all(exp.Sum))
        assert sums and all(
            isinstance(s.this, exp.Cast) and s.this.to.this == exp.DataType.Type.DECIMAL
            for s in sums
        )
    finally:
        svc.close()
