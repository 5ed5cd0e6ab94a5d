"""An expression node's facts (type, value range, totality) are computed once and kept on it.

dpsql.frontend.facts keeps one record per node and table on the node's meta; the rules that own
each fact (simple_where: the type known without the binder and whether the column programs
read it; intervals: the value range; safety: the totality whitelist) fill it the first time
they are asked, and reach operands through the same entry points. These tests pin the facts of
a table of expressions (the rules' answers, unchanged by keeping them on the nodes), that a
second question computes nothing (the rules are made to fail, the answers still come), and
that a copy of a node or another table does not reuse them.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import duckdb
import fuzz_grammar as g
import pytest
import sqlglot
from conftest import fixture_policy
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from sqlglot import exp

import dpsql.frontend.intervals as intervals
import dpsql.frontend.nullability as nullability
import dpsql.frontend.safety as safety
import dpsql.frontend.simple_where as simple_where
from dpsql.errors import Error
from dpsql.frontend.bind import parse_statement
from dpsql.frontend.facts import FACTS, facts, known_type
from dpsql.frontend.intervals import NotNumeric, value_range
from dpsql.frontend.nullability import may_be_null
from dpsql.frontend.safety import cannot_fail
from dpsql.frontend.simple_where import declared_type, readable
from dpsql.frontend.statements import DPQuery, GroupKey, Where
from dpsql.frontend.typecheck import (
    ShadowTypes,
    _boolean_contexts,
    declared_key_types,
    type_query,
)
from dpsql.frontend.typed import Typed, typed
from dpsql.plan.domains import key_domain
from dpsql.policy import SQL_TYPES, load_policy

POLICY = load_policy(fixture_policy())
TABLE = POLICY.tables["visits"]
INF = math.inf

# expression -> (type without the binder, lower, upper, integral, total, readable); None for
# lower/upper/integral: not a number (value_range refuses it)
CASES: dict[str, tuple] = {
    "42": (None, 42, 42, True, False, False),
    "2.5": (None, 2.5, 2.5, False, False, False),
    "'x'": (None, None, None, None, False, False),
    "age": ("BIGINT", 0, 100, True, False, False),
    "cost": ("DOUBLE", 0, 5000, False, False, False),
    "smoker": ("BOOLEAN", None, None, None, True, True),
    "visit_date": ("DATE", None, None, None, False, False),
    "diagnosis": ("VARCHAR", None, None, None, False, False),
    "age * 2 + 1": (None, 1, 201, True, False, False),
    "cost / age": (None, -INF, INF, False, False, False),
    "age // 7": (None, 0, 14, True, False, False),
    "-age": (None, -100, 0, True, False, False),
    "CASE WHEN smoker THEN 1 ELSE 0 END": (None, 0, 1, True, False, False),
    "IF(age > 50, cost, NULL)": (None, 0, 5000, False, False, False),
    "CAST(smoker AS INT)": (None, 0, 1, True, False, False),
    "CAST(cost AS INT)": (None, 0, 5000, True, False, False),
    "TRY_CAST(diagnosis AS INT)": (None, -INF, INF, True, False, False),
    "LEAST(GREATEST(age, 10), 50)": (None, 10, 50, True, False, False),
    "ABS(age - 50)": (None, 0, 50, True, False, False),
    "ROUND(cost / 100)": (None, 0, 50, True, False, False),
    "SQRT(age)": (None, 0, 10, False, False, False),
    "MONTH(visit_date)": (None, 1, 12, True, False, False),
    "POWER(age, 2)": (None, 0, 10000, True, False, False),
    "age > 30": ("BOOLEAN", None, None, None, True, True),
    "(age > 1)": ("BOOLEAN", None, None, None, True, True),
    "TRUE": ("BOOLEAN", None, None, None, True, True),
    "department = 'cardiology' AND age < 5": ("BOOLEAN", None, None, None, True, True),
    "NOT smoker OR age IS NULL": ("BOOLEAN", None, None, None, True, True),
    "visit_date = '2024-03-01'": ("BOOLEAN", None, None, None, True, True),
    "age IN (1, 2, 3)": ("BOOLEAN", None, None, None, True, True),
    "diagnosis LIKE 'a%'": (None, None, None, None, True, False),
    "age BETWEEN 1 AND cost": (None, None, None, None, True, False),
    "smoker IS TRUE": (None, None, None, None, True, False),
    "LOWER(department) = 'x'": (None, None, None, None, False, False),
    "age = 'x'": (None, None, None, None, False, False),
}


def _node(sql: str) -> exp.Expression:
    return sqlglot.parse_one(f"SELECT {sql} FROM visits", read="duckdb").expressions[0]


def _check(sql: str, found: Typed) -> None:
    kind, lower, upper, integral, total, reads = CASES[sql]
    assert found.type == kind, sql
    assert (found.lower, found.upper, found.integral) == (lower, upper, integral), sql
    assert (found.total, found.readable) == (total, reads), sql
    assert (found.why is None) == (lower is not None), sql


@pytest.mark.parametrize("sql", list(CASES))
def test_facts_of_an_expression(sql: str) -> None:
    _check(sql, typed(_node(sql), TABLE))


def test_the_type_known_without_the_binder_is_the_binders() -> None:
    """Where a type is known without DuckDB (dpsql.frontend.typecheck.declared_key_types
    skips the binder on it), the shadow catalog's binder says the same."""
    known = [sql for sql, case in CASES.items() if case[0] is not None]
    shadow = ShadowTypes(POLICY)
    try:
        binder = shadow.types("visits", known)
    finally:
        shadow.close()
    assert [declared_type(_node(sql), TABLE) for sql in known] == binder


