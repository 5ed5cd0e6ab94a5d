"""Binding analyst SQL to the policy: the bound query's shape, without any engine or data."""

from __future__ import annotations

import dataclasses
import datetime as dt

import pytest
from conftest import table_policy, write_csv

from dpsql.errors import ProgrammingError, SQLSyntaxError
from dpsql.frontend.bind import parse_statement
from dpsql.frontend.statements import (
    AggregateCall,
    Compute,
    DPQuery,
    ExplainStatement,
    PublicSelect,
    SettingStatement,
    TransactionStatement,
    Where,
)
from dpsql.policy import load_policy

COLUMNS = {
    "uid": {"type": "int"},
    "grp": {"type": "text", "values": ["a", "b"]},
    "age": {"type": "int", "lower": 0, "upper": 99},
    "v": {"type": "float", "lower": 0.0, "upper": 1.0},
    "d": {"type": "date"},
}


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    path = write_csv(tmp_path_factory.mktemp("bind") / "t.csv", list(COLUMNS), [])
    return load_policy(table_policy(path, COLUMNS, unit="uid", rows=2, groups=2))


def bind(policy, sql, params=None) -> DPQuery:
    bound = parse_statement(sql, policy, params)
    assert isinstance(bound, DPQuery)
    return bound


def test_bound_query_shape(policy):
    q = bind(
        policy,
        "SELECT T.Grp AS g, COUNT(*), AVG(V), count(*) + SUM(v) AS s FROM t "
        "WHERE AGE > 3 GROUP BY g HAVING COUNT(*) > 1 ORDER BY s DESC LIMIT 5",
    )
    assert q.table.name == "t"
    assert q.where.sql(dialect="duckdb") == "age > 3"
    assert [k.sql for k in q.keys] == ["grp"] and q.keys[0].columns == ("grp",)
    assert q.aggregates == (
        AggregateCall("count", None),
        AggregateCall("avg", "v"),
        AggregateCall("sum", "v"),
    )
    post = q.post.sql(dialect="duckdb")
    assert post == (
        'SELECT k0 AS "g", a0 AS "count", a1 AS "avg", a0 + a2 AS "s" FROM __released '
        "WHERE a0 > 1 ORDER BY s DESC LIMIT 5"
    )


@pytest.mark.parametrize(
    "group_by",
    ["GROUP BY 1", "GROUP BY decade", "GROUP BY FLOOR(age / 10) * 10", "GROUP BY 1, decade"],
)
def test_group_by_ordinal_alias_or_expression(policy, group_by):
    q = bind(policy, f"SELECT FLOOR(age / 10) * 10 AS decade, COUNT(*) FROM t {group_by}")
    assert [k.sql for k in q.keys] == ["FLOOR(age / 10) * 10"]
    assert q.post.expressions[0].this.name == "k0"


def test_group_by_position_is_recorded(policy):
    sql = "SELECT COUNT(*)\nFROM t\nGROUP BY grp, d"
    q = bind(policy, sql)
    assert [(k.position.line, k.position.column) for k in q.keys] == [(3, 10), (3, 15)]


def test_aggregates_are_deduplicated_and_count_literal_counts_rows(policy):
    q = bind(policy, "SELECT COUNT(*), COUNT(1), count(*), COUNT(v), COUNT(DISTINCT uid) FROM t")
    assert q.aggregates == (
        AggregateCall("count", None),
        AggregateCall("count", "v"),
        AggregateCall("count_units", "uid"),
    )
    assert [e.this.name for e in q.post.expressions] == ["a0", "a0", "a0", "a1", "a2"]
    assert AggregateCall("count_units", "uid").label == "COUNT(DISTINCT uid)"


def test_variance_family(policy):
    q = bind(
        policy,
        "SELECT VARIANCE(v), VAR_SAMP(v), VAR_POP(v), STDDEV(v), STDDEV_SAMP(v), "
        "STDDEV_POP(v) FROM t",
    )
    assert [a.kind for a in q.aggregates] == ["var_samp", "var_pop", "stddev_samp", "stddev_pop"]


def test_parameters_become_literals(policy):
    q = bind(
        policy,
        "SELECT COUNT(*) FROM t WHERE grp = ? AND d >= ? AND v > ? AND age IS NOT ?",
        ["it's", dt.date(2024, 1, 2), 0.5, None],
    )
    assert q.where.sql(dialect="duckdb") == (
        "grp = 'it''s' AND d >= CAST('2024-01-02' AS DATE) AND v > 0.5 AND NOT age IS NULL"
    )
    q = bind(policy, "SELECT COUNT(*) FROM t WHERE age BETWEEN $2 AND $1", [9, 3])
    assert q.where.sql(dialect="duckdb") == "age BETWEEN 3 AND 9"


def test_comments_are_dropped(policy):
    q = bind(policy, "SELECT COUNT(*) /* a */ FROM t WHERE age > 1 -- b\nGROUP BY grp /* c */")
    assert "/*" not in q.where.sql(dialect="duckdb") and "/*" not in q.keys[0].sql
    assert "/*" not in q.post.sql(dialect="duckdb")


