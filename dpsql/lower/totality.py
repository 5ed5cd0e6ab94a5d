"""An independent check of engine SQL: no comparison the engine runs outside TRY mixes types.

The boundary's rule (dpsql.policy.comparable) is enforced where plans are built: WHERE
conditions run without TRY only when dpsql.frontend.safety proves both sides one type family, and
every join's ON compares one family by construction (dpsql.policy.JoinedSource). This module
checks the *output* instead of the builders: it types the SQL the engine is about to run with
sqlglot's optimizer (qualify, then annotate_types over the tables' declared engine types) and
lists every comparison outside ``TRY`` whose two sides belong to different families (a text
value against a number, a date against text: the engine would cast one side, and the cast
fails on some values). A builder that forgets the rule shows up here on any query that reaches
it; the differential fuzz test runs it on every statement of its join and scoping corpus.

It costs tens of milliseconds a statement (sqlglot's optimizer), so it is a test oracle, not a
per-query step. An operand sqlglot cannot type is not reported: the check can miss, never
refuse a correct plan.

>>> schema = {"t": {"a": "VARCHAR", "b": "BIGINT", "c": "DOUBLE"}}
>>> mixed_comparisons("SELECT COUNT(*) FROM t JOIN u ON t.a = u.b", {**schema, "u": {"b": "INT"}})
['t.a = u.b: TEXT against INT']
>>> mixed_comparisons("SELECT COUNT(*) FROM t WHERE TRY(a = 1) AND b > c", schema)
[]
"""

from __future__ import annotations

from collections.abc import Mapping

import sqlglot
from sqlglot import exp
from sqlglot.optimizer.annotate_types import annotate_types
from sqlglot.optimizer.qualify import qualify

_COMPARISONS = (exp.EQ, exp.NEQ, exp.GT, exp.GTE, exp.LT, exp.LTE, exp.NullSafeEQ, exp.Between)


def _family(node: exp.Expr) -> str | None:
    dtype = node.type
    if dtype is None or dtype.this in (exp.DataType.Type.UNKNOWN, exp.DataType.Type.NULL):
        return None
    if dtype.this in exp.DataType.TEXT_TYPES:
        return "text"
    if dtype.this in exp.DataType.NUMERIC_TYPES:
        return "number"
    if dtype.this in exp.DataType.TEMPORAL_TYPES:
        return "date"
    if dtype.this == exp.DataType.Type.BOOLEAN:
        return "bool"
    return dtype.this.value  # any other type is its own family


def _under_try(node: exp.Expr) -> bool:
    parent = node.parent
    while parent is not None:
        if isinstance(parent, exp.Try | exp.TryCast):
            return True
        parent = parent.parent
    return False


def _operands(node: exp.Expr) -> list[tuple[exp.Expr, exp.Expr]]:
    if isinstance(node, exp.Between):
        return [(node.this, node.args["low"]), (node.this, node.args["high"])]
    if isinstance(node, exp.In):
        return [(node.this, e) for e in node.expressions]
    return [(node.this, node.expression)]


def mixed_comparisons(
    sql: str, schema: Mapping[str, Mapping[str, str]], dialect: str = "duckdb"
) -> list[str]:
    """Each comparison of ``sql`` outside TRY whose sides are of different type families,
    as ``'<comparison>: <type> against <type>'`` (empty: none found)."""
    tree = sqlglot.parse_one(sql, dialect=dialect)
    tree = qualify(
        tree,
        schema=dict(schema),
        dialect=dialect,
        validate_qualify_columns=False,
        quote_identifiers=False,
    )
    tree = annotate_types(tree, schema=dict(schema), dialect=dialect)
    found = []
    for node in tree.find_all(*_COMPARISONS, exp.In):
        if _under_try(node):
            continue
        for left, right in _operands(node):
            a, b = _family(left), _family(right)
            if a is not None and b is not None and a != b:
                assert left.type is not None and right.type is not None
                found.append(
                    f"{node.sql(dialect=dialect)}: {left.type.sql()} against {right.type.sql()}"
                )
                break
    return found
