"""WHEREs simple enough to evaluate without DuckDB: comparisons, BETWEEN, IN and IS NULL between
a stored column and literals of its own kind (numbers, strings, TRUE/FALSE, ISO dates), joined
by AND, OR and NOT.

Two users: column programs (dpsql.lower.local_plan) evaluate such a WHERE on columns in memory,
and typing (dpsql.frontend.typecheck) knows its type without asking DuckDB's binder: every such
condition is BOOLEAN and binds (its columns are the table's, each literal compares with its
column without a cast that could fail), and a bare stored column key has its declared type.
"""

from __future__ import annotations

import datetime
from typing import cast

from sqlglot import exp

from dpsql.frontend.facts import UNSET, condition_fact, facts
from dpsql.frontend.safety import iso_day
from dpsql.policy import SQL_TYPES, ColumnPolicy, TablePolicy

# column types a program reads, and the ones a key may have (their DuckDB names)
READ_TYPES = ("int", "float", "text", "bool", "date")
KEY_TYPES = {"int": "BIGINT", "text": "VARCHAR", "bool": "BOOLEAN"}
COMPARISONS = (exp.EQ, exp.NEQ, exp.GT, exp.GTE, exp.LT, exp.LTE)


def stored(table: TablePolicy, name: str) -> ColumnPolicy | None:
    """The policy column ``name`` if it is a stored column a program may read, else None."""
    spec = table.columns.get(name)
    if spec is None or spec.expr is not None or spec.type not in READ_TYPES:
        return None
    return spec


def readable(node: exp.Expression, table: TablePolicy) -> bool:
    """Whether every node of a WHERE is one the engine's evaluator mirrors (literals are
    checked again there, with the statement's own values): a fact computed once per node and
    table (dpsql.frontend.facts), read by typing and again by the column programs."""
    return condition_fact(node, table, "readable", _leaf_readable)


def declared_type(node: exp.Expression, table: TablePolicy) -> str | None:
    """The DuckDB type of ``node`` known without DuckDB's binder, or None (ask the binder): a
    bare stored column's declared type (as the shadow table declares it), BOOLEAN for a
    condition :func:`readable` accepts. A fact computed once per node (dpsql.frontend.facts);
    once the shadow binder typed the node (dpsql.frontend.typecheck.type_query), its answer."""
    record = facts(node, table)
    found = record.type
    if found is UNSET:
        spec = stored_column(node, table)
        if spec is not None:
            found = SQL_TYPES[spec.type]
        else:
            found = "BOOLEAN" if readable(node, table) else None
        record.type = found
    return cast(str | None, found)


def _leaf_readable(node: exp.Expression, table: TablePolicy) -> bool:
    """The rule of :func:`readable` for a node that is not a connective."""
    if isinstance(node, exp.Boolean):
        return True
    if isinstance(node, exp.Column):  # a bool column as a condition
        spec = stored_column(node, table)
        return spec is not None and spec.type == "bool"
    if isinstance(node, exp.Is):
        return isinstance(node.expression, exp.Null) and stored_column(node.this, table) is not None
    if isinstance(node, COMPARISONS):
        spec, other = stored_column(node.this, table), node.expression
        if spec is None:  # the column on the right: 5 < age
            spec, other = stored_column(other, table), node.this
        return _comparable(spec, other)
    if isinstance(node, exp.Between):
        spec = stored_column(node.this, table)
        return _comparable(spec, node.args["low"]) and _comparable(spec, node.args["high"])
    if isinstance(node, exp.In):
        spec = stored_column(node.this, table)
        if node.args.get("query") or node.args.get("unnest") or node.args.get("field"):
            return False
        items = node.expressions
        return bool(items) and all(_comparable(spec, item) for item in items)
    return False


def stored_column(node: exp.Expression, table: TablePolicy) -> ColumnPolicy | None:
    """The policy column an unqualified column reference names, if it is stored (every policy
    type is readable); None for anything else."""
    if not isinstance(node, exp.Column) or node.table:
        return None
    return stored(table, node.name)


def _comparable(spec: ColumnPolicy | None, literal: exp.Expression) -> bool:
    """A literal the evaluator compares with column ``spec`` exactly as DuckDB does: a number
    with an int or float column, a string with a text column, TRUE/FALSE with a bool one, an
    ISO date (``'2024-03-01'`` or ``DATE '2024-03-01'``) with a date one."""
    if spec is None:
        return False
    kind = spec.type
    if kind == "date":
        return iso_date(literal) is not None
    if isinstance(literal, exp.Neg):
        literal = literal.this
        if not isinstance(literal, exp.Literal) or literal.is_string:
            return False
    if isinstance(literal, exp.Boolean):
        return kind == "bool"
    if not isinstance(literal, exp.Literal):
        return False
    return kind == "text" if literal.is_string else kind in ("int", "float")


def iso_date(literal: exp.Expression) -> datetime.date | None:
    """The date of a string literal spelled YYYY-MM-DD (also under CAST(... AS DATE)), a valid
    day of years 1..9999 (dpsql.frontend.safety.iso_day); None for anything else (DuckDB reads
    more spellings, which are left to it)."""
    if isinstance(literal, exp.Cast) and literal.to.is_type(exp.DataType.Type.DATE):
        literal = literal.this
    if not isinstance(literal, exp.Literal) or not literal.is_string:
        return None
    return iso_day(str(literal.this))