def test_a_mutated_rule_fails_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """The table above pins the rules: one that accepts every condition as total breaks it."""
    monkeypatch.setattr(safety, "_leaf_total", lambda node, table: True)
    with pytest.raises(AssertionError):
        for sql in CASES:
            _check(sql, typed(_node(sql), TABLE))


def _forbid_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every rule fails from now on: only facts already kept on a node can answer."""

    def computed(*args: object) -> None:
        raise AssertionError("a fact was computed again")

    monkeypatch.setattr(safety, "_leaf_total", computed)
    monkeypatch.setattr(simple_where, "_leaf_readable", computed)
    monkeypatch.setattr(simple_where, "stored_column", computed)
    monkeypatch.setattr(intervals, "_STEP_OF", {})
    monkeypatch.setattr(intervals, "_step_of", computed)


@pytest.mark.parametrize("sql", ["LEAST(GREATEST(age * 2, 10), 50) + cost", "age > 3 AND smoker"])
def test_every_fact_of_every_node_is_computed_once(sql: str, monkeypatch) -> None:
    node = _node(sql)
    first = {id(sub): typed(sub, TABLE) for sub in node.walk()}
    kept = {id(sub): sub.meta[FACTS] for sub in node.walk()}
    _forbid_rules(monkeypatch)
    for sub in node.walk():
        assert typed(sub, TABLE) == first[id(sub)]
        assert facts(sub, TABLE) is kept[id(sub)]  # the record on the node, not a new one


def test_operands_are_reached_through_the_kept_facts(monkeypatch) -> None:
    """A WHERE's conjuncts asked first (dpsql.frontend.statements.Where.conjuncts), then the
    whole WHERE (typing, then the column programs): the second walk reads the conjuncts'
    facts, and only the AND nodes are new."""
    where = _node("age > 3 AND department = 'x' AND NOT smoker")
    for part in where.flatten():
        assert cannot_fail(part, TABLE) and readable(part, TABLE)
    _forbid_rules(monkeypatch)
    assert cannot_fail(where, TABLE) and readable(where, TABLE)
    ands = [n for n in where.walk() if isinstance(n, exp.And)]
    assert len(ands) == 2 and all(n.meta[FACTS].total is True for n in ands)


def test_a_copy_or_another_table_computes_its_own(monkeypatch) -> None:
    """Facts hold for the node and table they were computed on: a copy (which a text shape
    changes in place, dpsql.service.shape_cache) and another table start afresh."""
    node = _node("age * 2")
    assert value_range(node, TABLE).upper == 200
    copy = node.copy()
    assert FACTS not in copy.meta  # an operator's meta was the facts' own: a copy drops them
    other = dataclasses.replace(TABLE, columns=dict(TABLE.columns))
    _forbid_rules(monkeypatch)
    assert value_range(node, TABLE).upper == 200
    for fresh, table in ((copy, TABLE), (node, other)):
        with pytest.raises(AssertionError, match="computed again"):
            value_range(fresh, table)


def test_a_refusal_is_kept_with_its_reason() -> None:
    """A value that is not a number keeps why (the node and the reason the binder's refusal
    names), and says it again the second time."""
    node = _node("age + diagnosis")
    for _ in range(2):
        with pytest.raises(NotNumeric) as caught:
            value_range(node, TABLE)
        assert caught.value.why == "diagnosis is text, not a number"
        assert caught.value.node is node.expression


def test_a_bound_where_keeps_its_facts_for_typing_and_lowering(monkeypatch) -> None:
    """On the binder's own tree: the Where node's conjuncts (their totality, read by the
    lowering) and typing's question (is the WHERE simple) leave their facts on the nodes, and
    the column programs' second question is answered from them."""
    query = parse_statement(
        "SELECT department, COUNT(*) FROM visits WHERE age > 30 AND smoker GROUP BY department",
        POLICY,
    )
    assert isinstance(query, DPQuery)
    where = query.node(Where)
    assert where is not None
    assert [c.total for c in where.conjuncts] == [True, True]
    assert declared_key_types(query) == ["VARCHAR"]
    _forbid_rules(monkeypatch)
    assert readable(where.condition, query.table)  # as dpsql.lower.local_plan asks it
    assert [cannot_fail(c.expr, where.input.table) for c in where.conjuncts] == [True, True]