@pytest.mark.parametrize(
    ("sql", "expected"),
    [
        ("SET epsilon = 0.5", SettingStatement("set", "epsilon", 0.5)),
        ("set EPSILON to 2", SettingStatement("set", "epsilon", 2.0)),
        ("SET delta = 1e-7;", SettingStatement("set", "delta", 1e-7)),
        ("SET mechanism = 'gaussian'", SettingStatement("set", "mechanism", "gaussian")),
        ("SET mechanism = laplace", SettingStatement("set", "mechanism", "laplace")),
        ("SET epsilon = -1", SettingStatement("set", "epsilon", -1.0)),
        ("SHOW epsilon", SettingStatement("show", "epsilon")),
        ("show DELTA;", SettingStatement("show", "delta")),
        ("RESET mechanism", SettingStatement("reset", "mechanism")),
        ("/* a */ SHOW epsilon -- b", SettingStatement("show", "epsilon")),
        ("RESET delta; -- done", SettingStatement("reset", "delta")),
        ("BEGIN", TransactionStatement("begin")),
        ("COMMIT", TransactionStatement("commit")),
        ("ROLLBACK", TransactionStatement("rollback")),
    ],
)
def test_settings_and_transactions(policy, sql, expected):
    assert parse_statement(sql, policy) == expected


def test_explain_wraps_the_bound_query(policy):
    for sql in (
        "EXPLAIN SELECT COUNT(*) FROM t",
        "  explain\nSELECT COUNT(*) FROM t",
        "/* explain this */ EXPLAIN SELECT COUNT(*) FROM t",
    ):
        stmt = parse_statement(sql, policy)
        assert isinstance(stmt, ExplainStatement)
        assert stmt.query.aggregates == (AggregateCall("count", None),)
    with pytest.raises(ProgrammingError, match="EXPLAIN"):
        parse_statement("EXPLAIN SET epsilon = 1", policy)


def test_select_without_from_is_public(policy):
    assert isinstance(parse_statement("SELECT 1", policy), PublicSelect)
    assert isinstance(parse_statement("SELECT 'a' || 'b' AS x, 2 * 3", policy), PublicSelect)


@pytest.mark.parametrize(
    "sql", ["SHOW", "SHOW a b", "SET epsilon = 1 + 1", "SET a = 1, b = 2", "", "  ;  "]
)
def test_malformed_statements(policy, sql):
    with pytest.raises(ProgrammingError) as info:
        parse_statement(sql, policy)
    assert isinstance(info.value, SQLSyntaxError) and info.value.sqlstate == "42601"


def test_a_query_binds_to_a_tree_of_nodes(policy):
    """The binder emits GroupBy(Compute(Where(Read))), each optional node only when present."""
    plain = bind(policy, "SELECT COUNT(*) FROM t")
    assert [type(n).__name__ for n in plain.nodes()] == ["GroupBy", "Read"]
    full = bind(policy, "SELECT grp, SUM(v * 2) FROM t WHERE age > 3 GROUP BY grp")
    assert [type(n).__name__ for n in full.nodes()] == ["GroupBy", "Compute", "Where", "Read"]
    compute = full.node(Compute)
    assert compute is not None and [c.expr for c in compute.columns] == ["v * 2"]
    assert all(c.expr is None for c in full.read.table.columns.values())  # Read: declared only
    assert full.table.columns[compute.columns[0].name] == compute.columns[0]  # the flat view
    assert full.keys[0].type is None and full.aggregates[0].kind == "sum"


def test_rebuilding_a_tree_keeps_it_equal_and_changes_one_part(policy):
    q = bind(policy, "SELECT grp, SUM(v * 2) FROM t WHERE age > 3 GROUP BY grp")
    assert q.with_table(q.table) == q  # split back into Read and Compute alike
    assert q.with_where(q.where) == q
    assert q.with_keys(q.keys) == q
    unfiltered = q.with_where(None)
    assert unfiltered.node(Where) is None
    assert unfiltered.node(Compute).columns == q.node(Compute).columns
    wider = q.with_table(dataclasses.replace(q.table, max_rows_per_unit=9))
    assert wider.read.table.max_rows_per_unit == 9 and wider.where == q.where


def test_a_where_node_knows_which_conjuncts_can_fail(policy):
    """Totality is a property of the Where node: a comparison of one type family is total (it
    runs bare), a cast can fail on a row (it runs under TRY)."""
    q = bind(policy, "SELECT COUNT(*) FROM t WHERE age > 3 AND CAST(grp AS INT) = 1 AND v < 1")
    where = q.node(Where)
    assert where is not None
    assert [(c.expr.sql(), c.total) for c in where.conjuncts] == [
        ("age > 3", True),
        ("CAST(grp AS INT) = 1", False),
        ("v < 1", True),
    ]