# --- the binder's types are facts of the nodes it typed ------------------------------------

#: Queries whose keys or conditions only the shadow binder types (fixture and hand-written).
BINDER_QUERIES = (
    "SELECT department, COUNT(*) FROM visits GROUP BY department",
    "SELECT LOWER(department) AS d, COUNT(*) FROM visits GROUP BY d",
    "SELECT age // 10 AS a, SUM(cost) FROM visits WHERE smoker AND NOT readmitted GROUP BY 1",
    "SELECT CASE WHEN age > 60 THEN 'old' END AS band, COUNT(*) FROM visits GROUP BY band",
    "SELECT YEAR(visit_date) AS y, COUNT(*) FROM visits"
    " WHERE COALESCE(readmitted, FALSE) OR age IS NULL GROUP BY y",
    "SELECT COUNT(*) FROM visits WHERE IF(cost > 10, smoker, readmitted)",
    "SELECT SUM(CASE WHEN smoker THEN cost END) FROM visits",
)


def _generated(strategy: st.SearchStrategy, n: int) -> list:
    """``n`` examples of ``strategy``, the same on every run (derandomized)."""
    out: list = []

    @settings(
        derandomize=True,
        database=None,
        deadline=None,
        max_examples=n,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def collect(example: object) -> None:
        out.append(example)

    collect()
    return out


def _typed_query(sql: str, shadow: ShadowTypes) -> DPQuery | None:
    try:
        query = parse_statement(sql, POLICY)
        if not isinstance(query, DPQuery):
            return None
        return type_query(query, shadow)
    except Error:
        return None  # a refusal: nothing typed to compare


def test_the_binders_types_are_facts_of_the_nodes() -> None:
    """type_query records what the shadow binder answered on each key and condition node; a
    key's type and every condition's type fact equal the binder asked about the node alone."""
    generated = [q.sql for q in _generated(g.key_queries(g.typed_keys, typed_only=True), 25)]
    generated += [q.sql for q in _generated(g.where_queries(), 15)]
    shadow = ShadowTypes(POLICY)
    checked = 0
    try:
        for sql in BINDER_QUERIES + tuple(generated):
            query = _typed_query(sql, shadow)
            if query is None:
                assert sql not in BINDER_QUERIES, sql
                continue
            table = query.table
            for key in query.keys:
                assert known_type(key.expr, table) == key.type, sql
                assert key.type == shadow.types(table.name, [key.sql])[0], sql
                checked += 1
            where = query.where
            for node, _ in _boolean_contexts(where) if where is not None else ():
                found = known_type(node, table)
                if isinstance(found, str):
                    assert found == shadow.types(table.name, [node.sql(dialect="duckdb")])[0]
                    checked += 1
    finally:
        shadow.close()
    assert checked >= 30  # the comparison ran on enough nodes to mean something


def test_a_condition_typed_once_is_not_asked_again(monkeypatch) -> None:
    """The second typing of the same tree (a probe re-types its query) reads the conditions'
    type facts: the binder is asked for none of them again."""
    shadow = ShadowTypes(POLICY)
    try:
        query = parse_statement(
            "SELECT COUNT(*) FROM visits WHERE COALESCE(readmitted, FALSE) AND smoker", POLICY
        )
        assert isinstance(query, DPQuery)
        asked: list[list[str]] = []
        real = shadow.types

        def spy(table: str, expressions: list[str], owner: str | None = None) -> list[str]:
            asked.append(list(expressions))
            return real(table, expressions, owner)

        monkeypatch.setattr(shadow, "types", spy)
        type_query(query, shadow)
        type_query(query, shadow)
    finally:
        shadow.close()
    whole = "COALESCE(readmitted, FALSE) AND smoker"  # still bound whole: it must bind
    assert asked == [[whole, "COALESCE(readmitted, FALSE)", "smoker"], [whole]]


# --- nullable: never "not NULL" when a row can make it NULL ---------------------------------

#: visits with more nullable columns (the fixture declares only cost nullable)
NULLS_TABLE = dataclasses.replace(
    TABLE,
    columns={
        n: dataclasses.replace(c, nullable=True)
        if n in ("age", "department", "visit_date", "smoker", "cost")
        else c
        for n, c in TABLE.columns.items()
    },
)
#: rows with NULL in every nullable column somewhere, and edge values elsewhere
NULL_ROWS = (
    "(1, 0, 'cardiology', '', 0.0, DATE '2024-01-01', FALSE, FALSE)",
    "(2, NULL, NULL, 'x', NULL, NULL, NULL, TRUE)",
    "(3, 100, 'oncology', 'q999', 5000.0, DATE '2025-12-31', TRUE, FALSE)",
    "(4, 7, NULL, '12', 2.5, NULL, FALSE, TRUE)",
)
#: expressions whose nullability the rules decide one way or the other (besides generated ones)
NULLABLE_CASES = {
    "age": True,
    "patient_id": False,
    "COALESCE(age, 0)": False,
    "COALESCE(age, cost)": True,
    "CASE WHEN age > 3 THEN 1 END": True,
    "CASE WHEN age > 3 THEN 1 ELSE 0 END": False,
    "CASE WHEN patient_id > 3 THEN 'a' ELSE 'b' END": False,
    "CASE WHEN patient_id > 3 THEN 'a' ELSE NULL END": True,
    "IF(patient_id > 1, patient_id, 0)": False,
    "patient_id / 2": False,
    "patient_id / 0": True,
    "patient_id // (patient_id - 1)": True,
    "patient_id % 0": True,
    "NULLIF(patient_id, 1)": True,
    "TRY_CAST(diagnosis AS INT)": True,
    "age IS NULL": False,
    "cost IS NOT DISTINCT FROM 1": False,
    "patient_id + 1": False,
    "age + 1": True,
    "diagnosis LIKE 'a%'": False,
    "department = 'x'": True,
    "patient_id IN (1, NULL)": True,
    "patient_id IN (1, 2)": False,
    "NOT readmitted": False,
    "NOT smoker": True,
    "ROUND(patient_id / 3)": False,
    "LOWER(diagnosis)": False,
    "v.patient_id": True,
}


@functools.cache
def _expressions() -> tuple[str, ...]:
    """The cases above and generated expressions of every type (fuzz_grammar.FULL: columns,
    literals, NULL, COALESCE, NULLIF, CASE, IF, casts, arithmetic, comparisons)."""
    written = list(NULLABLE_CASES)
    for t in g.TYPES:
        written += _generated(g.FULL.expr(t, 2), 40)
    return tuple(written)


def _nullability_claims() -> list[tuple[str, str, bool]]:
    """(engine SQL, as written, the nullable fact) of :func:`_expressions`, parsed afresh."""
    out = []
    for sql in _expressions():
        try:
            node = _node(sql)
        except sqlglot.errors.ParseError:
            continue
        out.append((node.sql(dialect="duckdb"), sql, may_be_null(node, NULLS_TABLE)))
    return out


def _null_rows_db() -> duckdb.DuckDBPyConnection:
    con = duckdb.connect(":memory:")
    cols = ", ".join(f"{c.name} {SQL_TYPES[c.type]}" for c in NULLS_TABLE.columns.values())
    con.execute(f"CREATE TABLE visits ({cols})")
    con.execute(f"INSERT INTO visits VALUES {', '.join(NULL_ROWS)}")
    return con


def _unsound(
    claims: list[tuple[str, str, bool]], con: duckdb.DuckDBPyConnection, first: bool = False
) -> list[str]:
    """The expressions claimed never NULL that DuckDB evaluates to NULL on some row (a row on
    which evaluating it raises does not count: TRY makes it NULL, told apart from a NULL);
    ``first``: stop at the first."""
    out: list[str] = []
    for engine_sql, written, nullable in claims:
        if nullable:
            continue
        probe = f"SELECT TRY(CASE WHEN ({engine_sql}) IS NULL THEN 1 ELSE 0 END) FROM visits v"
        try:
            found = con.execute(probe).fetchall()
        except duckdb.Error:
            continue  # does not bind (a mistyped generated expression)
        if any(row[0] == 1 for row in found):
            out.append(written)
            if first:
                break
    return out


def test_a_not_nullable_fact_is_never_null_on_rows_with_nulls() -> None:
    """DuckDB evaluates every expression the fact calls never-NULL on rows with NULLs in every
    nullable column: none is NULL. The hand-written cases keep their answers."""
    claims = _nullability_claims()
    by_sql = {written: nullable for _, written, nullable in claims}
    assert {sql: by_sql[sql] for sql in NULLABLE_CASES} == NULLABLE_CASES
    con = _null_rows_db()
    try:
        assert _unsound(claims, con) == []
    finally:
        con.close()
    assert sum(not nullable for _, _, nullable in claims) >= 40  # enough claims were tried


@pytest.mark.parametrize("mutated", [exp.Case, exp.Coalesce, exp.Div, exp.Column, exp.Nullif])
def test_a_rule_claiming_never_null_wrongly_is_caught(mutated: type, monkeypatch) -> None:
    """Make one rule say "never NULL" for its operator: the evaluation above finds a row on
    which DuckDB says NULL (the soundness test has teeth for each of these operators)."""
    monkeypatch.setitem(nullability._RULES, mutated, lambda node, table: False)
    con = _null_rows_db()
    try:
        assert _unsound(_nullability_claims(), con, first=True) != []
    finally:
        con.close()


def test_a_constant_case_key_has_a_null_bin_by_its_nullable_fact() -> None:
    """A CASE key of constants: its NULL bin is released when the node can be NULL (no ELSE,
    a NULL branch), not otherwise."""

    def domain(sql: str) -> tuple:
        key = GroupKey(expr=_node(sql), columns=("age",))
        found = key_domain(key, TABLE, 100, lambda *args: [])
        assert found is not None
        return found

    assert domain("CASE WHEN age > 60 THEN 'old' ELSE 'young' END") == ("old", "young")
    assert domain("CASE WHEN age > 60 THEN 'old' END") == ("old", None)
    assert domain("CASE WHEN age > 60 THEN 'old' WHEN age < 5 THEN NULL ELSE 'x' END") == (
        "old",
        "x",
        None,
    )
